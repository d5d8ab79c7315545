"""What a prompt chunk costs a shared step, its attention over the context counted.

A step's token budget counts rows, and a decode row and a prompt row cost about the same in the
products. A prompt row also attends over every position before it, and far into a long prompt
that attention outweighs its products, so a fixed chunk size made the decoding streams' steps
grow with every chunk (docs/serving.md, "Step planning for waves and long prompts"). Counting
each row's attention in the budget keeps every step near the same
cost: a chunk gets fewer tokens as its prompt goes on.

The unit is one row's products. Attending over `p` positions costs `p / keys_per_row` of them:
the model's multiply-adds per row against those of one attended position, times how much more
an attention multiply-add costs than a product's on the engine's CPU path. That weight depends on
which prompt attention the model was built with (`ModelOps.prompt_attention`, bound at load), each
measured beside the products it is bound with: the grouped, key-blocked C kernel
(`fast/chunk_attention`) beside float32 rows, its rounded twin (int16 dot products) beside the
rounded rows' integer tiles, or another (torch's SDPA, where the model runs torch's operations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minengine.config import ModelConfig
from minengine.fast.chunk_attention import attend_chunk, attend_chunk_rounded
from minengine.model.ops import ModelOps

# An attended position's multiply-add against a product's, on the default model's shape: the attention's time
# per (query head x key) over every layer of a 3,000-position cache against a 64-token chunk's time a row,
# by `scripts/chunk_attention_cost --threads 1 --clock cpu` (docs/lab/long-prompt.md). The C chunk kernel
# is bound where the products multiply float32 rows, and is measured beside them (its AVX2 build, on a
# 2-core Zen 3 EPYC; the runs and the older Zen 4 figure beside int16 tiles are in the lab book).
KEYBLOCKED_MAC_WEIGHT = 1.0
# The kernel's rounded twin (its scores and weighted values int16 dot products), beside the int16 tiles, Zen 4.
ROUNDED_MAC_WEIGHT = 1.4
# For any other prompt attention: fitted to chunk steps' times through SDPA on the 2-core Xeon
# (docs/lab/serving-against-vllm.md, "Step planning for waves and long prompts").
ATTENTION_MAC_WEIGHT = 4.3


@dataclass(frozen=True)
class ChunkCost:
    """A prompt chunk's cost in rows: each token one row, plus its attention over the positions it sees."""

    keys_per_row: float  # attended positions that cost as much as one row's products

    @classmethod
    def of_model(cls, cfg: ModelConfig, ops: ModelOps | None = None) -> ChunkCost:
        """The weights of `cfg`'s rows and attended positions, for a model built with `ops` (None: its
        prompt attention another than the C chunk kernel's or its twin's); see the module docstring."""
        hidden, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * cfg.intermediate_size
        row = cfg.num_hidden_layers * per_layer + cfg.vocab_size * hidden
        position = 2 * cfg.num_hidden_layers * q  # q.k and the weighted value, every query head
        attend = ops.prompt_attention if ops is not None else None
        weight = {attend_chunk: KEYBLOCKED_MAC_WEIGHT, attend_chunk_rounded: ROUNDED_MAC_WEIGHT}.get(
            attend, ATTENTION_MAC_WEIGHT)  # type: ignore[arg-type]
        return cls(row / position / weight)

    def rows(self, start: int, tokens: int) -> float:
        """The cost of prompt positions start .. start + tokens - 1, each seeing itself and all before it."""
        seen = tokens * start + tokens * (tokens + 1) / 2
        return tokens + seen / self.keys_per_row

    def tokens(self, start: int, left: int, budget: float) -> int:
        """The most of `left` tokens from position `start` whose cost fits `budget` rows (never more
        tokens than rows in it, and 0 where not even one fits)."""
        most = min(left, math.floor(budget))
        if most <= 0 or self.rows(start, most) <= budget:
            return max(most, 0)
        # rows(start, n) grows with n: solve n + (n*start + n(n+1)/2) / k = budget for n.
        k = self.keys_per_row
        b = 1 + (start + 0.5) / k
        n = math.floor((-b + math.sqrt(b * b + 2 * budget / k)) * k)
        while n > 0 and self.rows(start, n) > budget:  # the float root may land one over
            n -= 1
        return n
