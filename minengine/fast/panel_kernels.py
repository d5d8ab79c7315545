"""reqscope's own CPU kernel for the projections: weights in panels that stream once for every row.

A decode step is memory-bound: each projection's weight is read once for one row (alone) or
a few (a shared step). MKL's GEMV streams one row well, but its GEMM of 2..8 rows costs 2-3x
that (it packs the weight on every call), and oneDNN's prepacked GEMM is flat in rows but slow
at one. `panel_rows.c` stores a weight as panels of 8 output columns over the whole input,
contiguous, and computes every row of a step against each panel while it is in cache, so a
step of 8 rows reads the weights once; each output is one FMA chain in input order, so a row's
product is the same bits whatever rows share its step.

Three storages (`PanelLinear.format`):
- `float32`: the checkpoint's values, the same bytes as the dense operands;
- `fp16`: the values rounded to IEEE half precision, half the bytes, converted back exactly in
  registers (F16C): float32 arithmetic on the rounded weights;
- `q8_0`: llama.cpp's Q8_0 blocks (int8 weights, one scale per 32 inputs of a column, float32
  here), a quarter of the bytes, dequantized in registers: activations stay float32;
- `q4_1`: llama.cpp's Q4_1 blocks (4-bit weights, an fp16 scale and minimum per 32 inputs of a
  column), 0.625 bytes a weight, dequantized in registers to exactly gguf's float32 values: a
  checkpoint converted from a Q4_1 GGUF is held losslessly and multiplied as float32 panels
  multiply it, bit for bit.

q8_0 and q4_1 store one byte stream each (`panels`, no `scales`): groups of `GROUP` panels, block
by block, each block the group's scales (and minimums) then its weights (panel_rows.c's Q4_1 and
Q8_0 LAYOUT), so a tile reads one stream where it read eight.

Prompt chunks run through it too (rows in passes of 8, a block of 64 rows in L2 while the panels
pass): a 64-token chunk, the CPU's default step budget beside decoding sequences, takes what
MKL's GEMM over the dense operands takes. From 256 rows (a prompt taken whole while nothing
decodes) MKL's GEMM is faster, so the product lays the weight back out densely in a scratch
buffer and runs it (`UNPACK_ROWS`): rows of such a chunk are not the panel kernel's bits.

On a CPU with AVX-512 VNNI (`activations`), q8_0 and q4_1 hold a second layout of their blocks
(`dot8`) and multiply each row rounded to int16 (the default: float32's logits within 1e-7 nats) or,
asked for with `REQSCOPE_ACTIVATIONS=int8`, to int8 (llama.cpp's arithmetic) in integer dot products
(`dot8_rows.c`) at every row count. `REQSCOPE_ACTIVATIONS=float32` keeps float32 rows. The groups
stay for the lookups of a tied head and for inspection; on a warm load they are the layout file's
pages, handed back once copied (`layout_cache.CachedLayout.projection`), so the resident set holds
one copy of the weights.

The kernel is C, compiled once per machine with the system compiler (`cpu_kernels.library`).
Where there is none, the weight format falls back and its reason says why.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from minengine import settings
from minengine.fast.cpu_kernels import library
from minengine.settings import SettingValue

PANEL = 8  # output columns per panel (one AVX2 vector), as panel_rows.c's PW
Q8_BLOCK = 32  # inputs per q8_0 scale, as panel_rows.c's QB
# From this many rows a product lays the weight back out densely and runs MKL's GEMM: a prompt
# chunk is compute-bound, where MKL's GEMM outruns the panel tiles, and laying a layer's matrix
# out costs a few percent of the multiply (the measured crossover: docs/performance.md,
# "reqscope's panel kernel"). Only matrices up to 32 MiB (not a vocabulary head, whose prompts
# want one row of logits) take it, into one scratch per thread.
UNPACK_ROWS = 256
LAYOUT_PANELS = 512  # panels laid out and quantized at a time (`PanelLinear`): 9 MiB of float32 at 576 inputs
UNPACK_MAX_ELEMENTS = 8 << 20
_scratch = threading.local()
# A reader's `packs` for each panel storage (float32 is also a oneDNN kernel's `packs`, so it is named apart).
PANEL_PACKS = {"q8_0": "q8_0", "q4_1": "q4_1", "q4_1-exact": "q4_1", "float32-panels": "float32", "fp16-panels": "fp16"}
# "q4_1-exact" (auto's, for a checkpoint of Q4_1 blocks): q4_1 where its blocks hold a projection exactly, fp16 where
# they would round it (`CheckpointReader.projection`).
BLOCK_FORMATS = ("q8_0", "q4_1")  # the panel storages in blocks of Q8_BLOCK inputs
GROUP = 4  # q8_0 and q4_1 panels per group (one stream of blocks), as panel_rows.c's GP
# A panel's bytes per block of Q8_BLOCK inputs: q4_1's fp16 d and m and 16 x 8 nibble pairs, q8_0's float32
# scales and 32 x 8 int8 (panel_rows.c's Q4_1 and Q8_0 LAYOUT).
Q4_PANEL_BLOCK = 2 * PANEL * 2 + Q8_BLOCK // 2 * PANEL
Q8_PANEL_BLOCK = PANEL * 4 + Q8_BLOCK * PANEL
BLOCK_BYTES = {"q4_1": Q4_PANEL_BLOCK, "q8_0": Q8_PANEL_BLOCK}


# What the block formats' products multiply by (one choice per process, as the float32 kernel's):
# - "int16", where the CPU has AVX-512 VNNI and nothing else is asked for: each row rounded to 16 bits
#   per 32 inputs, the products summed in integers (dot8_rows.c). The logits stay within 1e-7 nats of
#   float32's, and the products run 1.6-3x faster than float32's FMAs (docs/performance.md, "int16
#   activations");
# - "int8" (asked for): rounded to int8 as llama.cpp does, faster again but 3e-3 nats off float32's
#   logits, so opt-in;
# - "float32" (asked for, or no VNNI): panel_rows.c multiplies gguf's float32 weights by the rows
#   themselves, float32 panels' bits.
ACTIVATIONS_ENV = settings.ACTIVATIONS_ENV
ACTIVATIONS = ("int16", "int8", "float32")


def _asked() -> str:
    return settings.activations_asked()


def activations() -> str:
    """What the block formats multiply by: "int16" or "int8" (rows rounded, integer dot products) where the
    CPU has VNNI's dot products, "float32" where it has not or the environment asks for it."""
    asked = _asked()
    asked = asked if asked in ACTIVATIONS else "int16"
    if asked == "float32":
        return "float32"
    lib = library().lib
    return asked if lib is not None and lib.dot8_native() else "float32"


