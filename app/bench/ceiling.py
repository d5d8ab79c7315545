"""This machine's read ceiling: measured once by `reqscope calibrate`, kept in the reqscope home.

The roofline a run shows (`minengine.engine.roofline`) sets each decode step's bytes against the
read bandwidth of the machine. Measuring it at every start would cost a 512 MiB buffer (the
peak memory of a run would grow by it) and a second of probing before the first token, and on
a shared machine one second's bandwidth says little; so `reqscope calibrate` measures it, once
per machine and thread count, and every run reads it back from a small JSON file, naming where
it came from and when. A run on a machine (or a thread count) with none measured shows the
bytes and says how to measure one.

The same file keeps the compute ceilings prefill's roofline uses (`minengine.plan.compute_ceiling`),
one per machine and prefill path (model, weights' format, dtype): the whole `reqscope calibrate`
measures it with the model loaded. A file written before they were kept has none, and still
loads: its runs say the compute ceiling is not measured and what to run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from minengine.checkpoint.paths import models_home
from minengine.engine.roofline import ComputeCeiling, ReadCeiling
from minengine.kv.arithmetic import MIB
from minengine.settings import cpu_model
from reqscope.bench.other_load import OTHER_LOAD_MARK

if TYPE_CHECKING:
    import torch

CEILING_FILE = ".read-ceiling.json"  # in the reqscope home, beside the pulled models
CEILING_PASSES = 15  # of each probe; the fastest is kept
MEASURED_BY = "reqscope calibrate"
CALIBRATE_HINT = f"{MEASURED_BY} --ceiling-only"  # a few seconds; the whole calibration measures it too
COMPUTE_HINT = f"{MEASURED_BY} --ceilings-only"  # needs the model loaded; the whole calibration measures it too


@dataclass(frozen=True)
class CeilingLookup:
    """The ceiling stored for a machine, or why there is none."""

    ceiling: ReadCeiling | None
    machine: str
    note: str  # where it came from, or what to run


def ceiling_path() -> Path:
    """Where the measured ceilings are kept."""
    return models_home() / CEILING_FILE


def machine_name(device: torch.device) -> str:
    """What a ceiling is measured for: the device's name and, on a CPU, the threads that read."""
    import torch

    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    return f"cpu {cpu_model()}, {torch.get_num_threads()} threads"


def measure_ceiling(device: torch.device, passes: int = CEILING_PASSES) -> ReadCeiling:
    """The fastest pass of the two read probes on `device` (float32, past any cache).

    The fastest, not the median: a ceiling is what the machine can read, and on a shared machine
    the median is the load of those seconds, which a later, quieter run would then exceed.
    """
    from reqscope.bench.read_probe import ReadProbe

    probe = ReadProbe(device)
    try:
        matvec, total = [], []
        for _ in range(passes):  # alternated, so a slow moment of the machine lands on both
            matvec.append(probe.matvec_seconds())
            total.append(probe.sum_seconds())
        nbytes = probe.nbytes
    finally:
        probe.release()
    speeds = {"matvec": nbytes / min(matvec), "sum": nbytes / min(total)}
    name = max(speeds, key=speeds.__getitem__)
    others = ", ".join(f"{n} {s / 1e9:.1f} GB/s" for n, s in speeds.items() if n != name)
    return ReadCeiling(
        bytes_per_s=speeds[name],
        probe=f"{name} over {nbytes / MIB:.0f} MiB, fastest of {passes} passes; {others}",
        machine=machine_name(device),
        measured_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        source=MEASURED_BY,
    )


@dataclass(frozen=True)
class ComputeLookup:
    """The compute ceiling stored for a machine and prefill path, or why there is none."""

    ceiling: ComputeCeiling | None
    note: str  # where it came from, or what to run


def save_ceiling(ceiling: ReadCeiling, path: Path | None = None) -> Path:
    """Keep `ceiling` as its machine's, replacing an older one for the same machine."""
    path = path or ceiling_path()
    kept = [c for c in _read(path) if c.machine != ceiling.machine]
    return _write(path, [*kept, ceiling], _read_compute(path))


def save_compute_ceiling(ceiling: ComputeCeiling, path: Path | None = None) -> Path:
    """Keep `ceiling` as its machine's and path's, replacing an older one for the same pair."""
    path = path or ceiling_path()
    kept = [c for c in _read_compute(path) if (c.machine, c.path) != (ceiling.machine, ceiling.path)]
    return _write(path, _read(path), [*kept, ceiling])


def _write(path: Path, reads: list[ReadCeiling], computes: list[ComputeCeiling]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    data = {"version": 1, "ceilings": [asdict(c) for c in reads], "compute_ceilings": [asdict(c) for c in computes]}
    temporary.write_text(json.dumps(data, indent=2))
    temporary.replace(path)
    return path


def stored_compute_ceiling(device: torch.device, prefill_path: str, path: Path | None = None) -> ComputeLookup:
    """The compute ceiling kept for this machine and `prefill_path` (`compute_ceiling.prefill_path_name`); or
    none, and what to run."""
    machine = machine_name(device)
    for ceiling in _read_compute(path or ceiling_path()):
        if (ceiling.machine, ceiling.path) == (machine, prefill_path):
            return ComputeLookup(ceiling, _origin(ceiling))
    return ComputeLookup(None, f"compute ceiling not measured for {prefill_path}: run {COMPUTE_HINT}")


def stored_ceiling(device: torch.device, path: Path | None = None) -> CeilingLookup:
    """The ceiling kept for this machine, with a note of its origin; or none, and what to run."""
    machine = machine_name(device)
    for ceiling in _read(path or ceiling_path()):
        if ceiling.machine == machine:
            return CeilingLookup(ceiling, machine, _origin(ceiling))
    return CeilingLookup(None, machine, f"no read ceiling measured for {machine}: run {CALIBRATE_HINT}")


def _origin(ceiling: ReadCeiling | ComputeCeiling) -> str:
    """What measured `ceiling` and when, and that the machine was busy then if its probe says so."""
    busy = " (other processes busy then)" if OTHER_LOAD_MARK in ceiling.probe else ""
    return f"{ceiling.source}, {ceiling.measured_at}{busy}"


def _read(path: Path) -> list[ReadCeiling]:
    """The ceilings in `path`; none when it is missing or unreadable (it is measured again, never misread)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [ReadCeiling(**entry) for entry in data["ceilings"] if float(entry["bytes_per_s"]) > 0]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def _read_compute(path: Path) -> list[ComputeCeiling]:
    """The compute ceilings in `path`; none when it is missing, unreadable, or from before they were kept."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data.get("compute_ceilings", [])
        return [ComputeCeiling(**entry) for entry in entries if float(entry["flops_per_s"]) > 0]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []
