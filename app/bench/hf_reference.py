"""Hugging Face transformers as the benchmark's reference engine.

transformers is a dev dependency: it is imported here, lazily, and nowhere on the paths the
`reqscope` command runs. The reference is timed the way it is used: prefill is one forward
pass that keeps only the last position's logits (what `generate()` does), and decode is
`generate()` itself, greedy, with end-of-sequence disabled so it always produces the tokens
asked for. A logits processor stamps each step, so prefill stays out of the decode rate.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minengine.errors import ReqscopeError
from reqscope.bench.runs import DecodeRun
from reqscope.bench.timer import StepClock


def import_transformers():
    """The transformers module, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ReqscopeError(
            "the benchmark compares against Hugging Face transformers, which is not installed; "
            "install the dev extra: pip install -e '.[dev]'"
        ) from None
    return transformers


class TransformersReference:
    """A transformers causal LM loaded from the same folder, device and dtype as minengine."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, pad_token_id: int = 0) -> None:
        transformers = import_transformers()
        self.transformers = transformers
        self.device = device
        self.pad_token_id = pad_token_id
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        self.model = model.to(device).eval()

    @property
    def version(self) -> str:
        """The transformers version string."""
        return self.transformers.__version__

    def prefill_ms(self, ids: list[int]) -> float:
        """Time of one prefill forward over `ids` (fresh cache, last-position logits only)."""
        input_ids = torch.tensor([ids], device=self.device)
        clock = StepClock(self.device)
        with torch.inference_mode():
            clock.mark()
            self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True, logits_to_keep=1)
            clock.mark()
        return clock.total_ms()

    def decode(self, ids: list[int], new_tokens: int) -> DecodeRun:
        """Greedy `generate()` of exactly `new_tokens` tokens after the prompt `ids`."""
        t = self.transformers
        clock = StepClock(self.device)
        input_ids = torch.tensor([ids], device=self.device)
        config = t.GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=self.pad_token_id
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=t.LogitsProcessorList([_StepStamp(clock)]),
            )
        tokens = tuple(out[0, len(ids) :].tolist())
        if len(tokens) != new_tokens or clock.marks != new_tokens:
            raise ReqscopeError(f"transformers generated {len(tokens)} tokens, not the {new_tokens} asked for")
        # Mark k follows forward k (0 = prefill); decode steps are the gaps between marks.
        return DecodeRun(tokens, tuple(clock.durations_ms()))


class _StepStamp:
    """A logits processor that only marks the clock: generate() calls it once per forward."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.clock.mark()
        return scores
