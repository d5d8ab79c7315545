"""Which weight format a run stores its projections in, and why: asked for, or `auto`'s measured choice.

On the CPU, with float32 compute, a format is a packed kernel (`linear_kernels`) or float32's
own operands. float32 has three kernels, the same bytes and the same numbers up to summation
order: reqscope's panel kernel (`panel_kernels`, the default where the C compiler built it), the
dense operands (`weight_layout`: MKL's GEMV and GEMM) and oneDNN's packed float32 GEMM; the
environment variable `FLOAT32_KERNEL_ENV` ("panels", "dense", "onednn") picks one (a kernel this
machine lacks leaves the run dense, and its reason says why). The kernel is one per process, so the prefix cache,
which lives in the process, never mixes them; the reason, and with it the trace header, names
the packed one. `auto` takes `AUTO_CPU_ORDER`'s first format that this torch and CPU run: the
fastest whose greedy tokens on the benchmark prompts matched float32's and whose logits stayed
within `AUTO_MAX_KL` of them (docs/performance.md, "Weight formats", gives the measurement and its
command): q4_1 for a checkpoint of Q4_1 blocks (held exactly), else fp16 in the panel kernel, else
float32. Elsewhere the weights are stored in the compute dtype, so a format names that dtype (fp16
is float16, bf16 is bfloat16); one that differs from the dtype asked for, or int8, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minengine import settings
from minengine.checkpoint.weight_layout import HEAD_NAMES
from minengine.checkpoint.weights import checkpoint_files, expected_shapes
from minengine.config import ModelConfig
from minengine.dtype_names import WEIGHT_FORMATS
from minengine.errors import Mention, ReqscopeError, Setting
from minengine.fast.cpu_kernels import library
from minengine.fast.linear_kernels import available, int8_refusal
from minengine.fast.panel_kernels import (
    ACTIVATIONS_ENV,
    BLOCK_FORMATS,
    Q8_BLOCK,
    PanelLinear,
    activations,
    activations_refusal,
    block_refusal,
)

# `auto`'s order on the CPU: the fastest formats first, each keeping float32's greedy tokens and its
# logits within AUTO_MAX_KL. q4_1 where the checkpoint's weights are Q4_1's blocks already (its head
# Q8_0's), as in a model converted from a Q4_1 GGUF, the default model included (`q4_1_holds`): the
# panels then hold float32's very values, so times float32 rows the logits are float32 panels' bits,
# at 98 MiB read a step against fp16's 261; with AVX-512 VNNI the rows are rounded to int16
# (`panel_kernels.activations`), within 1e-7 nats of float32's logits. On any other checkpoint q4_1
# would round the weights, and auto never takes it. Then fp16 in reqscope's panel kernel: half the
# bytes, decoding faster than float32 with prefill as fast and a smaller RSS. FBGEMM's packed fp16
# (where no C compiler built the panel kernel) prefilled slower, so auto does not take it; int8 and
# q8_0 part from float32's greedy tokens. The measurements and their commands: docs/performance.md,
# "Weight formats" and "int16 activations".
AUTO_CPU_ORDER: tuple[str, ...] = ("q4_1", "fp16", "float32")
# float32's kernel: the panel kernel by default, since its products stream each weight once for up to
# 8 rows (the same bits whatever rows share them), so it decodes faster than the dense operands at
# one row and at eight, and a prompt of 256 tokens or more runs through MKL's GEMM as the dense
# operands do (`panel_kernels.UNPACK_ROWS`). oneDNN's packed kernel is faster only in shared steps of
# several rows, slower at one row and larger in RSS, so it is asked for by name. The figures:
# docs/performance.md, "reqscope's panel kernel" and "float32's other kernels".
FLOAT32_KERNEL_ENV = settings.FLOAT32_KERNEL_ENV
FLOAT32_KERNELS = settings.FLOAT32_KERNELS
AUTO_MAX_KL = 1e-3  # nats, mean over the steps of the benchmark prompt's greedy decode
DTYPE_FORMAT = {torch.float32: "float32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FORMAT_DTYPE = {fmt: dtype for dtype, fmt in DTYPE_FORMAT.items()}


class WeightFormatError(ReqscopeError):
    """A weight format this device, compute dtype, torch build or model cannot run."""

    exit_code = 2  # the flag's value is wrong for this machine, as for a usage error


@dataclass(frozen=True)
class WeightChoice:
    """The format the projections are stored in, and why it was chosen ("asked for", "auto: ...")."""

    format: str
    why: str
    packed: bool = False  # a packed CPU kernel holds the projections (else dense operands in the compute dtype)
    panels: bool = False  # reqscope's panel kernel holds them (`panel_kernels`), not one of torch's
    exact: bool = False  # q4_1 taken by auto for a checkpoint of Q4_1 blocks: fp16 where a projection's would round

    @property
    def packs(self) -> str | None:
        """What the checkpoint reader is told to pack into: None for dense operands."""
        if not self.packed:
            return None
        if self.exact:
            return f"{self.format}-exact"
        return f"{self.format}-panels" if self.panels and self.format in ("float32", "fp16") else self.format

    @property
    def label(self) -> str:
        """ "fp16 (auto: ...)", as headers print it."""
        return f"{self.format} ({self.why})"


_chosen = WeightChoice


def float32_kernel() -> str:
    """The float32 kernel the environment asks for: "panels" (the default), "dense" or "onednn"."""
    return settings.float32_kernel().value


def _float32(why: str) -> WeightChoice:
    """float32 on the CPU, in the kernel the environment asks for (dense when that one is missing, saying why)."""
    kernel = float32_kernel()
    if kernel == "dense":
        return _chosen("float32", why, False)
    if kernel == "panels":
        panels = library()
        if panels.lib is None:
            return _chosen("float32", f"{why}; dense, since {panels.why_not}", False)
        return _chosen("float32", f"{why}, through reqscope's panel kernel", True, True)
    probe = available("float32")
    if not probe.ok:
        return _chosen("float32", f"{why}; dense, since {probe.why_not}", False)
    return _chosen("float32", f"{why}, through oneDNN's packed float32 kernel", True)


def _fp16(why: str) -> WeightChoice:
    """fp16 on the CPU: reqscope's panel kernel, or FBGEMM's packed fp16 where the kernel was not
    built (saying why); a WeightFormatError when neither runs."""
    panels = library()
    if panels.lib is not None:
        return _chosen("fp16", f"{why}, through reqscope's panel kernel", True, True)
    probe = available("fp16")
    if not probe.ok:
        raise WeightFormatError(
            f"fp16 weights cannot run: {panels.why_not}, and {probe.why_not}; use ",
            Mention(Setting.WEIGHTS, "float32"),
            " or ",
            Mention(Setting.WEIGHTS, "auto"),
        )
    return _chosen("fp16", f"{why}; FBGEMM's packed fp16, since {panels.why_not}", True)


def _block_why(why: str) -> str:
    """`why` for a block format, naming rounded activations where they multiply (or why, asked for, they do not)."""
    used, refused = activations(), activations_refusal()
    if used == "float32":
        return f"{why}; float32 activations, since {refused}" if refused else why
    if used == "int8":
        why = f"{why}; int8 activations ({ACTIVATIONS_ENV}=int8: llama.cpp's arithmetic, not float32's logits)"
    else:
        why = f"{why}; int16 activations (float32's logits within 1e-7 nats; {ACTIVATIONS_ENV}=float32 for their bits)"
    return f"{why}; {refused}" if refused else why


def compute_dtype_for(name: str, device: torch.device) -> str:
    """The dtype name `auto` compute means once the weight format `name` is known: a CUDA format's own dtype."""
    if device.type != "cpu" and name in ("fp16", "bf16", "float32"):
        return str(FORMAT_DTYPE[name]).removeprefix("torch.")
    return "auto"


