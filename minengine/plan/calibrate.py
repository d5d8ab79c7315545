"""Measure this engine on this device, for the service-time model (`service_model`).

Prefill is timed at several prompt lengths and decode at several context lengths, each a few
times, through the same runner a request uses (`ModelRunner.forward`, the device synchronized
before every clock read). Prompts are random token ids from a fixed seed: prefill cost depends
on how many tokens there are, not which. One untimed prefill first pays the one-time costs
(allocator, thread pool, page faults on mapped weights) that would otherwise land on the first
point and bend the line.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minengine.device import synchronize
from minengine.engine.engine import Engine
from minengine.errors import Setting
from minengine.plan.service_model import CalibrationError, Point, ServiceModel
from minengine.progress import ProgressCallback, Stage

DEFAULT_PROMPT_LENGTHS = (16, 64, 128, 256, 512, 1024)
DEFAULT_CONTEXT_LENGTHS = (64, 256, 512, 1024)
DEFAULT_REPEATS = 3
DEFAULT_DECODE_STEPS = 8



@dataclass(frozen=True)
class CalibrationPlan:
    """What to measure: prompt lengths, context lengths, repetitions, decode steps per point."""

    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS
    context_lengths: tuple[int, ...] = DEFAULT_CONTEXT_LENGTHS
    repeats: int = DEFAULT_REPEATS
    decode_steps: int = DEFAULT_DECODE_STEPS

    def fitted_to(self, context_limit: int) -> CalibrationPlan:
        """The plan without lengths the model's context cannot hold; an error when too little is left."""
        room = context_limit - self.decode_steps - 1
        prompts = tuple(n for n in self.prompt_lengths if 1 <= n <= context_limit)
        contexts = tuple(n for n in self.context_lengths if 1 <= n <= room)
        for name, kept, setting in (
            ("prompt", prompts, Setting.CALIBRATION_PROMPT_LENGTHS),
            ("context", contexts, Setting.CALIBRATION_CONTEXT_LENGTHS),
        ):
            if len(set(kept)) < 2:
                raise CalibrationError(
                    f"only {len(set(kept))} {name} length(s) fit the model's context of {context_limit}; "
                    "give at least 2 (",
                    setting,
                    ")",
                )
        if self.repeats < 1 or self.decode_steps < 1:
            raise CalibrationError(
                Setting.CALIBRATION_REPEATS, " and ", Setting.CALIBRATION_DECODE_STEPS, " must be at least 1"
            )
        return CalibrationPlan(prompts, contexts, self.repeats, self.decode_steps)

    @property
    def total(self) -> int:
        """Measurements in all (for progress)."""
        return (len(self.prompt_lengths) + len(self.context_lengths)) * self.repeats


def calibrate(
    engine: Engine, plan: CalibrationPlan, progress: ProgressCallback | None = None, seed: int = 0
) -> ServiceModel:
    """Measure prefill and decode as `plan` says (one progress stage, "calibrate") and fit the service model."""
    plan = plan.fitted_to(engine.cfg.max_position_embeddings)
    generator = torch.Generator().manual_seed(seed)
    longest = max(*plan.prompt_lengths, *plan.context_lengths)
    ids = torch.randint(0, engine.cfg.vocab_size, (longest + plan.decode_steps,), generator=generator)
    ids = ids.to(engine.device)
    _prefill_ms(engine, ids[: min(64, longest)])  # warm-up, not measured
    points: list[Point] = []
    stage = Stage(progress, "calibrate", total=plan.total, unit="points", message="prefill and decode timings")

    def advance(label: str) -> None:
        stage.advance(len(points), label)

    for _ in range(plan.repeats):  # repeats outermost: a slow spell of the machine spreads over lengths
        for n in plan.prompt_lengths:
            points.append(Point("prefill", n, _prefill_ms(engine, ids[:n])))
            advance(f"prefill {n} tokens")
        for n in plan.context_lengths:
            steps = _decode_ms(engine, ids, n, plan.decode_steps)
            # The middle step's context stands for the point: step i attends over n + i tokens.
            points.append(Point("decode", n + (plan.decode_steps + 1) // 2, statistics.median(steps)))
            advance(f"decode at {n} tokens of context")
    stage.finish(f"{len(points)} points measured")
    dtype = str(engine.dtype).removeprefix("torch.")
    return ServiceModel.fit(engine.model_dir.name, engine.device.type, dtype, points)


def _prefill_ms(engine: Engine, ids: torch.Tensor) -> float:
    cache = engine.runner.new_cache(len(ids) + 1)
    try:
        synchronize(engine.device)
        start = time.perf_counter()
        engine.runner.forward(ids, 0, cache)
        synchronize(engine.device)
        return (time.perf_counter() - start) * 1000
    finally:
        cache.release()


def _decode_ms(engine: Engine, ids: torch.Tensor, context: int, steps: int) -> Sequence[float]:
    cache = engine.runner.new_cache(context + steps + 1)
    try:
        engine.runner.forward(ids[:context], 0, cache)
        times = []
        for pos in range(context, context + steps):
            synchronize(engine.device)
            start = time.perf_counter()
            engine.runner.forward(ids[pos : pos + 1], pos, cache)
            synchronize(engine.device)
            times.append((time.perf_counter() - start) * 1000)
        return times
    finally:
        cache.release()
