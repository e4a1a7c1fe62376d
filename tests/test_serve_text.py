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


@pytest.mark.parametrize("step", [1, 3, 64])
def test_include_stop_str_in_output_ends_the_text_after_the_stop(step):
    ids, stream, pieces = list(TEXT.encode()), TextStream(Bytes(), ["東京", "straße"], include_stop=True), []
    for i in range(0, len(ids), step):
        pieces.append(stream.add(ids[i : i + step]))
        if stream.stopped:
            break
    assert "".join(pieces) == TEXT[: TEXT.find("straße") + len("straße")] and stream.stopped


class Marked:
    """Bytes, with 0 a special token shown as <s> unless skipped."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        parts = [b"" if t == 0 and skip_special_tokens else (b"<s>" if t == 0 else bytes([t])) for t in ids]
        return b"".join(parts).decode("utf-8", errors="replace")


@pytest.mark.parametrize("skip, text", [(True, "ab"), (False, "a<s>b<s>")])
def test_skip_special_tokens(skip, text):
    stream = TextStream(Marked(), [], skip_special=skip)
    assert stream.add([97, 0, 98]) + stream.add([0]) + stream.finish() == text
