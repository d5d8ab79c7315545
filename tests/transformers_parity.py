"""One check shared by the kernels' tests: a runner's prefill logits and greedy tokens against transformers'."""

from __future__ import annotations

import torch

from minengine.kv.cache import KVCache


def assert_matches_transformers(runner, hf, cfg, prompt_len: int, new_tokens: int) -> None:
    """Prefill logits within transformers' 1e-4, then greedy decode through the runner's lean
    one-token step, token for token against `hf.generate`."""
    ids = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))

    def cache() -> KVCache:
        return KVCache(cfg, prompt_len + new_tokens, device=torch.device("cpu"), compute_dtype=torch.float32)

    ours = runner.forward(ids, 0, cache(), all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()
    want = hf.generate(ids[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    kv = cache()
    logits, tokens = runner.forward(ids, 0, kv), []
    for pos in range(prompt_len, prompt_len + new_tokens):
        tokens.append(int(logits.argmax()))
        logits = runner.forward(torch.tensor([tokens[-1]]), pos, kv)  # the lean decode step
    assert tokens == want[0, prompt_len:].tolist()
