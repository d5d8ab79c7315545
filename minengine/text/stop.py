"""Stop strings, matched across token boundaries and never half printed.

Streamed text is held back while its tail could still grow into a stop string; it is released
as soon as no stop string can match there any more.
"""

from __future__ import annotations


class StopMatcher:
    """Feed visible text deltas; get back what is safe to stream and whether a stop matched."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, True when a stop string was reached)."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held text at the end of a request that stopped for another reason."""
        held, self._held = self._held, ""
        return held

    def _longest_partial(self, buf: str) -> int:
        # Length of the longest tail of buf that is a proper prefix of some stop string.
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
