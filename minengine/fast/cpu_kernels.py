"""reqscope's C kernels for the CPU, compiled once per machine and loaded with ctypes.

Eight sources make one library: `panel_rows.c` (the projections over weight panels,
`panel_kernels`), `dot8_rows.c` (the block formats' products with rows rounded to int16 or int8, integer dot
products: `panel_kernels.activations`), `amx_rows.c` (those int16 products on AMX tiles from 16 rows, the
same bits: `panel_kernels.amx_setting`), `attention_rows.c` (decode attention read in place, `attention_rows`),
`row_ops.c` (RMSNorm, the rotary embedding and SiLU-gating over a step's rows, `ops.c_rms_norm` and its neighbours)
`decode_layers.c` (every block of a one-token step in one call, `eager_step.LayerStack`),
`chunk_attention.c` (a prompt chunk's attention, key-blocked, read in place: `chunk_attention`) and
`prompt_layers.c` (every block of one sequence's prompt chunk in one call, `prompt_stack.PromptStack`).
They are built with the system compiler into the user cache (`library`), about two seconds,
keyed by the sources, the compiler and its flags, and written atomically, so processes that
race build the same bytes. Where there is no x86-64 CPU with AVX2, no compiler, or the build
fails, `KernelLibrary.why_not` says why in one line and every caller keeps torch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from minengine import settings
from minengine.settings import SettingValue

_C_FILES = ("panel_rows.c", "dot8_rows.c", "amx_rows.c", "attention_rows.c", "row_ops.c", "decode_layers.c",
            "chunk_attention.c", "prompt_layers.c")
SOURCES = tuple(Path(__file__).with_name(name) for name in _C_FILES)
_H_FILES = ("amx_emulated.h", "amx_rows.h", "attention_rows.h", "block_layout.h", "chunk_attention.h", "exp_le0.h",
            "stack_layers.h")
HEADERS = tuple(Path(__file__).with_name(name) for name in _H_FILES)  # in the key
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# Where torch finds AVX-512 (F, BW, VL and DQ, its "AVX512" capability) the panel tiles take zmm
# (`panel_rows.c`, __AVX512F__): the same bits, half the FMAs of a shared step.
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# Where the CPU also has AVX-512 VNNI (Linux's "avx512_vnni" flag), int16 and int8 activations take its
# dot products (`dot8_rows.c`); elsewhere they run a plain C reference and are not offered.
VNNI_FLAGS = ("-mavx512vnni",)
# Where it also has AMX's tiles and their int8 products (Linux's "amx_tile" and "amx_int8"), the int16
# products of 16 rows or more run on them (`amx_rows.c`); a build the compiler refuses them in is
# made again without.
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")
# `REQSCOPE_AMX=emulate`, on any CPU with AVX-512 VNNI: amx_rows.c as it runs on AMX, its tile instructions
# in C (amx_emulated.h), so that the tests hold that path to the VNNI tiles' bits where no tiles are.
AMX_EMULATED_FLAGS = ("-DREQSCOPE_AMX_EMULATED",)
_BUILD_TIMEOUT_S = 120


class KernelLibrary:
    """The compiled kernels, or why there are none (`why_not`)."""

    def __init__(self, lib: ctypes.CDLL | None, why_not: str = "") -> None:
        self.lib, self.why_not = lib, why_not
        if lib is not None:
            c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
            lib.f32_panels.argtypes = [ptr, c_long, c_long, ptr, ptr, c_long, ptr, c_long, c_int]
            lib.f16_panels.argtypes = lib.f32_panels.argtypes
            # q8_0 and q4_1: x, M, K, the groups (scales inside), panels, y, ldy, threads
            lib.q8_0_panels.argtypes = [ptr, c_long, c_long, ptr, c_long, ptr, c_long, c_int]
            lib.q4_1_panels.argtypes = lib.q8_0_panels.argtypes
            lib.q4_1_unpack.argtypes = [ptr, c_long, c_long, ptr, c_int]  # Q, panels, K, out, threads
            for name in ("q4_1_dot8", "q8_0_dot8", "q4_1_dot16", "q8_0_dot16"):  # over the DOT8 copy
                getattr(lib, name).argtypes = lib.q8_0_panels.argtypes
                getattr(lib, f"{name}_reference").argtypes = lib.q8_0_panels.argtypes[:-1]
                gated = getattr(lib, f"{name}_gated")  # the product and its gating (1: panels not in pairs)
                gated.argtypes, gated.restype = lib.q8_0_panels.argtypes, c_int
            lib.q4_1_dot8_pack.argtypes = lib.q8_0_dot8_pack.argtypes = lib.q4_1_unpack.argtypes  # Q, panels, K, V
            lib.dot8_bytes.argtypes, lib.dot8_bytes.restype = [c_int, c_long, c_long], c_long
            lib.dot8_native.argtypes, lib.dot8_native.restype = [], c_int
            lib.amx_built.argtypes, lib.amx_built.restype = [], c_int
            lib.amx_emulated.argtypes, lib.amx_emulated.restype = [], c_int
            lib.amx_ready.argtypes, lib.amx_ready.restype = [], c_int
            lib.amx_on.argtypes, lib.amx_on.restype = [], c_int
            lib.amx_use.argtypes, lib.amx_use.restype = [c_int], None
            lib.attend_rows.argtypes = [ptr]  # an AttendArgs (attention_rows.AttendArgs)
            rows = [ptr, c_long, c_long, c_long, c_long, c_long]  # x, T, H, d, stride of T, stride of H
            # weight, eps, y, strides, threads
            lib.rms_norm_rows.argtypes = [*rows, ptr, ctypes.c_float, ptr, c_long, c_long, c_int]
            lib.rope_rows.argtypes = [*rows, ptr, ptr, ptr, c_long, c_long, c_int]  # cos, signed sin, y, ...
            lib.silu_mul_rows.argtypes = [ptr, ptr, ptr, c_long, c_long, c_long, c_long, c_long, c_int]
            lib.decode_layers.argtypes = [ptr]  # a StackArgs (eager_step.StackArgs)
            lib.prompt_layers.argtypes, lib.prompt_layers.restype = [ptr], c_int  # a PromptArgs (prompt_stack)
            lib.chunk_attention_rounded.argtypes, lib.chunk_attention_rounded.restype = [c_long], c_int
            for name in ("f32_panels", "f16_panels", "q8_0_panels", "q4_1_panels", "q4_1_unpack", "attend_rows",
                         "rms_norm_rows", "rope_rows", "silu_mul_rows", "decode_layers", "q4_1_dot8", "q8_0_dot8",
                         "q4_1_dot8_reference", "q8_0_dot8_reference", "q4_1_dot16", "q8_0_dot16", "q4_1_dot8_pack",
                         "q4_1_dot16_reference", "q8_0_dot16_reference", "q8_0_dot8_pack"):  # fmt: skip
                getattr(lib, name).restype = None


def kernels_home() -> Path:
    """Where the compiled kernels are kept: the user cache's `kernels` folder."""
    return Path(settings.kernels_home().value)


