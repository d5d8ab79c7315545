"""A burst of new prompts beside few decoding sequences: prefill them first, then decode.

Decode first, with prompt chunks in what is left of a small step budget, keeps every running
stream moving while one prompt prefills beside it. It is the wrong order when a wave of requests
arrives together (a benchmark's first requests, or the next wave as the first ones finish
together): with one sequence decoding and 31 prompts waiting, the prompts crawled in a few dozen
tokens a step, each step paying for the decode rows beside them, and every new stream's first
token waited for all of it. A burst instead runs the waiting prompts first
come first served in prefill-only steps, a few whole prompts a step, so that the k-th prompt's
first token waits for k prompts' work, not for the whole wave; the few decoding sequences pay one
longer gap instead of many slower steps.

A burst starts when the sequences prefilling are at least twice those decoding (and two or more):
one long prompt beside running streams is never a burst, its chunks go beside them as before. It
takes in prompts that arrive while it runs (the rest of the wave, admitted a few milliseconds
apart), and ends when no prompt waits or when it has run a given number of prompt tokens (the idle
budget: the longest the decoding sequences wait). A decode step always runs between two bursts.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

BURST_STEP_TOKENS = 256  # a burst step's prompts, whole (a longer first prompt goes alone, in chunks)


class Bursts:
    """Decides, step by step, which prompts run before the decode rows; not thread-safe (the step loop's lock)."""

    def __init__(self) -> None:
        self._members: set[Hashable] = set()  # the burst's prompts not yet in (empty: no burst)
        self._tokens = 0  # prompt tokens the burst has run
        self._owed_decode = False  # a burst ended: the next step decodes first

    def members(self, prefilling: Iterable[Hashable], decoding: int, max_tokens: int) -> set[Hashable]:
        """The members whose prompts this step runs before (and instead of) the decode rows, given
        the members with prompt work pending, how many sequences decode, and the most prompt tokens
        a burst may run; empty: decode first."""
        waiting = set(prefilling)
        if self._members and waiting and self._tokens < max_tokens and decoding:
            self._members = waiting  # prompts that arrive meanwhile join it: they came with the wave
            return self._members
        if self._members or self._tokens:  # it ran its course: the decoding sequences go next
            self._members, self._tokens, self._owed_decode = set(), 0, True
        if self._owed_decode or not decoding or len(waiting) < max(2, 2 * decoding):
            self._owed_decode = False
            return set()
        self._members = waiting
        return self._members

    def stop(self) -> bool:
        """End the burst now, if one runs (its prompts found no room in the KV pool: the decoding
        sequences step, and finish, first); whether one ran."""
        if not self._members:
            return False
        self._members, self._tokens, self._owed_decode = set(), 0, True
        return True

    def ran(self, tokens: int) -> None:
        """A burst step ran `tokens` prompt tokens."""
        self._tokens += tokens
