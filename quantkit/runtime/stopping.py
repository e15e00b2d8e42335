"""Stop strings in a stream of text.

Text that could be the start of a stop string is held back until it is known not to be one, so
a stop string split across tokens never leaks, even partially. On a match, only the text before
the stop string is released and the request finishes with reason `stop`.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self.pending = ""  # held back: a suffix that a stop string may start with
        self.stopped = False

    def _held_length(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def feed(self, text: str) -> str:
        """Add newly decoded text; returns what may be emitted now."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            self.stopped = True
            self.pending = ""
            return buf[: min(i for i, _ in hits)]
        keep = self._held_length(buf)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation: the held-back text was not a stop string after all."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