def q4_1_holds(model_dir: Path) -> bool:
    """Whether the checkpoint in `model_dir` is Q4_1's blocks: its first layer's projections held exactly by
    q4_1, and its head's first rows by q8_0 (a Q4_1 GGUF's own). A probe of a few MiB; the load then checks
    every projection (`CheckpointReader.projection`, "q4_1-exact")."""
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    try:
        found: dict[str, torch.Tensor] = {}
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name in names:
                        found[name] = handle.get_tensor(name)
                    elif name in HEAD_NAMES and "head" not in found:
                        found["head"] = handle.get_slice(name)[:256]
    except (OSError, ValueError, ReqscopeError, SafetensorError):
        return False
    if len(found) != len(names) + 1 or any(t.dim() != 2 or t.shape[1] % Q8_BLOCK for t in found.values()):
        return False
    return all(PanelLinear("q8_0" if name == "head" else "q4_1", t.float(), 1).holds(t) for name, t in found.items())


def resolve_weights(name: str, device: torch.device, dtype: torch.dtype, model_dir: Path | None = None) -> WeightChoice:
    """The format for `name` ("auto" or one of `WEIGHT_FORMATS`) on `device` with compute `dtype`; `auto` looks
    at the checkpoint in `model_dir`, where given, for weights q4_1 holds exactly."""
    own = DTYPE_FORMAT.get(dtype, "float32")
    if name != "auto" and name not in WEIGHT_FORMATS:
        raise WeightFormatError(
            f"unknown weight format {name!r}; choose ",
            Mention(Setting.WEIGHTS, "auto"),
            f" or one of {', '.join(WEIGHT_FORMATS)}",
        )
    packs = device.type == "cpu" and dtype == torch.float32
    if name == "auto":
        if not packs:
            return _chosen(own, f"auto: the {device.type} {_dtype(dtype)} compute's own", False)
        skipped = []
        for fmt in AUTO_CPU_ORDER:
            if fmt == "float32":
                note = f" ({'; '.join(skipped)})" if skipped else ""
                return _float32(f"auto: no packed format pays here{note}")
            why = "auto: the fastest measured that keeps float32's greedy tokens"
            if fmt == "q4_1":
                if library().lib is None:
                    skipped.append(f"q4_1: {library().why_not}")
                elif model_dir is not None and q4_1_holds(model_dir):
                    why = "auto: the checkpoint's weights are Q4_1 blocks, held exactly"
                    why += " (float32's logits)" if activations() == "float32" else ""
                    why = _block_why(f"{why}, through reqscope's panel kernel")
                    return _chosen("q4_1", why, True, True, exact=True)
                continue
            if fmt in ("fp16", "q8_0"):  # measured in the panel kernel only
                if library().lib is not None:
                    return _chosen(fmt, f"{why}, through reqscope's panel kernel", True, True)
                skipped.append(f"{fmt}: {library().why_not}")
                continue
            probe = available(fmt)
            if probe.ok:
                return _chosen(fmt, why, True)
            skipped.append(f"{fmt}: {probe.why_not}")
    if name == own:
        return _float32("asked for") if packs else _chosen(name, "asked for", False)
    if not packs:
        if device.type == "cpu":
            raise WeightFormatError(
                f"{name} weights need float32 compute on the CPU; this run computes in {_dtype(dtype)}: use ",
                Mention(Setting.DTYPE, "float32"),
                " or ",
                Mention(Setting.WEIGHTS, own),
            )
        if name in ("int8", *BLOCK_FORMATS):
            raise WeightFormatError(
                f"{name} weights have no {device.type} kernel here; use ",
                Mention(Setting.WEIGHTS, own),
                f" (the {_dtype(dtype)} compute's own) or run on the CPU",
            )
        raise WeightFormatError(
            f"on {device.type} the weights are stored in the compute dtype ({_dtype(dtype)}); for {name} weights use ",
            Mention(Setting.DTYPE, _dtype(FORMAT_DTYPE[name])),
            " or ",
            Mention(Setting.DTYPE, "auto"),
        )
    if name == "fp16":
        return _fp16("asked for")
    if name in BLOCK_FORMATS:
        panels = library()
        if panels.lib is None:
            raise WeightFormatError(
                f"q8_0 weights cannot run: {panels.why_not}; use ",
                Mention(Setting.WEIGHTS, "int8"),
                " or ",
                Mention(Setting.WEIGHTS, "auto"),
            )
        return _chosen(name, _block_why("asked for"), True, True)
    probe = available(name)
    if not probe.ok:
        raise WeightFormatError(
            f"{name} weights cannot run: {probe.why_not}; use ",
            Mention(Setting.WEIGHTS, "fp16" if name != "fp16" else "float32"),
            " or ",
            Mention(Setting.WEIGHTS, "auto"),
        )
    return _chosen(name, "asked for", True)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refuse_shapes(choice: WeightChoice, cfg: ModelConfig) -> None:
    """Raise before anything is loaded when the chosen kernel cannot hold one of `cfg`'s projections."""
    if not (choice.packed and choice.format in ("int8", *BLOCK_FORMATS)):
        return
    for name, shape in expected_shapes(cfg).items():
        if len(shape) != 2:
            continue
        why = int8_refusal(name, shape) if choice.format == "int8" else block_refusal(choice.format, name, shape)
        if why is not None:
            raise WeightFormatError(
                f"{choice.format} weights cannot hold this model: {why}; use ",
                Mention(Setting.WEIGHTS, "fp16"),
                " or ",
                Mention(Setting.WEIGHTS, "float32"),
            )
