"""How much one engine step may run, and the values the engine refuses before it runs anything.

vLLM's two limits, by vLLM's names: `max_num_seqs` caps the sequences one step runs together,
`max_num_batched_tokens` the tokens it schedules (one per running sequence's decode, plus
prompt chunks). A prompt longer than the token budget prefills in chunks over several steps.

Some values could never run a request, and waiting would not help; they are refused at start,
each with one line naming the setting and what to do: no sequence per step, a token budget
smaller than one KV block (a step could never complete a block), and a KV budget that cannot
hold the smallest request (one block).
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.config import ModelConfig
from minengine.errors import AdmissionError, BatchLimitError, Mention, Setting
from minengine.kv.arithmetic import MIB, kv_bytes_in_blocks, stored_kv_heads


@dataclass(frozen=True)
class BatchLimits:
    """A step's limits; None leaves the engine's default."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def check(self, block_size: int) -> None:
        """Refuse limits no request could run under (BatchLimitError), for KV blocks of `block_size` tokens."""
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise BatchLimitError(
                Mention(Setting.MAX_NUM_SEQS, str(self.max_num_seqs)),
                " lets no sequence into a step, so no request could ever run; give it 1 or more",
            )
        tokens = self.max_num_batched_tokens
        if tokens is not None and tokens < block_size:
            raise BatchLimitError(
                Mention(Setting.MAX_NUM_BATCHED_TOKENS, str(tokens)),
                f" is smaller than one KV block ({block_size} tokens), so a step could never fill one; raise ",
                Setting.MAX_NUM_BATCHED_TOKENS,
                f" to at least {block_size}",
            )

    def engine_arguments(self) -> dict[str, int]:
        """The limits that are set, as the Engine's keyword arguments."""
        limits = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens}
        return {name: value for name, value in limits.items() if value is not None}


def smallest_request_bytes(cfg: ModelConfig, kv_layout: str, bytes_per_element: int, block_size: int) -> int:
    """The KV the smallest request holds: one `block_size`-token block, every layer."""
    heads = stored_kv_heads(kv_layout, cfg.num_attention_heads, cfg.num_key_value_heads)
    return kv_bytes_in_blocks(cfg.num_hidden_layers, heads, cfg.head_dim, bytes_per_element, block_size, block_size)


def check_pool(kv_budget_bytes: int, one_block_bytes: int, block_size: int) -> None:
    """Refuse a KV budget that cannot hold one request: not even its first block (AdmissionError)."""
    if kv_budget_bytes >= one_block_bytes:
        return
    need = one_block_bytes / MIB
    raise AdmissionError(
        f"the KV budget cannot hold one request: the smallest, one block of {block_size} tokens, needs "
        f"{need:.2f} MiB of KV, budget {kv_budget_bytes / MIB:.1f} MiB; raise ",
        Setting.KV_BUDGET,
        f" to at least {_rounded_up(need)}",
    )


def _rounded_up(mib: float) -> str:
    """`mib` rounded up to two decimals, so the value named is enough."""
    hundredths = -(-mib * 100 // 1)
    return f"{hundredths / 100:.2f}"
