"""`--background N` and `--serve-port PORT`: load on the run's own engine, in --plain and --json; bad values."""

from __future__ import annotations

import json
import re
import socket
import threading
import urllib.request

import pytest

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent
from reqscope import cli
from reqscope.engine_load import MAX_BACKGROUND, BackgroundLoad, EngineLoad, LoadOptions
from reqscope.run_options import DEFAULT_PROMPT


def _exit_code(argv: list[str]) -> int:
    """`reqscope ARGV`'s exit code, whether argparse exits (a usage error) or main returns."""
    try:
        return cli.main(argv)
    except SystemExit as exit:
        return int(exit.code or 0)


def _background_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("reqscope-bg-") and t.is_alive()]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--background", "-1"], "argument --background: -1 is negative"),
        (["--background", "two"], "argument --background: 'two' is not a whole number"),
        (["--background", str(MAX_BACKGROUND + 1)], f"give at most {MAX_BACKGROUND}"),
        (["--serve-port", "70000"], "--serve-port 70000 is not a TCP port"),
        (["--serve-port", "-5"], "argument --serve-port: -5 is negative"),
        (["--background", "2", "--base-url", "http://127.0.0.1:9/v1"], "with --base-url the server is elsewhere"),
    ],
)
def test_bad_load_flags_are_one_line_errors(flags, says, capsys, tmp_path):
    assert _exit_code(["--plain", "--model", str(tmp_path), *flags, "hi"]) == 2  # before any model is looked at
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("reqscope: error: ") and says in err[0], err


def test_a_port_in_use_is_one_line_before_the_model_loads(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--plain", "--model", str(tmp_path / "missing"), "--serve-port", str(port), "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot serve on 127.0.0.1:{port}" in err[0] and "pick another --serve-port" in err[0]


def test_plain_and_json_say_what_shares_the_engine(chatty_tiny_dir, capsys):
    argv = ["--model", str(chatty_tiny_dir), "--temperature", "0", "--max-tokens", "16", "--background", "2"]
    assert cli.main(["--plain", *argv, "--serve-port", "0", "hi"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"· load      2 background requests and the OpenAI API at http://127\.0\.0\.1:\d+/v1 share "
                     r"this engine", err), err  # fmt: skip
    assert cli.main(["--json", *argv, "hi"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["event"] == "request" and records[1] == {"event": "load", "background": 2, "serve_url": None}
    assert records[-1]["event"] == "done"
    assert not _background_threads()  # they ended with the request


def test_background_requests_loop_until_stopped_with_prompts_of_a_few_lengths(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=64 << 20)
    like = cli_request()
    load = BackgroundLoad(engine, 2, like)
    prompts = {load.request(slot, n).messages[-1].content for slot in range(2) for n in range(4)}
    assert len({len(p) for p in prompts}) >= 3  # short, medium and long
    assert all(load.request(0, n).kv_layout == like.kv_layout for n in range(4))
    load.start()
    deadline = threading.Event()
    while load.finished < 4 and not deadline.wait(0.05):  # more requests than slots: each slot sent again
        pass
    load.stop()
    assert load.finished >= 4 and load.failed == 0, load.last_error
    assert not _background_threads()
    load.start()  # once stopped, it starts again
    assert len(_background_threads()) == 2
    load.stop()
    assert not _background_threads()


def cli_request():
    from minengine.engine.request import GenerationRequest
    from minengine.sampling.params import SamplingParams

    return GenerationRequest.from_prompt(DEFAULT_PROMPT, sampling=SamplingParams(temperature=0.0), max_tokens=64,
                                         kv_layout="mha")  # fmt: skip


def test_a_client_of_the_served_api_runs_beside_a_headless_request(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=64 << 20)
    request = cli_request()
    with EngineLoad(engine, LoadOptions(background=1, serve_port=0), request) as load:
        url = load.note.serve_url
        assert url is not None
        body = json.dumps({"model": engine.model_dir.name, "max_tokens": 3, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hello"}]}).encode()  # fmt: skip
        answers: list[dict] = []

        def client() -> None:
            post = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(post, timeout=120) as response:
                answers.append(json.load(response))

        load.begin()
        thread = threading.Thread(target=client)
        thread.start()
        done = [e for e in engine.start(request) if isinstance(e, DoneEvent)]
        thread.join(timeout=120)
        load.end(wait=True)
        assert done[0].result.finish_reason in ("stop", "length") and not done[0].result.error
        assert answers and answers[0]["usage"]["completion_tokens"] == 3
    assert load.server is None and not _background_threads()
