"""Admission refusals say which number to change: the prompt, max_tokens or the KV budget."""

from __future__ import annotations

import re

import pytest

from minengine.engine.scheduler import Scheduler
from minengine.errors import AdmissionError
from reqscope.wording import error_text


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "needle", "not_said"),
    [
        (2048, 1, "shorten the prompt", "--max-tokens"),  # the prompt alone fills the context
        (4000, 16, "the prompt alone is 4000 tokens", "--max-tokens"),
        (2000, 100, "lower --max-tokens", "shorten the prompt"),  # max_tokens is what overflows
    ],
)
def test_over_context_names_what_to_change(prompt, max_tokens, needle, not_said):
    scheduler = Scheduler(kv_budget_bytes=1 << 30)
    with pytest.raises(AdmissionError) as info:
        scheduler.admit("r", prompt_tokens=prompt, max_tokens=max_tokens, context_limit=2048, kv_bytes=1)
    said = error_text(info.value)  # in the words the user reads
    assert re.search(needle, said)
    assert not_said not in said
    assert scheduler.held_bytes == 0  # nothing reserved by a refused request


def test_a_prompt_that_leaves_room_for_one_token_is_admitted():
    scheduler = Scheduler(kv_budget_bytes=1 << 30)
    admission = scheduler.admit("r", prompt_tokens=2047, max_tokens=1, context_limit=2048, kv_bytes=1)
    assert scheduler.held_bytes == 1
    scheduler.release(admission)
    assert scheduler.held_bytes == 0


def test_the_queue_is_first_come_first_served():
    """A small request that would fit waits behind an earlier large one (vLLM's FCFS), and both
    are admitted in arrival order once room is made."""
    import threading
    import time

    scheduler = Scheduler(kv_budget_bytes=100)
    first = scheduler.admit("running", prompt_tokens=1, max_tokens=1, context_limit=2048, kv_bytes=60)
    order: list[str] = []

    def wait_for(name: str, kv_bytes: int) -> None:
        admission = scheduler.admit(name, prompt_tokens=1, max_tokens=1, context_limit=2048, kv_bytes=kv_bytes)
        order.append(name)
        del admission

    large = threading.Thread(target=wait_for, args=("large", 80), daemon=True)
    large.start()
    while scheduler.waiting < 1:
        time.sleep(0.005)
    small = threading.Thread(target=wait_for, args=("small", 10), daemon=True)  # 60 + 10 fits, but "large" came first
    small.start()
    while scheduler.waiting < 2:
        time.sleep(0.005)
    time.sleep(0.2)
    assert order == [] and scheduler.waiting == 2
    scheduler.release(first)  # room for "large" (80), then "small" beside it (90)
    large.join(timeout=5)
    small.join(timeout=5)
    assert order == ["large", "small"] and scheduler.waiting == 0 and scheduler.held_bytes == 90
