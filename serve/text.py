"""Generated tokens to text as they come, cut at the first stop string.

A stream and a whole response are built from the same deltas, so they hold the same text.  Text that a stop
string could still claim (its last ``len(stop) - 1`` characters) and a trailing partial UTF-8 character are
held back until the next token settles them.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already given out
        self.stopped = False  # a stop string was found: nothing more is given out

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text now safe to send (may be empty)."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        text = self._decoded()
        if text.endswith("\ufffd"):  # a character split over tokens: wait for its other bytes
            return ""
        first = None
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0 and (first is None or at < first):
                first = at
        if first is not None:
            self.stopped = True
            return self._give(text, max(first, self.sent))
        return self._give(text, len(text) - self.hold)

    def finish(self) -> str:
        """The generation ended without a stop string: the text held back goes out."""
        return "" if self.stopped else self._give(self._decoded(), None)

    def _give(self, text: str, upto: int | None) -> str:
        upto = len(text) if upto is None else upto
        if upto <= self.sent:
            return ""
        out, self.sent = text[self.sent : upto], upto
        return out