def _compiler() -> str | None:
    return settings.c_compiler().value


def isa_flags(capability: str, cpu_flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The build's flags for torch's CPU capability ("AVX2", "AVX512") and the CPU's own flags (/proc/cpuinfo's)."""
    if not capability.startswith("AVX512"):
        return FLAGS
    flags = settings.cpu_flags() if cpu_flags is None else cpu_flags
    if "avx512_vnni" not in flags:
        return FLAGS + AVX512_FLAGS
    if settings.amx_asked() == settings.AMX_EMULATE:
        return FLAGS + AVX512_FLAGS + VNNI_FLAGS + AMX_EMULATED_FLAGS
    amx = {"amx_tile", "amx_int8"} <= flags
    return FLAGS + AVX512_FLAGS + VNNI_FLAGS + (AMX_FLAGS if amx else ())


def _build(cc: str, home: Path, flags: tuple[str, ...]) -> Path:
    """Compile `SOURCES` into `home` (once per sources, compiler and flags), written atomically."""
    version = subprocess.run([cc, "-dumpversion"], capture_output=True, text=True, timeout=30).stdout
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(sources + "\0".join((cc, version, *flags)).encode()).hexdigest()[:16]
    path = home / f"reqscope_kernels-{key}.so"
    if path.exists():
        return path
    home.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=home)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S
        )
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise RuntimeError(f"{Path(cc).name} could not build reqscope's CPU kernels ({first[:160]})")
        os.replace(tmp, path)  # another process building the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@cache
def library() -> KernelLibrary:
    """The kernels for this machine, built on first use (cached per process and on disk)."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        here = f"{platform.machine()} {platform.system()}"
        return KernelLibrary(None, f"reqscope's CPU kernels are built for x86-64 Linux, not {here}")
    capability = settings.cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        why = f"reqscope's CPU kernels need AVX2, FMA and F16C; torch finds {capability} on this CPU"
        return KernelLibrary(None, why)
    cc = _compiler()
    if cc is None:
        why = "reqscope's CPU kernels are compiled here and no C compiler (cc) was found; install gcc"
        return KernelLibrary(None, why)
    flags = isa_flags(capability)
    try:
        try:
            path = _build(cc, kernels_home(), flags)
        except RuntimeError:
            if not set(AMX_FLAGS) <= set(flags):
                raise
            path = _build(cc, kernels_home(), tuple(f for f in flags if f not in AMX_FLAGS))  # an older compiler
        kernels = KernelLibrary(ctypes.CDLL(str(path)))
        kernels.lib.amx_use(int(settings.amx_asked() not in settings.OFF_WORDS))
        return kernels
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return KernelLibrary(None, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)


def kernels_setting(*, load: bool = True) -> SettingValue:
    """Whether the kernels built here, as a setting: the library's file, or why there is none. With
    `load` False, a process that has not asked for them yet is told so instead of building them."""
    if not load and library.cache_info().currsize == 0:
        return SettingValue("c_kernels", None, True, settings.PROBE, "not loaded by this process")
    found = library()
    if found.lib is None:
        return SettingValue("c_kernels", False, True, settings.PROBE, found.why_not)
    return SettingValue("c_kernels", True, True, settings.PROBE, f"built: {found.lib._name}")