def rows_rounding(fmt: str) -> str:
    """What a projection stored in `fmt` multiplies by: the activations (`activations`) for a block
    format, float32 rows for the others."""
    return activations() if fmt in BLOCK_FORMATS else "float32"


def activations_refusal() -> str | None:
    """Why the activations the environment asks for are not used here (None where they are, or nothing
    was asked for)."""
    asked = _asked()
    if not asked or activations() == asked:
        return None
    if asked not in ACTIVATIONS:
        return f"{ACTIVATIONS_ENV}={asked!r} is none of {', '.join(ACTIVATIONS)}"
    return _no_dot_products()


def _no_dot_products() -> str:
    """Why the kernels have no VNNI dot products here: no kernels, a CPU without them, or a build for a
    capability below AVX-512 (torch's, which ATEN_CPU_CAPABILITY can set) on a CPU that has them."""
    built_without = f"the kernels were built for torch's {settings.cpu_capability()} capability, without VNNI"
    lacking = built_without if "avx512_vnni" in settings.cpu_flags() else "this CPU has no AVX-512 VNNI dot products"
    return library().why_not or lacking


def activations_setting() -> SettingValue:
    """What the block formats multiply by, as a setting: asked for in the environment, the default
    (int16), or float32 where the CPU lacks VNNI's dot products (the probe), saying why."""
    asked, value, why = _asked(), activations(), activations_refusal()
    if asked and why is None:
        return SettingValue("activations", value, "int16", settings.ENVIRONMENT, ACTIVATIONS_ENV)
    if value == "int16":  # asked for nothing, or for something that is none of them (`why` says so)
        return SettingValue("activations", value, "int16", settings.DEFAULT, why or "")
    lacking = why or _no_dot_products()
    asked_for = f"{ACTIVATIONS_ENV}={asked} asked; " if asked in ACTIVATIONS else ""
    return SettingValue("activations", value, "int16", settings.PROBE, f"{asked_for}avx512_vnni probed: {lacking}")


