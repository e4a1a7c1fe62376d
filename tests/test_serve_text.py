"""The server's tokens-to-text stream (`infer.serve.text`) on a byte-level tokenizer: multi-byte
characters split over tokens, stop strings split over steps, any step size."""

from __future__ import annotations

import pytest

from infer.serve.text import TextStream


class Bytes:
    """A token is a byte; an incomplete UTF-8 character decodes to U+FFFD, as real decoders do."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


REPLACEMENT = "\ufffd"
TEXT = "naïve café → über straße, 東京 done; the end"


def streamed(stops, step):
    ids = list(TEXT.encode())
    stream, pieces = TextStream(Bytes(), stops), []
    for i in range(0, len(ids), step):
        pieces.append(stream.add(ids[i : i + step]))
        assert REPLACEMENT not in pieces[-1]
        if stream.stopped:
            return "".join(pieces), True
    return "".join(pieces) + stream.finish(), stream.stopped


@pytest.mark.parametrize("step", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("stops", [[], ["→ ü"], ["東京", "straße"], ["never"], ["d", "end"]])
def test_text_as_one_decode_cut_before_the_first_stop(stops, step):
    text, stopped = streamed(stops, step)
    cuts = [TEXT.find(s) for s in stops if s in TEXT]
    assert text == (TEXT[: min(cuts)] if cuts else TEXT)
    assert stopped == bool(cuts)
