"""The sampling defaults a model folder ships in `generation_config.json`.

vLLM and transformers take a request's unset sampling parameters from the model's
generation_config.json (vLLM: `--generation-config auto`, its default), so a model tuned for
T 0.6 / top-p 0.9 runs that way unless asked otherwise. reqscope does the same for the values
its sampler implements: temperature, top_k, top_p, min_p, and max_new_tokens as the default
output budget. Fields that would change the output and that this sampler does not apply
(repetition, presence and frequency penalties, n-gram bans, beams) are refused by name instead
of silently dropped: the run would not be the model's intended one. As in vLLM, `do_sample` is
not read: the temperature decides between greedy and sampling.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from minengine.errors import ConfigError, Setting

FILE = "generation_config.json"
# field -> the value at which it does nothing (so a config that spells it out is fine)
_NOT_APPLIED = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "num_beams": 1,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}


@dataclass(frozen=True)
class ModelSamplingDefaults:
    """What the folder's generation_config.json sets; None where it sets nothing."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    max_new_tokens: int | None = None
    path: Path | None = None  # the file read, or None when the folder has none

    @classmethod
    def read(cls, folder: Path) -> ModelSamplingDefaults:
        """Read `folder/generation_config.json` (no file: no defaults); one-line errors for bad values."""
        path = folder / FILE
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path} cannot be read as JSON ({exc}); fix or remove it") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} is not a JSON object; fix or remove it")
        for name, neutral in _NOT_APPLIED.items():
            value = raw.get(name)
            if value is not None and value != neutral:
                raise ConfigError(
                    f"{path} sets {name} {value!r}, which reqscope's sampler does not apply; run with ",
                    Setting.MODEL_SAMPLING_DEFAULTS_OFF,
                    " to use reqscope's defaults instead",
                )
        return cls(
            temperature=_number(raw, "temperature", path, low=0.0),
            top_k=_whole(raw, "top_k", path, low=0),
            top_p=_number(raw, "top_p", path, low=0.0, high=1.0),
            min_p=_number(raw, "min_p", path, low=0.0, high=1.0),
            max_new_tokens=_whole(raw, "max_new_tokens", path, low=1),
            path=path,
        )


def _number(raw: dict, name: str, path: Path, low: float, high: float | None = None) -> float | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{path}: {name} must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low:g}" if high is None else f"between {low:g} and {high:g}"
        raise ConfigError(f"{path}: {name} must be {bounds}, got {value!r}")
    return float(value)


def _whole(raw: dict, name: str, path: Path, low: int) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{path}: {name} must be a whole number >= {low}, got {value!r}")
    return value
