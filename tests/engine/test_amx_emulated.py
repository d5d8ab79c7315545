"""AMX's tiles tested where there are none: test_amx_rows.py run again in a process whose kernels were built with
the tile instructions emulated in C (`REQSCOPE_AMX=emulate`, amx_emulated.h). Everything of amx_rows.c but the
instructions themselves (the rows split into bytes, the 64-row windows, the float chain, the gated product's
scratch, the streamed stores) is then held to the VNNI tiles' bits on any CPU with AVX-512 VNNI, in every
CI run; the instructions are checked where a Xeon grants the tiles (scripts/gpu-check runs the module there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minengine import settings

ROOT = Path(__file__).resolve().parents[2]
TILES_TESTS = "tests/engine/test_amx_rows.py"


@pytest.mark.skipif("avx512_vnni" not in settings.cpu_flags(), reason="rounded rows need AVX-512 VNNI")
def test_the_tiles_tests_pass_with_the_tile_instructions_emulated():
    env = {**os.environ, settings.AMX_ENV: settings.AMX_EMULATE}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", TILES_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, summary  # every tiles test ran, none skipped


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
