"""Every setting the engine reads from the environment and every probe of the machine, in one place.

Only this module reads the environment (`os.environ`), in minengine and in the app alike
(`tests/test_env_reads.py` holds it), and only it reads the machine's files under /proc; the
modules that act on a setting ask here. `VARIABLES` lists every variable reqscope reads, the
app's own (the API keys, `COLUMNS`) too, so that `reqscope env` can list them all; `read_env`
refuses a name missing from it. Each setting comes back as one record,
`SettingValue`: its value, the value it has when nothing is said (`default`) and where the value
came from (`source`: the default, a variable of the environment, a flag of the app, or a probe of
the machine), so the command that lists them, a run's first JSON record and a trace's header can
say what a run ran under. Settings that only the modules acting on them can decide (whether the C
kernels built, what the block formats multiply by, the OpenMP policy this process chose) are
made there, as `SettingValue`s too; `minengine.record.settings_report.collect` gathers them all.

torch is imported inside the functions that need it, never at import: `omp_env` imports this
module to set the OpenMP wait policy, which must happen before torch loads OpenMP.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Where a value came from.
DEFAULT = "default"
ENVIRONMENT = "environment"  # `detail` names the variable
FLAG = "flag"  # given by the app's command line; `detail` names the flag (the engine names none)
PROBE = "probe"  # looked up on the machine; `detail` names what was probed

Value = str | int | float | bool | None

# The environment's variables the engine reads.
HOME_ENV = "REQSCOPE_HOME"
LAYOUT_CACHE_ENV = "REQSCOPE_LAYOUT_CACHE"
ACTIVATIONS_ENV = "REQSCOPE_ACTIVATIONS"
AMX_ENV = "REQSCOPE_AMX"
FLOAT32_KERNEL_ENV = "REQSCOPE_FLOAT32_KERNEL"
CC_ENV = "CC"
OMP_WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
GOMP_SPINCOUNT_ENV = "GOMP_SPINCOUNT"
# Read by torch and platformdirs themselves; named here so a setting can say they gave its value.
OMP_NUM_THREADS_ENV = "OMP_NUM_THREADS"
CPU_CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
CACHE_HOME_ENV = "XDG_CACHE_HOME"
# The app's own.
SERVE_API_KEY_ENV = "REQSCOPE_API_KEY"
CLIENT_API_KEY_ENV = "OPENAI_API_KEY"
COLUMNS_ENV = "COLUMNS"

FLOAT32_KERNELS = ("dense", "onednn", "panels")
OFF_WORDS = ("0", "false", "no", "off")
AMX_EMULATE = "emulate"  # REQSCOPE_AMX's word for amx_rows.c with its tile instructions in C (amx_emulated.h)
LAYOUT_CACHE_OFF = OFF_WORDS
LAYOUT_CACHE_EVERYWHERE = ("1", "true", "yes", "on", "all")
# The CPU flags the C kernels' build and paths depend on (`fast.cpu_kernels`), as /proc/cpuinfo names them.
KERNEL_CPU_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "amx_tile", "amx_int8",
)  # fmt: skip
MIB = 1 << 20


@dataclass(frozen=True)
class SettingValue:
    """One setting in force: its value, its value when nothing is said, and where the value came from."""

    name: str
    value: Value
    default: Value
    source: str  # DEFAULT, ENVIRONMENT, FLAG or PROBE
    detail: str = ""  # the variable or flag that gave it, what was probed, or why it is not what was asked

    def given(self, value: Value, by: str) -> SettingValue:
        """The setting as the app's flag `by` gave it (the app names its flags; the engine does not)."""
        return replace(self, value=value, source=FLAG, detail=by)

    def line(self) -> str:
        """`name value (source: detail) (default D)`, for one line of text (the default where it differs)."""
        return " ".join(filter(None, (self.name, _text(self.value), f"({self.where()})", _default(self))))

    def where(self) -> str:
        """`source: detail`, or the source alone."""
        return f"{self.source}: {self.detail}" if self.detail else self.source

    def record(self) -> dict[str, Value]:
        """The setting as plain JSON types, keyed by field (the name is the key it is filed under)."""
        return {"value": self.value, "default": self.default, "source": self.source, "detail": self.detail}


