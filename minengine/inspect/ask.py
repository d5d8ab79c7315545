"""What a consumer asks to see inside the steps: nothing by default, so decode runs its lean path."""

from __future__ import annotations

from dataclasses import dataclass

from minengine.errors import RequestError

LENS_BASES = ("candidates", "vocab")


@dataclass(frozen=True)
class InspectAsk:
    """What to capture of a step; the default captures nothing.

    `attention_top`: the most-attended positions kept per head and per layer (0: no attention).
    `strip`: also every position's weight (the mean over a layer's heads, bucketed beyond
    `records.STRIP_MAX` positions), for shading the prompt.
    `lens`: the logit lens over "candidates" (the step's `lens_candidates` most likely tokens and
    the chosen one: cheap enough for every step) or "vocab" (the whole vocabulary: a head
    projection per layer, meant for the step on screen); None: no lens.
    """

    attention_top: int = 0
    strip: bool = False
    lens: str | None = None
    lens_candidates: int = 20

    def __post_init__(self) -> None:
        if self.attention_top < 0:
            raise RequestError(f"attention's top positions must be 0 or more, not {self.attention_top}")
        if self.lens is not None and self.lens not in LENS_BASES:
            raise RequestError(f"unknown logit lens basis {self.lens!r}; choose one of {', '.join(LENS_BASES)}")
        if self.lens_candidates < 1:
            raise RequestError(f"the lens needs 1 candidate or more, not {self.lens_candidates}")

    @property
    def attention(self) -> bool:
        """Whether attention weights are captured."""
        return self.attention_top > 0 or self.strip

    @property
    def anything(self) -> bool:
        """Whether the step captures anything (else it runs exactly as without inspection)."""
        return self.attention or self.lens is not None


NOTHING = InspectAsk()
FULL_VIEW = InspectAsk(attention_top=16, strip=True, lens="vocab")  # a held step on screen, on demand
