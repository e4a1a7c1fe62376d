"""Tokens to text, as they come: the text that is safe to send, and stop strings.

Decoding is incremental (vLLM's scheme): each step decodes only the tokens since the previous
step's, with the step before as context (a tokenizer may render a token differently at the start
of a text), so a long generation costs linear time, not quadratic. A token may end inside a
multi-byte character (the decoder shows U+FFFD until the next token completes it): its text waits
for the next step. A stop string may be split over steps, so the tail that could begin one is
held back; a stop string found ends the text just before it (it is never sent, as OpenAI does),
or just after it (`include_stop`, vLLM's include_stop_str_in_output). Special tokens (eos, a
template's markers) are left out of the text unless `skip_special=False` (vLLM's
skip_special_tokens).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stops: list[str], skip_special: bool = True, include_stop: bool = False):
        self.tokenizer, self.stops = tokenizer, stops
        self.skip_special, self.include_stop = skip_special, include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0  # the context tokens, the tokens already in `text`
        self.text = ""  # the decoded text so far
        self.sent = 0  # characters of `text` already sent
        self.stopped = False  # a stop string was found: nothing more is sent

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _advance(self, final: bool) -> None:
        """Appends the text of the tokens not yet decoded (unless it ends mid-character)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith(REPLACEMENT)):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _stop_at(self) -> int | None:
        """Where the text ends at the first stop string (before it, or after it: include_stop)."""
        start = max(0, self.sent - self.hold)
        found = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
        if not found:
            return None
        at, length = min(found)
        return at + length if self.include_stop else at

    def add(self, ids: list[int]) -> str:
        """The new text these tokens make sendable."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._advance(final=False)
        return self._release(len(self.text) - self.hold)

    def finish(self) -> str:
        """The rest of the text once no token follows."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        cut = self._stop_at()
        if cut is not None:
            self.stopped, end = True, cut
        new = self.text[self.sent : max(end, self.sent)]
        self.sent += len(new)
        return new
