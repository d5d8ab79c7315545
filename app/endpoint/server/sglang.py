"""SGLang's own view of a request, where a server sends it: `meta_info` on a chunk, and its `/metrics`.

UNTESTED against a live SGLang: it needs a GPU, and none was at hand. The field and metric names
follow SGLang's documentation (../shared/notes/peers.md): its native `/generate` puts `meta_info`
on every chunk, and `/metrics` exports `sglang:num_running_reqs`, `sglang:num_queue_reqs` and
`sglang:token_usage`. Every figure keeps SGLang's name, and every line that shows one says it is
untested, so nobody reads more into it than was checked.
"""

from __future__ import annotations

from reqscope.endpoint.json_values import figures_from
from reqscope.endpoint.server.prometheus import read_metrics
from reqscope.endpoint.server.records import BatchSample, SglangMetaInfo

UNTESTED = "untested against a live SGLang"
RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
TOKEN_USAGE = "sglang:token_usage"
SGLANG_METRICS = (RUNNING, WAITING, TOKEN_USAGE)


def parse_meta_info(chunk: dict) -> SglangMetaInfo | None:
    """The `meta_info` object a chunk carries, or None; a field missing or not a number stays None."""
    raw = chunk.get("meta_info")
    if not isinstance(raw, dict):
        return None
    meta = figures_from(SglangMetaInfo, raw)
    return None if meta == SglangMetaInfo() else meta


def sglang_batch_sample(text: str, t_ms: float, poll_ms: float) -> BatchSample:
    """One SGLang `/metrics` page as a batch sample (`token_usage` standing for KV use, 0 to 1)."""
    values = read_metrics(text, SGLANG_METRICS)
    return BatchSample(
        t_ms=t_ms,
        source=f"SGLang /metrics ({UNTESTED})",
        running=values.get(RUNNING),
        waiting=values.get(WAITING),
        kv_usage=values.get(TOKEN_USAGE),
        poll_ms=poll_ms,
    )


def meta_info_line(meta: SglangMetaInfo) -> str:
    """The fields SGLang sent, by its names, in one line."""
    shown = ", ".join(f"{name} {value}" for name, value in vars(meta).items() if value is not None)
    return f"SGLang meta_info ({UNTESTED}): {shown}"
