"""The smallest KV budget a request can run in, and the error for one below it.

A request holds at least one whole block of KV from its first token on, so a budget under one
block could never admit anything. Waiting would not help, so it is refused at start, with one
line naming the setting and the value that would do, rather than refusing every request later.
"""

from __future__ import annotations

from minengine.config import ModelConfig
from minengine.errors import AdmissionError, Setting
from minengine.kv.arithmetic import MIB, kv_bytes_in_blocks, stored_kv_heads


def smallest_request_bytes(cfg: ModelConfig, kv_layout: str, bytes_per_element: int, block_size: int) -> int:
    """The KV the smallest request holds: one `block_size`-token block, every layer."""
    heads = stored_kv_heads(kv_layout, cfg.num_attention_heads, cfg.num_key_value_heads)
    return kv_bytes_in_blocks(cfg.num_hidden_layers, heads, cfg.head_dim, bytes_per_element, block_size, block_size)


def check_budget_holds_a_request(kv_budget_bytes: int, one_block_bytes: int, block_size: int) -> None:
    """Refuse a KV budget that cannot hold one request, not even its first block (AdmissionError)."""
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
