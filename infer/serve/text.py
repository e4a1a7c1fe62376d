"""Tokens to text, as they come: the text that is safe to send, and stop strings.

A token may end inside a multi-byte character (the decoder shows U+FFFD until the next token
completes it) and a stop string may be split over tokens, so the text a step can send is the
decoded text minus such a tail; a stop string found ends the text just before it (it is never
sent, as OpenAI does).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already sent
        self.stopped = False  # a stop string was found: nothing more is sent

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _stop_at(self, text: str) -> int | None:
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def add(self, ids: list[int]) -> str:
        """The new text these tokens make sendable (held back: a partial character, and a tail
        that may begin a stop string)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self._decoded()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._send(text[:cut])
        hold = max((len(s) for s in self.stops), default=1) - 1
        end = len(text) - hold
        while end > self.sent and text[end - 1] == REPLACEMENT:
            end -= 1
        return self._send(text[:end])

    def finish(self) -> str:
        """The rest of the text once no token follows."""
        return "" if self.stopped else self._send(self._decoded())

    def _send(self, text: str) -> str:
        new = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return new