AMX_ROWS = 16  # from this many rows the int16 products take AMX's tiles, as amx_rows.h's AMX_ROWS


def amx_takes(rows: int) -> bool:
    """Whether int16 products over `rows` rows run on AMX's tiles here (`amx_setting`)."""
    lib = library().lib
    return rows >= AMX_ROWS and lib is not None and bool(lib.amx_on()) and activations() == "int16"


def amx_tiles_name() -> str:
    """What a step's why calls the tiles: "AMX tiles", or "AMX tiles emulated in C" (`REQSCOPE_AMX=emulate`)."""
    lib = library().lib
    return "AMX tiles emulated in C" if lib is not None and lib.amx_emulated() else "AMX tiles"


def amx_setting() -> SettingValue:
    """Whether the int16 products of 16 rows or more run on AMX's tiles (`amx_rows.c`, the same bits as
    the VNNI tiles): on where the CPU has them and Linux grants them, unless `REQSCOPE_AMX` turns them off."""
    lib, asked = library().lib, settings.amx_asked()

    def off(source: str, why: str) -> SettingValue:
        return SettingValue("amx", "off", "on", source, why)

    if asked in settings.OFF_WORDS:
        return off(settings.ENVIRONMENT, f"{settings.AMX_ENV}={asked}")
    if lib is None or not lib.amx_built():
        return off(settings.PROBE, library().why_not or "built without tiles: no amx_tile and amx_int8, or cc refused")
    if not lib.amx_ready():
        return off(settings.PROBE, "Linux refused this process the tile state (arch_prctl)")
    if activations() != "int16":
        return off(settings.PROBE, f"tiles granted, but the activations are {activations()}")
    if lib.amx_emulated():
        why = f"{settings.AMX_ENV}={settings.AMX_EMULATE}: the tile instructions in C, many times slower (for tests)"
        return SettingValue("amx", "emulated", "on", settings.ENVIRONMENT, why)
    return SettingValue("amx", "on", "on", settings.PROBE, "amx_int8 probed, tiles granted: int16 from 16 rows")


def panel_bytes(fmt: str, in_features: int) -> int:
    """A block format's bytes a panel (its scales inside) over `in_features` inputs."""
    return in_features * BLOCK_BYTES[fmt] // Q8_BLOCK


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 as [panels, in, PANEL], the last panel padded with zero columns."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = torch.zeros(panels * PANEL, in_features, dtype=torch.float32)
    padded[:out_features] = weight
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


