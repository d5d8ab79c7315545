"""The C kernels as other CPUs build them, tested on this one: CI draws its machine from several CPU kinds (AMX,
AVX-512 VNNI, AVX2 only), and each run would otherwise test only the build its own CPU makes.

- AMX's tiles where there are none: test_amx_rows.py and test_prompt_stack.py (whose chunks of 64 rows or
  more take the tiles) in a process whose kernels were built with the tile
  instructions emulated in C (`REQSCOPE_AMX=emulate`, amx_emulated.h). Everything of amx_rows.c but the
  instructions themselves (the rows split into bytes, the 64-row windows, the float chain, the gated product's
  scratch, the streamed stores) is held to the VNNI tiles' bits on any CPU with AVX-512 VNNI; the instructions
  are checked where a Xeon grants the tiles (scripts/gpu-check runs that module there).
- AVX-512 without VNNI (a Skylake's): the C kernels' tests in a process that sees the CPU without
  `avx512_vnni` (tests/conftest.py's REQSCOPE_TEST_CPU_WITHOUT), so the kernels are built without it and the
  rows stay float32.
- The AVX2 build (an AMD Zen 3's) on a CPU with AVX-512: the same tests where torch reports AVX2
  (`ATEN_CPU_CAPABILITY=avx2`), so that the kernels are built without AVX-512. Only the modules of reqscope's
  own kernels: oneDNN and FBGEMM probe the CPU themselves, so torch's own products stay AVX-512 there and the
  tests that expect them at torch's capability do not apply.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minengine import settings

ROOT = Path(__file__).resolve().parents[2]
KERNEL_MODULES = tuple(
    f"tests/engine/{name}.py"
    for name in ("test_panel_kernels", "test_chunk_attention", "test_decode_stack", "test_pooled_rows",
                 "test_attention_rows", "test_decode_step", "test_model_parity", "test_dot8", "test_prompt_stack")
)  # fmt: skip


def _pytest(modules: tuple[str, ...], **env: str) -> tuple[int, str, str]:
    """Run `modules` in a fresh process with `env` added; CI's skip policy left out (this CPU has what the
    skips it allows say it lacks): the caller checks the summary."""
    child = {k: v for k, v in os.environ.items() if k not in ("CI", "REQSCOPE_TEST_CPU_WITHOUT")} | env
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *modules],
        cwd=ROOT,
        env=child,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = done.stdout.strip().splitlines()
    return done.returncode, lines[-1] if lines else done.stderr[-500:], done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.skipif("avx512_vnni" not in settings.cpu_flags(), reason="rounded rows need AVX-512 VNNI")
def test_the_tiles_tests_pass_with_the_tile_instructions_emulated():
    modules = ("tests/engine/test_amx_rows.py", "tests/engine/test_prompt_stack.py")
    code, summary, tail = _pytest(modules, **{settings.AMX_ENV: settings.AMX_EMULATE})
    assert code == 0, tail
    assert "passed" in summary and "skipped" not in summary, summary  # every tiles test ran, none skipped


@pytest.mark.skipif("avx512_vnni" not in settings.cpu_flags(), reason="rounded rows need AVX-512 VNNI")
def test_the_kernels_tests_pass_on_the_avx512_build_without_vnni():
    code, summary, tail = _pytest(KERNEL_MODULES, REQSCOPE_TEST_CPU_WITHOUT="avx512_vnni,amx_tile,amx_int8")
    assert code == 0, tail
    assert "passed" in summary, summary


@pytest.mark.skipif("avx512f" not in settings.cpu_flags(), reason="no AVX-512 here")
def test_the_kernels_tests_pass_on_the_avx2_build():
    code, summary, tail = _pytest(KERNEL_MODULES, **{settings.CPU_CAPABILITY_ENV: "avx2"})
    assert code == 0, tail
    assert "passed" in summary, summary


def test_emulation_is_asked_for_by_name_only(monkeypatch):
    """Only `emulate` builds the emulation: the kernels' flags for an AVX-512 VNNI CPU, asked or not."""
    from minengine.fast.cpu_kernels import AMX_EMULATED_FLAGS, isa_flags

    vnni = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})
    for asked, emulated in (("emulate", True), ("on", False), ("off", False), ("", False)):
        monkeypatch.setenv(settings.AMX_ENV, asked)
        flags = isa_flags("AVX512", vnni)
        assert (set(AMX_EMULATED_FLAGS) <= set(flags)) == emulated, asked
        assert "-mamx-int8" not in flags
    monkeypatch.setenv(settings.AMX_ENV, "emulate")
    assert not set(AMX_EMULATED_FLAGS) & set(isa_flags("AVX2", vnni - {"avx512_vnni"}))  # no VNNI: no tiles at all
    amx = isa_flags("AVX512", vnni | {"amx_tile", "amx_int8"})
    assert set(AMX_EMULATED_FLAGS) <= set(amx) and "-mamx-int8" not in amx  # asked for, even beside real tiles
