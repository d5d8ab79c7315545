"""The seeds' service-time model, fitted to measurements: prefill and decode as straight lines.

Seed 003 models a request's service time as `prefill_ms = 20 + 0.035 x tokens` and about 45 ms
per decode step for a 70B model on a GPU. Both are lines: a fixed cost (launches, allocation)
plus a cost per token, for prefill per prompt token and for decode per token of context the
step attends over. `reqscope calibrate` measures this engine on this device and fits the two
lines by least squares; this module holds the fit, its quality (R²), and its file format, so
`reqscope plan --service-model FILE` can predict with measured numbers instead of the seed's.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from minengine.errors import Mention, ReqscopeError, Setting

# The seed's numbers, shown beside a fit for comparison.
SEED_PREFILL_FIXED_MS = 20.0
SEED_PREFILL_PER_TOKEN_MS = 0.035
SEED_DECODE_STEP_MS = 45.0
MIN_POINTS = 3  # a line through two points always fits perfectly: R² would say nothing


class CalibrationError(ReqscopeError):
    """Measurements that cannot give a trustworthy fit, or a service-model file that is not one."""


@dataclass(frozen=True)
class Point:
    """One measurement: `kind` is "prefill" (x = prompt tokens) or "decode" (x = context tokens)."""

    kind: str
    tokens: int
    ms: float


@dataclass(frozen=True)
class LineFit:
    """`ms = fixed_ms + per_token_ms x tokens`, and how much of the variation it explains."""

    fixed_ms: float
    per_token_ms: float
    r2: float

    def at(self, tokens: float) -> float:
        """The fitted time for `tokens`."""
        return self.fixed_ms + self.per_token_ms * tokens


def fit_line(tokens: list[int] | tuple[int, ...], ms: list[float] | tuple[float, ...], what: str) -> LineFit:
    """Least-squares line through (tokens, ms) with both coefficients >= 0; `what` names the series in errors."""
    if len(tokens) != len(ms):
        raise CalibrationError(f"{what}: {len(tokens)} token counts but {len(ms)} times")
    if len(tokens) < MIN_POINTS or len(set(tokens)) < 2:
        raise CalibrationError(
            f"{what}: {len(tokens)} points at {len(set(tokens))} lengths; a fit needs at least "
            f"{MIN_POINTS} points at 2 or more lengths (add lengths or repeats)"
        )
    x, y = np.asarray(tokens, dtype=np.float64), np.asarray(ms, dtype=np.float64)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise CalibrationError(f"{what}: a measurement is not finite")
    design = np.stack([np.ones_like(x), x], axis=1)
    (fixed, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    # A cost cannot be negative, and noise can tip either coefficient below 0 (short prompts on
    # a busy CPU, decode barely growing with context): refit with that coefficient held at 0,
    # which is the least-squares answer under the constraint.
    if slope < 0:
        fixed, slope = float(y.mean()), 0.0
    elif fixed < 0:
        fixed, slope = 0.0, float((x * y).sum() / (x * x).sum())
    residual = float(((y - (fixed + slope * x)) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else 1.0
    if not all(math.isfinite(v) for v in (fixed, slope, r2)):
        raise CalibrationError(f"{what}: the fit is not finite")
    return LineFit(float(fixed), float(slope), r2)


@dataclass(frozen=True)
class ServiceModel:
    """Prefill and decode lines for one model on one device, with the points behind them."""

    model: str
    device: str
    dtype: str
    prefill: LineFit  # x = prompt tokens
    decode: LineFit  # x = tokens of context a decode step attends over
    points: tuple[Point, ...]

    @classmethod
    def fit(cls, model: str, device: str, dtype: str, points: list[Point]) -> ServiceModel:
        """Fit both lines to the median time at each length (every point is kept in `points`).

        Medians, because a busy machine only ever adds time, and in spikes: one slow repeat
        out of three moved a prefill fit's R² from 0.99 to 0.83 on the shared 2-core machine.
        """
        series = {}
        for kind in ("prefill", "decode"):
            by_length: dict[int, list[float]] = {}
            for p in points:
                if p.kind == kind:
                    by_length.setdefault(p.tokens, []).append(p.ms)
            lengths = sorted(by_length)
            medians = [statistics.median(by_length[n]) for n in lengths]
            series[kind] = fit_line(lengths, medians, kind)
        return cls(model, device, dtype, series["prefill"], series["decode"], tuple(points))

    def ttft_ms(self, prompt_tokens: int) -> float:
        """Predicted prefill time for a prompt (the model's share of TTFT)."""
        return self.prefill.at(prompt_tokens)

    def mean_itl_ms(self, prompt_tokens: int, output_tokens: int) -> float:
        """Predicted mean gap between output tokens: the decode line at the mean context.

        Step i (1-based, after the first token) attends over prompt + i tokens, so the mean
        over steps 1 .. output-1 is prompt + output / 2.
        """
        return self.decode.at(prompt_tokens + output_tokens / 2)

    def as_json(self) -> dict:
        """The documented JSON shape (`reqscope calibrate --json`)."""
        return {
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "prefill": {"fixed_ms": self.prefill.fixed_ms, "per_token_ms": self.prefill.per_token_ms,
                        "r2": self.prefill.r2},
            "decode": {"fixed_ms": self.decode.fixed_ms, "per_context_token_ms": self.decode.per_token_ms,
                       "r2": self.decode.r2},
            "points": [asdict(p) for p in self.points],
        }  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> ServiceModel:
        """Read a file written by `reqscope calibrate --output`; one-line errors for anything else."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            prefill, decode = raw["prefill"], raw["decode"]
            model = cls(
                model=str(raw["model"]),
                device=str(raw["device"]),
                dtype=str(raw["dtype"]),
                prefill=LineFit(float(prefill["fixed_ms"]), float(prefill["per_token_ms"]), float(prefill["r2"])),
                decode=LineFit(
                    float(decode["fixed_ms"]), float(decode["per_context_token_ms"]), float(decode["r2"])
                ),
                points=tuple(Point(str(p["kind"]), int(p["tokens"]), float(p["ms"])) for p in raw.get("points", ())),
            )
        except OSError as exc:
            raise CalibrationError(f"cannot read service model {path}: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise CalibrationError(
                f"{path} is not a service model (write one with `", Mention(Setting.CALIBRATION_SAVED, path.name), "`)"
            ) from None
        for line in (model.prefill, model.decode):
            if not all(math.isfinite(v) for v in (line.fixed_ms, line.per_token_ms, line.r2)):
                raise CalibrationError(f"{path} holds a fit that is not finite; calibrate again")
        return model