class PanelLinear:
    """One projection in panels of PANEL columns: `linear(x)` is x [T, in] @ W.T, [T, out], float32.

    Duck-types `linear_kernels.PackedLinear` (format, chunks, shape, stored/read bytes) so the
    layers apply it as any packed weight; unlike those it can hand back its weight's rows
    (`rows`), so a tied head also serves the embedding lookups and the model holds one copy.
    """

    __slots__ = (
        "format", "panels", "dot8", "rounding", "in_features", "out_features", "chunks", "stored_bytes", "read_bytes",
        "_lib",
    )  # fmt: skip

    def __init__(self, fmt: str, weight: torch.Tensor, chunks: int) -> None:
        """Lay out (and for q8_0 and q4_1 quantize) a float32 [out, in] weight; the caller drops it afterwards.

        `LAYOUT_PANELS` panels at a time, so that a vocabulary head's temporaries are a few MiB,
        not several copies of its 113 MiB (a first load's peak RSS, 759 against 387 MiB warm)."""
        out_features, in_features = weight.shape
        self.format, self.in_features, self.out_features, self.chunks = fmt, in_features, out_features, chunks
        lib = library().lib
        if lib is None:
            raise RuntimeError(f"no panel kernel: {library().why_not}")
        self._lib = lib
        if fmt not in ("float32", "fp16", *BLOCK_FORMATS):
            raise ValueError(f"no panel storage {fmt!r}")
        why = block_refusal(fmt, "the weight", (out_features, in_features)) if fmt in BLOCK_FORMATS else None
        if why is not None:
            raise ValueError(why)
        count, step = -(-out_features // PANEL), LAYOUT_PANELS * PANEL
        per_panel = panel_bytes(fmt, in_features) if fmt in BLOCK_FORMATS else 0
        for row in range(0, out_features, step):
            values = _store(fmt, _panels(weight[row : row + step].float()))
            if fmt in BLOCK_FORMATS:  # one stream of groups; LAYOUT_PANELS is a whole number of them
                if row == 0:
                    self.panels = values.new_empty(count * per_panel)
                first = row // PANEL * per_panel
                self.panels[first : first + values.numel()] = values
                continue
            if row == 0:  # the whole storage, filled part by part
                self.panels = values.new_empty((count, *values.shape[1:]))
            self.panels[row // PANEL : row // PANEL + values.shape[0]] = values
        self._dot8_copy()
        self._count_bytes()

    @classmethod
    def stored(cls, fmt: str, panels: torch.Tensor, out_features: int, chunks: int) -> PanelLinear:
        """A projection from panels laid out before (`tensors`; a layout cache maps them back)."""
        lib = library().lib
        if lib is None:
            raise RuntimeError(f"no panel kernel: {library().why_not}")
        self = cls.__new__(cls)
        if fmt in BLOCK_FORMATS:  # one stream of groups: BLOCK_BYTES a panel per Q8_BLOCK inputs
            inputs = panels.numel() * Q8_BLOCK // (BLOCK_BYTES[fmt] * -(-out_features // PANEL))
        else:
            inputs = panels.shape[1]
        self.format, self.in_features, self.out_features, self.chunks = fmt, inputs, out_features, chunks
        self.panels, self._lib = panels, lib
        self._dot8_copy()
        self._count_bytes()
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        """What `stored` builds it back from: the panels (a block format's scales are inside)."""
        return {"panels": self.panels}

    def _dot8_copy(self) -> None:
        """With rounded activations (`activations`: int16 or int8, `rounding`), the blocks laid out again
        for dot8_rows.c's integer dot products (its DOT8 LAYOUT); the groups stay for everything else
        (lookups, a long prompt's unpacking)."""
        self.dot8, self.rounding = None, None
        rounding = rows_rounding(self.format)
        if rounding == "float32":
            return
        self.rounding = rounding
        q8, panels, k = int(self.format == "q8_0"), self.panel_count, self.in_features
        self.dot8 = torch.empty(self._lib.dot8_bytes(q8, panels, k), dtype=torch.uint8)
        pack = self._lib.q8_0_dot8_pack if q8 else self._lib.q4_1_dot8_pack
        pack(self.panels.data_ptr(), panels, k, self.dot8.data_ptr(), torch.get_num_threads())

    def _count_bytes(self) -> None:
        self.stored_bytes = self.panels.numel() * self.panels.element_size()
        self.read_bytes = self.stored_bytes  # a step reads every panel whole (padding is under 8 columns)
        if self.dot8 is not None:  # the step reads the copy; both are held
            self.read_bytes = self.dot8.numel()
            self.stored_bytes += self.read_bytes

    @property
    def panel_count(self) -> int:
        """Panels of PANEL output columns (the last padded with zero columns)."""
        return -(-self.out_features // PANEL)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense operand's shape, [chunks, in, out/chunks]."""
        return (self.chunks, self.in_features, self.out_features // self.chunks)

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] (float32) times the weight: [T, out], float32 (into `out`, a contiguous
        [T, out] buffer, when given: a decode step's scratch)."""
        x = x.contiguous()
        rows, panels = x.shape[0], self.panel_count
        # Rounded activations keep their arithmetic at any row count: a prompt's rows then round alike whether
        # it is prefilled alone or beside others (and the dot products outrun MKL's float32 GEMM here).
        laid_out = self.dot8 is None and panels * PANEL * self.in_features <= UNPACK_MAX_ELEMENTS
        if rows >= UNPACK_ROWS and laid_out:
            y = F.linear(x, self._unpacked())  # a long prompt chunk: MKL's GEMM over the weight laid back out
            return y if out is None else out.copy_(y)
        width = panels * PANEL
        direct = out is not None and width == self.out_features and out.is_contiguous()
        y = out if direct else torch.empty(rows, width, dtype=torch.float32)
        lib, threads = self._lib, torch.get_num_threads()
        if self.dot8 is not None:
            kernel = getattr(lib, self._dot8_kernel)
            kernel(x.data_ptr(), rows, self.in_features, self.dot8.data_ptr(), panels, y.data_ptr(), width, threads)
        elif self.format in BLOCK_FORMATS:
            kernel = lib.q4_1_panels if self.format == "q4_1" else lib.q8_0_panels
            kernel(x.data_ptr(), rows, self.in_features, self.panels.data_ptr(), panels, y.data_ptr(), width, threads)
        else:
            packed = x if rows == 1 else torch.empty_like(x)  # the kernel's room to lay the rows out k-major
            kernel = lib.f32_panels if self.format == "float32" else lib.f16_panels
            kernel(
                x.data_ptr(), rows, self.in_features, packed.data_ptr(), self.panels.data_ptr(), panels, y.data_ptr(),
                width, threads,
            )  # fmt: skip
        if direct:
            return y
        y = y if width == self.out_features else y[:, : self.out_features].contiguous()
        return y if out is None else out.copy_(y)

    @property
    def _dot8_kernel(self) -> str:
        """The DOT8 copy's product in dot8_rows.c for this format and rounding, e.g. `q4_1_dot16`."""
        return f"{self.format}_{'dot16' if self.rounding == 'int16' else 'dot8'}"

    @property
    def gates(self) -> bool:
        """Whether `gated` takes this weight: the DOT8 copy, two chunks (an MLP's gate, then its up), each
        a whole number of the kernel's column groups."""
        return self.dot8 is not None and self.chunks == 2 and self.out_features % (2 * GROUP * PANEL) == 0

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for x [T, in] through a gate/up weight (`gates`), in one call: [T, out / 2],
        float32. The kernel gates each group of its sums as it makes them (`dot8_rows.c`'s `*_gated`), so
        the product's [T, out] is never written out; the same bits as `linear` then the C gating."""
        x = x.contiguous()
        rows, width = x.shape[0], self.out_features // 2
        y = torch.empty(rows, width, dtype=torch.float32)
        kernel = getattr(self._lib, f"{self._dot8_kernel}_gated")
        if kernel(x.data_ptr(), rows, self.in_features, self.dot8.data_ptr(), self.panel_count, y.data_ptr(), width,
                  torch.get_num_threads()):  # fmt: skip
            raise ValueError(f"the gated product takes a gate/up weight in whole column groups, not {self.shape}")
        return y

    def _unpacked(self) -> torch.Tensor:
        """The weight as a dense [out, in] float32 matrix (fp16's converted, q8_0's dequantized), in this thread's
        scratch: valid until its next unpacking."""
        panels, width = self.panel_count, self.in_features
        need = panels * PANEL * width
        scratch = getattr(_scratch, "buffer", None)
        if scratch is None or scratch.numel() < need:
            scratch = _scratch.buffer = torch.empty(need, dtype=torch.float32)
        view = scratch[:need].view(panels, PANEL, width)
        if self.format == "q4_1":  # in C: torch's unpacking took 10% of a long prompt's prefill
            self._lib.q4_1_unpack(self.panels.data_ptr(), panels, width, scratch.data_ptr(), torch.get_num_threads())
        elif self.format == "q8_0":
            view.copy_(self.dequantized().transpose(1, 2))
        else:
            view.copy_(self.panels.transpose(1, 2))
        return scratch[: self.out_features * width].view(self.out_features, width)

    def dequantized(self, panels: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The weights of `panels` (all by default) as float32 [n, in, PANEL], the values the kernel multiplies by."""
        if self.format == "q4_1":
            return _q4_1_values(*self._blocks(panels))
        if self.format == "q8_0":
            q, scales = self._blocks(panels)
            n = q.shape[0]
            return q.float().view(n, -1, Q8_BLOCK, PANEL).mul_(scales[:, :, None, :]).view(n, -1, PANEL)
        return self.panels[panels].float()

    def _blocks(self, panels: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The block storage of `panels` panel by panel, out of the groups that hold them (a range of panels:
        only its groups): q4_1's nibble pairs [n, in/2, PANEL] and fp16 scales with minimums [n, in/32, 2 * PANEL],
        q8_0's int8 [n, in, PANEL] and float32 scales [n, in/32, PANEL]."""
        count, k = self.panel_count, self.in_features
        if not isinstance(panels, slice):  # a few picked panels (a tied embedding's rows): each one's group only
            ids = panels.reshape(-1).tolist()
            picked = [self._blocks(slice(p, p + 1)) for p in ids] or [self._blocks(slice(0, 0))]
            values, scales = (torch.cat([part[i] for part in picked]) for i in (0, 1))
            return values.view(*panels.shape, *values.shape[1:]), scales.view(*panels.shape, *scales.shape[1:])
        start, stop, step = panels.indices(count)
        first = start // GROUP * GROUP
        end = min(-(-stop // GROUP) * GROUP, count) if stop > start else first
        per_panel = panel_bytes(self.format, k)
        ungrouped = _q4_1_ungrouped if self.format == "q4_1" else _q8_0_ungrouped
        values, scales = ungrouped(self.panels[first * per_panel : end * per_panel], end - first, k)
        picked = slice(start - first, stop - first, step)
        return values[picked], scales[picked]

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether the stored values are the float32 [out, in] `weight` exactly (no rounding)."""
        step = LAYOUT_PANELS * PANEL
        for row in range(0, self.out_features, step):
            stored = self.dequantized(slice(row // PANEL, (row + step) // PANEL))
            if not torch.equal(stored, _panels(weight[row : row + step].float())):
                return False
        return True

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows (output features) `ids` [T], float32 [T, in]: a tied embedding's lookup."""
        # One column of each picked panel, never the panel whole, gathered by numpy: torch's five
        # indexing and conversion operations took 0.2 ms of an 8-row step, numpy's 0.03.
        if self.format in ("float32", "fp16"):
            panel, column = np.divmod(ids.numpy(), PANEL)
            return torch.from_numpy(self.panels.numpy()[panel, :, column].astype(np.float32))  # [T, in]
        if self.format == "q8_0":
            picked = _q8_0_rows(self.panels.numpy(), self.panel_count, self.in_features, ids.numpy())
            if picked is not None:
                return torch.from_numpy(picked)
        panel, column = ids // PANEL, ids % PANEL
        return self.dequantized(panel)[torch.arange(len(ids)), :, column]


def block_refusal(fmt: str, name: str, shape: tuple[int, int]) -> str | None:
    """Why `fmt`'s blocks (q8_0, q4_1) cannot hold the [out, in] weight `name` (inputs not in blocks of 32), or None."""
    if shape[1] % Q8_BLOCK:
        return f"{name} has {shape[1]} input features, not a whole number of {fmt}'s {Q8_BLOCK}-input blocks"
    return None


def _store(fmt: str, panels: torch.Tensor) -> torch.Tensor:
    """Float32 panels [n, in, PANEL] in `fmt`'s storage (q8_0's and q4_1's: one stream of groups, scales inside)."""
    if fmt == "q4_1":
        return _q4_1_grouped(*_q4_1(panels))
    if fmt == "q8_0":
        blocks = panels.view(panels.shape[0], -1, Q8_BLOCK, PANEL)
        scales = (blocks.abs().amax(dim=2) / 127).clamp_(min=1e-30)  # [n, in/32, PANEL]
        return _q8_0_grouped(torch.round(blocks / scales[:, :, None]).to(torch.int8).view_as(panels), scales)
    return panels.half() if fmt == "fp16" else panels


def _q4_1(panels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 panels [n, in, PANEL] as Q4_1 blocks: nibble pairs [n, in/2, PANEL] (k even low, odd high) and
    fp16 [n, in/32, 2 * PANEL] (scales, then minimums), llama.cpp's quantizer: d = (max - min) / 15, m = min."""
    n, in_features, _ = panels.shape
    blocks = panels.view(n, in_features // Q8_BLOCK, Q8_BLOCK, PANEL)
    low, high = blocks.amin(dim=2), blocks.amax(dim=2)
    d, m = ((high - low) / 15).half(), low.half()
    step = torch.where(d > 0, d.float(), torch.ones_like(low))  # a constant block: q = 0 everywhere
    q = torch.round((blocks - m.float()[:, :, None]) / step[:, :, None]).clamp_(0, 15).to(torch.uint8)
    q = q.view(n, in_features // 2, 2, PANEL)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous(), torch.cat([d, m], dim=2).contiguous()


def _grouped(scales: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A block format's n panels, `scales` [S, n, blocks, PANEL] (S kinds of scale) and one-byte `weights`
    [n, blocks, R, PANEL], as panel_rows.c's one stream: groups of GROUP panels (the last may hold fewer), block
    after block, each block the group's scales kind by kind, panel after panel, then its R weight rows, each
    panel after panel."""
    n, blocks = weights.shape[:2]
    parts = []
    for first in range(0, n, GROUP):
        group = slice(first, first + GROUP)
        s = scales[:, group].permute(2, 0, 1, 3).contiguous().view(torch.uint8).reshape(blocks, -1)
        w = weights[group].permute(1, 2, 0, 3).contiguous().view(torch.uint8).reshape(blocks, -1)
        parts.append(torch.cat([s, w], dim=1).reshape(-1))
    return torch.cat(parts)


def _ungrouped(
    stream: torch.Tensor, n: int, blocks: int, scales: tuple[int, torch.dtype], weights: tuple[int, torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_grouped`'s stream of n panels back to its scales [S, n, blocks, PANEL] and weights [n, blocks, R, PANEL],
    given (S, the scales' dtype) and (R, the weights' one-byte dtype)."""
    (kinds, scale_dtype), (rows, weight_dtype) = scales, weights
    scale_bytes = kinds * PANEL * scale_dtype.itemsize
    at, out_scales, out_weights = 0, [], []
    for first in range(0, n, GROUP):
        gp = min(GROUP, n - first)
        group = stream[at : at + gp * blocks * (scale_bytes + rows * PANEL)].view(blocks, -1)
        at += group.numel()
        s = group[:, : gp * scale_bytes].contiguous().view(scale_dtype).view(blocks, kinds, gp, PANEL)
        w = group[:, gp * scale_bytes :].contiguous().view(weight_dtype).view(blocks, rows, gp, PANEL)
        out_scales.append(s.permute(1, 2, 0, 3))
        out_weights.append(w.permute(2, 0, 1, 3))
    if not out_weights:
        empty = torch.empty(kinds, 0, blocks, PANEL, dtype=scale_dtype)
        return empty, torch.empty(0, blocks, rows, PANEL, dtype=weight_dtype)
    return torch.cat(out_scales, dim=1).contiguous(), torch.cat(out_weights).contiguous()


def _q4_1_grouped(nibbles: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks of n panels (`_q4_1`'s) as one stream (`_grouped`): each block the group's scales, its
    minimums, then its 16 input pairs (panel_rows.c's Q4_1 LAYOUT)."""
    n, pairs, _ = nibbles.shape
    blocks = pairs * 2 // Q8_BLOCK
    scales = dm.view(n, blocks, 2, PANEL).permute(2, 0, 1, 3)  # [d | m, n, blocks, PANEL]
    return _grouped(scales, nibbles.view(n, blocks, Q8_BLOCK // 2, PANEL))


def _q4_1_ungrouped(stream: torch.Tensor, n: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_q4_1_grouped`'s stream of n panels back to nibble pairs [n, in/2, PANEL] and fp16 [n, in/32, 2 * PANEL]."""
    blocks = in_features // Q8_BLOCK
    scales, nibbles = _ungrouped(stream, n, blocks, (2, torch.float16), (Q8_BLOCK // 2, torch.uint8))
    return nibbles.view(n, in_features // 2, PANEL), torch.cat([scales[0], scales[1]], dim=2)


def _q8_0_grouped(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks of n panels, int8 [n, in, PANEL] and float32 scales [n, in/32, PANEL], as one stream
    (`_grouped`): each block the group's scales, then its 32 inputs (panel_rows.c's Q8_0 LAYOUT)."""
    n, in_features, _ = q.shape
    return _grouped(scales[None], q.view(n, in_features // Q8_BLOCK, Q8_BLOCK, PANEL))


def _q8_0_ungrouped(stream: torch.Tensor, n: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_q8_0_grouped`'s stream of n panels back to int8 [n, in, PANEL] and float32 scales [n, in/32, PANEL]."""
    scales, q = _ungrouped(stream, n, in_features // Q8_BLOCK, (1, torch.float32), (Q8_BLOCK, torch.int8))
    return q.view(n, in_features, PANEL), scales[0]


def _q8_0_rows(stream: np.ndarray, n: int, in_features: int, ids: np.ndarray) -> np.ndarray | None:
    """Rows `ids` (output features) of q8_0's stream of n panels as float32 [T, in], read in place by numpy; None
    where one lies in a last group of fewer than GROUP panels (`dequantized` serves those)."""
    panel, column = np.divmod(ids, PANEL)
    group, j = np.divmod(panel, GROUP)
    whole, blocks = n // GROUP, in_features // Q8_BLOCK
    if len(ids) == 0 or group.max() >= whole:
        return None
    groups = stream[: whole * GROUP * blocks * Q8_PANEL_BLOCK].reshape(whole, blocks, GROUP * Q8_PANEL_BLOCK)
    scales = groups[:, :, : GROUP * PANEL * 4].view(np.float32).reshape(whole, blocks, GROUP, PANEL)
    q = groups[:, :, GROUP * PANEL * 4 :].view(np.int8).reshape(whole, blocks, Q8_BLOCK, GROUP, PANEL)
    picked = q[group, :, :, j, column].astype(np.float32)  # [T, blocks, Q8_BLOCK]
    return (picked * scales[group, :, j, column][:, :, None]).reshape(len(ids), -1)  # float32, as torch's multiply


def _q4_1_values(nibbles: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks back to float32 [n, in, PANEL]: q * d + m, as the kernel and gguf compute them."""
    n, pairs, _ = nibbles.shape
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=2).view(n, pairs * 2 // Q8_BLOCK, Q8_BLOCK, PANEL).float()
    d, m = dm[:, :, None, :PANEL].float(), dm[:, :, None, PANEL:].float()
    return (q * d + m).view(n, pairs * 2, PANEL)