@dataclass(frozen=True)
class Settings:
    """Settings gathered at one moment, in a fixed order (`settings_report.collect`)."""

    values: tuple[SettingValue, ...]

    def __getitem__(self, name: str) -> SettingValue:
        for setting in self.values:
            if setting.name == name:
                return setting
        raise KeyError(name)

    def lines(self) -> list[str]:
        """One aligned line per setting: name, value, source and what gave it, default."""
        rows = [(s.name, _text(s.value), "  ".join(filter(None, (s.where(), _default(s))))) for s in self.values]
        name_w = max((len(r[0]) for r in rows), default=0)
        value_w = min(max((len(r[1]) for r in rows), default=0), 40)  # a long path does not push every line right
        return [f"{name:<{name_w}}  {value:<{value_w}}  {where}" for name, value, where in rows]

    def record(self) -> dict[str, dict[str, Value]]:
        """{name: {value, default, source, detail}}, plain JSON types."""
        return {s.name: s.record() for s in self.values}


def _text(value: Value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _default(setting: SettingValue) -> str:
    # Said only where it differs: a probed fact (the CPU, torch's version) has none, and a value that
    # is its default needs no second mention.
    if setting.default is None or setting.default == setting.value:
        return ""
    return f"(default {_text(setting.default)})"


@dataclass(frozen=True)
class EnvVariable:
    """One variable of the environment reqscope reads, and what it sets."""

    name: str
    sets: str
    secret: bool = False  # a key: `reqscope env` says whether it is set, never its value


VARIABLES: tuple[EnvVariable, ...] = (
    EnvVariable(HOME_ENV, "the folder pulled models are kept in"),
    EnvVariable(LAYOUT_CACHE_ENV, "which model folders keep a CPU weight layout: auto, 1/all or 0/off"),
    EnvVariable(ACTIVATIONS_ENV, "what the block formats multiply by: int16, int8 or float32"),
    EnvVariable(AMX_ENV, "0/off: no AMX tiles for the int16 products; emulate: the tiles in C (slow, for tests)"),
    EnvVariable(FLOAT32_KERNEL_ENV, f"float32's CPU kernel: {', '.join(FLOAT32_KERNELS)}"),
    EnvVariable(CC_ENV, "the C compiler the kernels are built with"),
    EnvVariable(OMP_WAIT_POLICY_ENV, "OpenMP's wait policy (unset: reqscope chooses one per verb)"),
    EnvVariable(GOMP_SPINCOUNT_ENV, "GNU OpenMP's spin count (set: reqscope leaves the wait policy alone)"),
    EnvVariable(OMP_NUM_THREADS_ENV, "torch's threads (read by torch)"),
    EnvVariable(CPU_CAPABILITY_ENV, "torch's CPU capability (read by torch)"),
    EnvVariable(CACHE_HOME_ENV, "the user cache, which holds the models and kernels folders (read by platformdirs)"),
    EnvVariable(SERVE_API_KEY_ENV, "a bearer token the OpenAI-compatible server requires, beside its own", secret=True),
    EnvVariable(CLIENT_API_KEY_ENV, "the bearer token the endpoint client and load generator send", secret=True),
    EnvVariable(COLUMNS_ENV, "the width progress lines are drawn to (unset: the terminal's)"),
)
_VARIABLE_NAMES = frozenset(v.name for v in VARIABLES)


def read_env(name: str) -> str | None:
    """The variable `name` as this process's environment has it (None: unset); `name` must be in VARIABLES."""
    if name not in _VARIABLE_NAMES:
        raise KeyError(f"{name} is not in minengine.settings.VARIABLES; add it there, so that the settings list it")
    return os.environ.get(name)


_env = read_env


def variables_now() -> tuple[tuple[EnvVariable, str | None], ...]:
    """Every variable of VARIABLES with its value now (None: unset), for `reqscope env` to list."""
    return tuple((v, os.environ.get(v.name)) for v in VARIABLES)


# -- the environment ---------------------------------------------------------------------------


def float32_kernel() -> SettingValue:
    """float32's CPU kernel: "panels" (reqscope's, the default), "dense" or "onednn" (`model.weight_format`)."""
    asked = (_env(FLOAT32_KERNEL_ENV) or "").strip().lower()
    if asked in FLOAT32_KERNELS:
        return SettingValue("float32_kernel", asked, "panels", ENVIRONMENT, FLOAT32_KERNEL_ENV)
    why = f"{FLOAT32_KERNEL_ENV}={asked!r} is none of {', '.join(FLOAT32_KERNELS)}" if asked else ""
    return SettingValue("float32_kernel", "panels", "panels", DEFAULT, why)


def amx_asked() -> str:
    """What the environment says of AMX's tiles for the int16 products (`REQSCOPE_AMX`; one of
    OFF_WORDS turns them off, AMX_EMULATE builds them in C), as written ("" when nothing);
    `fast.panel_kernels.amx_setting` says what runs."""
    return (_env(AMX_ENV) or "").strip().lower()


def activations_asked() -> str:
    """What the environment asks the block formats to multiply by, as written ("" when nothing);
    `fast.panel_kernels.activations` decides what they do."""
    return (_env(ACTIVATIONS_ENV) or "").strip().lower()


def layout_cache() -> SettingValue:
    """Which model folders keep a CPU weight layout (`checkpoint.layout_cache`): "auto" (pulled models
    only), one of LAYOUT_CACHE_EVERYWHERE (every folder) or of LAYOUT_CACHE_OFF (none)."""
    raw = _env(LAYOUT_CACHE_ENV)
    value = (raw if raw is not None else "auto").strip().lower()
    if value in LAYOUT_CACHE_OFF:
        meaning = "off"
    elif value in LAYOUT_CACHE_EVERYWHERE:
        meaning = "every model folder"
    else:
        meaning = "pulled models only"
    if raw is None:
        return SettingValue("layout_cache", value, "auto", DEFAULT, meaning)
    return SettingValue("layout_cache", value, "auto", ENVIRONMENT, f"{LAYOUT_CACHE_ENV}: {meaning}")


def _user_cache(folder: str, name: str) -> SettingValue:
    """`folder` under the user cache; platformdirs reads XDG_CACHE_HOME, so that is named when set."""
    import platformdirs  # about 10 ms: only a pull, a CPU load deciding on its layout cache, or a listing asks

    path = str(Path(platformdirs.user_cache_dir("reqscope")) / folder)
    if _env(CACHE_HOME_ENV):
        return SettingValue(name, path, None, ENVIRONMENT, f"{CACHE_HOME_ENV} (the user cache)")
    return SettingValue(name, path, path, DEFAULT, "the user cache")


def models_home() -> SettingValue:
    """The folder that holds pulled models: `$REQSCOPE_HOME` if set, else the user cache's `models`."""
    override = _env(HOME_ENV)
    if override:
        default = _user_cache("models", "home").default
        return SettingValue("home", str(Path(override).expanduser()), default, ENVIRONMENT, HOME_ENV)
    return _user_cache("models", "home")


def kernels_home() -> SettingValue:
    """Where the compiled C kernels are kept: the user cache's `kernels` folder."""
    return _user_cache("kernels", "kernels_home")


def c_compiler() -> SettingValue:
    """The C compiler the kernels are built with: `$CC`, else `cc` or `gcc` on the PATH (value None: none)."""
    given = _env(CC_ENV)
    if given:
        return SettingValue("c_compiler", given, None, ENVIRONMENT, CC_ENV)
    for name in ("cc", "gcc"):
        if found := shutil.which(name):
            return SettingValue("c_compiler", found, None, PROBE, f"PATH: {name}")
    return SettingValue("c_compiler", None, None, PROBE, "PATH: no cc or gcc")


def omp_policy_given() -> bool:
    """Whether the environment sets OpenMP's wait policy itself (OMP_WAIT_POLICY or GOMP_SPINCOUNT)."""
    return OMP_WAIT_POLICY_ENV in os.environ or GOMP_SPINCOUNT_ENV in os.environ


def export(name: str, value: str) -> None:
    """Set a variable of this process's environment (OpenMP's policy, before torch loads: `omp_env`)."""
    os.environ[name] = value


def environment() -> dict[str, str]:
    """A copy of this process's environment, for a child process or to read a variable torch read."""
    return dict(os.environ)


# -- the machine --------------------------------------------------------------------------------


@cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@cache
def cpu_model() -> str:
    """The CPU's name: /proc/cpuinfo's model name, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    """torch's CPU capability ("AVX2", "AVX512", "DEFAULT"...): its own probe, or ATEN_CPU_CAPABILITY."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def cpu_count() -> int | None:
    """The machine's logical CPUs (os.cpu_count(): None where unknown)."""
    return os.cpu_count()


def machine_busy_seconds() -> float | None:
    """CPU time all the machine's CPUs spent busy since boot, stolen time included (/proc/stat's first
    line; None where there is none)."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    ticks = [int(v) for v in fields[1:9]]
    # user nice system idle iowait irq softirq steal: idle and iowait are the only idle time.
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def available_memory_bytes() -> int:
    """Memory the OS could hand out now without swapping (MemAvailable on Linux)."""
    # /proc/meminfo is what psutil reads on Linux; reading it directly keeps psutil's import
    # (about 30 ms) off the start-up path.
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    return psutil.virtual_memory().available


def default_kv_budget(device: torch.device) -> int:
    """Half of the memory free now (on the device for CUDA, in RAM for the CPU)."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    return int(available_memory_bytes() * 0.5)


# -- the machine, as settings -------------------------------------------------------------------


def python() -> SettingValue:
    """The Python that runs reqscope."""
    version = f"{platform.python_implementation()} {platform.python_version()}"
    return SettingValue("python", version, None, PROBE, "platform.python_version()")


def torch_build() -> SettingValue:
    """torch's version (its build: +cpu, +cu124...)."""
    import torch

    return SettingValue("torch", torch.__version__, None, PROBE, "torch.__version__")


def cuda() -> SettingValue:
    """Whether torch sees a CUDA device (detail: its name), which `device auto` then takes."""
    import torch

    if not torch.cuda.is_available():
        return SettingValue("cuda", False, None, PROBE, "torch.cuda.is_available()")
    name = torch.cuda.get_device_name(0)
    return SettingValue("cuda", True, None, PROBE, f"torch.cuda.is_available(): {name}, CUDA {torch.version.cuda}")


def cpu() -> SettingValue:
    """The CPU's name and the flags the C kernels depend on."""
    flags = cpu_flags()
    have = " ".join(f for f in KERNEL_CPU_FLAGS if f in flags) or "none of the kernels' flags"
    lacks = " ".join(f for f in KERNEL_CPU_FLAGS if f not in flags)
    detail = f"/proc/cpuinfo: {have}" + (f"; lacks {lacks}" if lacks else "")
    return SettingValue("cpu", cpu_model(), None, PROBE, detail)


def cpu_capability_setting() -> SettingValue:
    """torch's CPU capability, which decides whether the C kernels build and with AVX-512 or not."""
    capability = cpu_capability()
    if _env(CPU_CAPABILITY_ENV):
        return SettingValue("cpu_capability", capability, None, ENVIRONMENT, CPU_CAPABILITY_ENV)
    return SettingValue("cpu_capability", capability, None, PROBE, "torch.backends.cpu.get_cpu_capability()")


def cpus() -> SettingValue:
    """The CPUs this process may run on, of the machine's."""
    total = cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return SettingValue("cpus", total, None, PROBE, "os.cpu_count()")
    return SettingValue("cpus", usable, None, PROBE, f"os.sched_getaffinity: {usable} of os.cpu_count() {total}")


def threads() -> SettingValue:
    """torch's intra-op threads: OMP_NUM_THREADS when set, else torch's default (one per physical core)."""
    import torch

    count = torch.get_num_threads()
    if _env(OMP_NUM_THREADS_ENV):
        return SettingValue("threads", count, None, ENVIRONMENT, OMP_NUM_THREADS_ENV)
    return SettingValue("threads", count, None, PROBE, "torch.get_num_threads(): one per physical core")


def kv_budget(device: torch.device, used_bytes: int | None = None) -> SettingValue:
    """The KV budget: `used_bytes` where an engine took it already, else half the memory free now."""
    budget = default_kv_budget(device) if used_bytes is None else used_bytes
    probe = "torch.cuda.mem_get_info() free" if device.type == "cuda" else "/proc/meminfo MemAvailable"
    when = "at load" if used_bytes is not None else "now"
    detail = f"half of {probe} {when}: {budget / MIB:.0f} MiB"
    return SettingValue("kv_budget_bytes", budget, "half the free memory", PROBE, detail)
