"""The llama.cpp peer of the fair comparison: llama-cpp-python in its own process.

    python -m reqscope.bench.fair.llama_child --gguf FILE --ids 1,2,3 --max-new-tokens 128 --threads 2 [--eos 2]

Run by the benchmark with the user's environment, it loads the GGUF the default model was
converted from, runs one short warm-up generation, resets the context (llama-cpp-python would
otherwise reuse the warm-up's prompt from its cache and skip the prefill), then generates
greedily (temperature 0, no repetition penalty) on the given prompt ids with the given thread
count, writing one line per token to stdout as each is sampled. The parent stamps the lines on
arrival (`pipes`), exactly as it does for the other sides.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Load, warm up, generate; events on stdout (see `pipes`)."""
    parser = argparse.ArgumentParser(prog="python -m reqscope.bench.fair.llama_child")
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--eos", default="", help="end-of-sequence ids, comma-separated (stop there)")
    args = parser.parse_args(argv)
    from minengine.settings import OMP_WAIT_POLICY_ENV, read_env  # stdlib only: sets no policy

    policy = read_env(OMP_WAIT_POLICY_ENV) or "not set"

    from reqscope.bench.fair.pipes import ChildEnvironment, emit  # stdlib only

    try:
        import llama_cpp
    except ImportError as exc:
        emit(sys.stdout, event="error", message=f"cannot import llama_cpp ({exc}); pip install -e '.[peers]'")
        return 1
    ids = [int(i) for i in args.ids.split(",") if i]
    eos = {int(i) for i in args.eos.split(",") if i}
    try:
        llm = llama_cpp.Llama(
            model_path=args.gguf,
            n_ctx=len(ids) + args.max_new_tokens + 16,
            n_batch=max(512, len(ids)),
            n_threads=args.threads,
            n_threads_batch=args.threads,
            seed=0,
            verbose=False,
        )
    except Exception as exc:  # llama-cpp-python raises ValueError/RuntimeError for unreadable files
        emit(sys.stdout, event="error", message=f"llama.cpp cannot load {args.gguf}: {exc}")
        return 1
    eos.add(llm.token_eos())
    ChildEnvironment(policy, args.threads, f"llama-cpp-python {llama_cpp.__version__}").write(sys.stdout)
    greedy = {"top_k": 1, "top_p": 1.0, "min_p": 0.0, "temp": 0.0, "repeat_penalty": 1.0}
    for n, _ in enumerate(llm.generate(ids, **greedy), start=1):
        if n >= 2:
            break
    llm.reset()
    asked = time.perf_counter()
    first_ms = None
    for n, token in enumerate(llm.generate(ids, **greedy), start=1):
        if first_ms is None:
            first_ms = (time.perf_counter() - asked) * 1000
        if token in eos:  # not shown, as reqscope shows none: the sides count the same tokens
            break
        emit(sys.stdout, event="token", token_id=int(token))
        if n >= args.max_new_tokens:
            break
    emit(sys.stdout, event="done", first_token_ms=first_ms, prompt_tokens=len(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
