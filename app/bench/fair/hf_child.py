"""The transformers side of the fair comparison: `generate()` in a plain Python process.

    python -m reqscope.bench.fair.hf_child --model DIR --ids 1,2,3 --max-new-tokens 128 [--eos 2]

Run by the benchmark in its own process with the user's environment as it was before reqscope
touched it (`omp_env.user_environment`), it loads the model with `AutoModelForCausalLM`, runs one
short warm-up `generate()` (a user's second call; it only helps the reference), then the timed
greedy `generate()` on the given prompt ids, with a streamer that writes one line per token to
stdout as generate() hands it over. The parent stamps those lines on arrival (`pipes`). Nothing
here times the decode itself; the child's own clock only gives the request-to-first-token time.

Before torch loads, this module imports from minengine only `settings`, which reads the
environment and sets nothing (no OpenMP policy), and it reports the policy it was started with.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Load, warm up, generate; events on stdout (see `pipes`)."""
    parser = argparse.ArgumentParser(prog="python -m reqscope.bench.fair.hf_child")
    parser.add_argument("--model", required=True)
    parser.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--eos", default="", help="end-of-sequence ids, comma-separated (stop there)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    from minengine.settings import OMP_WAIT_POLICY_ENV, read_env  # stdlib only: sets no policy

    policy = read_env(OMP_WAIT_POLICY_ENV) or "not set"  # before torch loads its OpenMP runtime

    from reqscope.bench.fair.pipes import ChildEnvironment, emit  # stdlib only: safe before torch

    try:
        import torch
        import transformers
        from transformers.generation.streamers import BaseStreamer
    except ImportError as exc:
        emit(sys.stdout, event="error", message=f"cannot import transformers ({exc}); pip install -e '.[dev]'")
        return 1
    libraries = f"torch {torch.__version__}, transformers {transformers.__version__}"
    ChildEnvironment(policy, torch.get_num_threads(), libraries).write(sys.stdout)

    eos = [int(i) for i in args.eos.split(",") if i]

    class LineStreamer(BaseStreamer):
        """Writes each new token id as a line; the first `put` is the prompt. An end-of-sequence
        token is not written: reqscope shows none, so the sides count the same tokens."""

        def __init__(self) -> None:
            self.prompt_seen = False
            self.first_at: float | None = None

        def put(self, value) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            if self.first_at is None:
                self.first_at = time.perf_counter()
            for token in value.reshape(-1).tolist():
                if int(token) not in eos:
                    emit(sys.stdout, event="token", token_id=int(token))

        def end(self) -> None:
            pass

    device = torch.device(args.device)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(device).eval()
    ids = [int(i) for i in args.ids.split(",") if i]
    input_ids = torch.tensor([ids], device=device)
    config = transformers.GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        warm = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate(input_ids, attention_mask=mask, generation_config=warm)
        streamer = LineStreamer()
        asked = time.perf_counter()
        model.generate(input_ids, attention_mask=mask, generation_config=config, streamer=streamer)
    first_ms = None if streamer.first_at is None else (streamer.first_at - asked) * 1000
    emit(sys.stdout, event="done", first_token_ms=first_ms, prompt_tokens=len(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
