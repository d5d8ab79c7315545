"""SGLang's fields as its documentation shapes them: `meta_info` on a chunk, and its `/metrics` names.

These are NOT tests against SGLang (it needs a GPU, and none was at hand): they hold the parsing
to the documented shapes, and that every figure shown says it is untested against a live SGLang.
"""

from __future__ import annotations

import json

from reqscope.endpoint.server.records import SglangMetaInfo
from reqscope.endpoint.server.sglang import meta_info_line, parse_meta_info, sglang_batch_sample
from reqscope.endpoint.wire import parse_chunk

META = {"prompt_tokens": 38, "completion_tokens": 12, "cached_tokens": 16, "queue_time": 0.004,
        "prefill_launch_latency": 0.021, "e2e_latency": 0.35, "total_retractions": 1, "id": "abc"}


def test_meta_info_is_read_under_sglangs_names_and_said_untested():
    chunk = {"text": "Hi", "meta_info": META}
    meta = parse_meta_info(chunk)
    assert meta == SglangMetaInfo(38, 12, 16, 0.004, 0.021, 0.35, 1)
    assert parse_chunk(json.dumps(chunk)).sglang_meta == meta
    line = meta_info_line(meta)
    assert line.startswith("SGLang meta_info (untested against a live SGLang): prompt_tokens 38")
    assert "total_retractions 1" in line
    assert parse_meta_info({"meta_info": {"id": "x"}}) is None  # nothing reqscope reads: not a report
    assert parse_meta_info({"meta_info": {"queue_time": "soon"}}) is None


def test_its_metrics_page_becomes_a_batch_sample():
    page = "\n".join([
        "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{model_name="m"} 3.0',
        'sglang:num_queue_reqs{model_name="m"} 2.0',
        'sglang:token_usage{model_name="m"} 0.25',
        'sglang:other{model_name="m"} 9.0',
    ])
    sample = sglang_batch_sample(page, t_ms=12.0, poll_ms=1.5)
    assert (sample.running, sample.waiting, sample.kv_usage) == (3.0, 2.0, 0.25)
    assert "untested against a live SGLang" in sample.source and sample.poll_ms == 1.5
