"""A token's walk from `ModelRunner.forward_rows` to the explorer's tokens panel, as
`scripts/count_hops` counts it: three threads, two hand-offs back, and no relay on the way."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
MOST_HOPS = 17  # docs/engine.md, "From a keypress to a token", gives the walk


def test_a_token_reaches_the_screen_in_two_hand_offs_and_no_relay(default_model_dir):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts/count_hops"), "--model", str(default_model_dir), "--max-tokens", "3",
         "--token", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    walk = [line.split() for line in run.stdout.splitlines() if re.match(r"\s*\d+\s", line)]
    threads = [hop[1] for hop in walk]
    functions = [hop[-1] for hop in walk]
    # forward_rows returns on the model thread, the run thread samples and streams, the UI draws.
    assert [t for i, t in enumerate(threads) if i == 0 or threads[i - 1] != t] == [
        "minengine-steps", "reqscope-runs", "MainThread"
    ]  # fmt: skip
    assert functions[0].endswith("StepLoop._step") and functions[-1].endswith("tokens:_output_chip")
    assert "minengine.engine.session:RequestSession._stream" in functions  # where it becomes a TokenEvent
    relays = [f for f in functions if "in_app_words" in f or "<lambda>" in f]
    assert not relays, f"a relay is back on a token's way: {relays}"
    total = re.search(r"token 1: (\d+) hops in \d+ modules, 2 hand-offs between threads", run.stdout)
    assert total is not None, run.stdout
    assert int(total.group(1)) == len(walk) <= MOST_HOPS, (
        f"a token's walk grew to {total.group(1)} hops (at most {MOST_HOPS}): does each new one work on it?\n"
        + run.stdout
    )
