"""The records of what a step did inside: its attention over the cache, its logit lens, their cost.

Frozen records of scalars and tuples (no tensors), so a `TokenEvent` carrying them can go to
another thread, to --json and into a trace as they are. Positions are absolute (0 is the first
prompt token); layers and heads are 0-based.
"""

from __future__ import annotations

from dataclasses import dataclass

STRIP_MAX = 2048  # per-position weights kept for one layer; a longer context is bucketed to this many


@dataclass(frozen=True)
class Attended:
    """One cached position and the attention weight a query gave it."""

    position: int
    weight: float


@dataclass(frozen=True)
class HeadAttention:
    """One query head's attention at the step: how concentrated, and on what."""

    head: int
    kv_head: int  # the stored K/V head it read: query heads sharing one are a GQA group (under mha, its own)
    entropy: float  # nats over every position attended; 0 all on one, ln(context) spread evenly
    top: tuple[Attended, ...]  # the most-attended positions, weight descending

    @property
    def top_weight(self) -> float:
        """The weight on its most-attended position."""
        return self.top[0].weight if self.top else 0.0


@dataclass(frozen=True)
class PositionWeights:
    """Every position's weight in one layer (the mean over its heads), for shading the prompt.

    Value i covers positions [i*bucket, (i+1)*bucket) and is their sum, so the values still sum to
    1; bucket is 1 up to `STRIP_MAX` positions, then ceil(context / STRIP_MAX).
    """

    bucket: int
    weights: tuple[float, ...]

    def weight_at(self, position: int) -> float:
        """The weight of `position`'s bucket divided evenly over its positions."""
        i = position // self.bucket
        return self.weights[i] / self.bucket if 0 <= i < len(self.weights) else 0.0


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention at the step."""

    layer: int
    heads: tuple[HeadAttention, ...]
    mean_top: tuple[Attended, ...]  # the most-attended positions of the mean over its heads
    strip: PositionWeights | None = None  # only when asked (`InspectAsk.strip`)

    @property
    def mean_entropy(self) -> float:
        """Its heads' mean entropy (nats)."""
        return sum(h.entropy for h in self.heads) / len(self.heads) if self.heads else 0.0


@dataclass(frozen=True)
class StepAttention:
    """Where the step's query looked: every layer's heads over the `context` cached positions.

    The query is the token fed at `query_position` (the last prompt token for the first
    generated token, else the previous generated one); it sees positions [0, context), itself
    included. With FP8 K/V the weights are those the dequantized keys gave, as in the step.
    """

    query_position: int
    context: int
    layout: str  # "gqa" or "mha": how the cache stored the K/V heads the step read
    q_heads: int
    kv_heads: int  # stored K/V heads (the query heads under mha)
    top_n: int  # positions asked for per head (fewer when the context is shorter)
    layers: tuple[LayerAttention, ...]

    @property
    def group_size(self) -> int:
        """Query heads per stored K/V head (1 under mha)."""
        return self.q_heads // self.kv_heads


@dataclass(frozen=True)
class LayerLens:
    """What one layer's residual stream would predict through the final norm and the head."""

    layer: int
    top_token: int
    top_piece: str
    top_prob: float
    chosen_rank: int  # 1 = the chosen token is this layer's top guess
    chosen_prob: float


@dataclass(frozen=True)
class StepLens:
    """The logit lens of the step: each layer's top guess and the chosen token's place in it.

    `basis` "vocab": probabilities are softmax over the whole vocabulary, ranks among all tokens.
    "candidates": over the step's `candidates` tokens only (its most likely ones by the final
    logits, and the chosen one), renormalised there: cheap enough for every step, but a
    probability here is not the vocabulary's. The last layer's is the step's own logits.
    """

    chosen: int  # the token tracked: the one committed (or, on demand while paused, the would-be one)
    chosen_piece: str
    basis: str  # "vocab" or "candidates"
    candidates: int  # tokens the basis holds (the vocabulary size for "vocab")
    layers: tuple[LayerLens, ...]

    @property
    def forms_at(self) -> int | None:
        """The first layer from which the chosen token stays the top guess, or None if it never is."""
        first = None
        for lens in reversed(self.layers):
            if lens.chosen_rank != 1:
                break
            first = lens.layer
        return first


@dataclass(frozen=True)
class InspectCost:
    """What capturing cost the step, measured as the explorer's other instruments are.

    `step_ms`: the captured step's forward and building these records; `plain_step_ms`: the median
    of the request's last single-token steps without capture (None until there is one, and for
    the prompt's step); `work_ms`: the capture's own work (its weights, copies and records).
    """

    step_ms: float
    plain_step_ms: float | None
    work_ms: float

    @property
    def cost_ms(self) -> float:
        """The step's extra time for inspecting: against the steps without capture when known
        (the switch off the lean decode path included), else the capture's own work."""
        if self.plain_step_ms is None:
            return self.work_ms
        return max(0.0, self.step_ms - self.plain_step_ms)


@dataclass(frozen=True)
class StepInspection:
    """What one step did inside, as asked (`InspectAsk`): its attention, its lens, and their cost.

    `on_demand`: computed later for a held step (the step recomputed, reading the cache, writing
    nothing) rather than captured as it ran.
    """

    attention: StepAttention | None
    lens: StepLens | None
    cost: InspectCost
    on_demand: bool = False
