"""How the checkpoint's weights are laid out in memory, and the products that read them.

Each projection becomes one operand of shape [chunks, in, out/chunks], built once at load from
the checkpoint's [out, in] matrices, and is applied with one `bmm`. The layout is chosen for
the one-token products of decode, which read the whole matrix for little arithmetic, so the
only question is how fast it streams (see `projection_operand`). Loading consumes the state
dict tensor by tensor and hands the memory-mapped pages back as it goes (`CheckpointReader`).

A reader told a packed weight format (`linear_kernels`) packs each projection instead, into a
`PackedLinear` whose own product the layer is bound to (`product`); the float32 source of each is
dropped as it is packed, so the model holds one copy of its weights, in the chosen format. With
oneDNN's packed float32 a tied head stays a dense operand, whose columns the embedding lookups
read: a packed head cannot hand out rows, and float32 rows beside it would hold the table twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from minengine.checkpoint.mapped_pages import MappedFiles
from minengine.fast.linear_kernels import EmbeddingRows, PackedLinear
from minengine.fast.panel_kernels import PANEL_PACKS, PanelLinear

# A projection's operand: a dense [chunks, in, out/chunks] tensor, or a packed or panel kernel's weight.
Operand = torch.Tensor | PackedLinear | PanelLinear
HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")  # the vocabulary head, its own or the tied embedding
# The token embedding: a dense [vocab, hidden] table, rows in a packed format's storage, or None
# when a tied head's dense operand serves the lookups.
Embedding = torch.Tensor | EmbeddingRows | None


def chunk_count(out_features: int, device: torch.device) -> int:
    """Column chunks for a projection: one per CPU thread (dividing `out_features`), one on CUDA."""
    if device.type != "cpu":
        return 1
    chunks = max(1, torch.get_num_threads())
    while out_features % chunks:
        chunks -= 1
    return chunks


def projection_operand(*weights: torch.Tensor, chunks: int) -> torch.Tensor:
    """Hugging Face [out, in] weights, stacked along `out`, as a [chunks, in, out/chunks] operand.

    A one-token projection reads the whole matrix for very little arithmetic, so what matters
    is how fast the CPU BLAS streams it (measured: docs/performance.md, "float32's other
    kernels"):

    - much wider than tall (out >= 2 * in: gate/up, the vocabulary head), a matrix streams
      faster stored transposed, row by row (y += x_i * W[i]), than with one dot product per
      output row, so it is copied into that layout;
    - the others (q/k/v, o, down) do as well or better as dot products and keep the
      checkpoint's rows (the operand is a transposed view of a plain copy);
    - a single gemv uses one core, so the output columns are split into one chunk per thread
      and `torch.bmm` runs the chunks in parallel. Every output is still the same dot product
      in the same order, so chunking changes no value.
    """
    out_features, in_features = sum(w.shape[0] for w in weights), weights[0].shape[1]
    per_chunk = out_features // chunks
    if out_features >= 2 * in_features:
        operand = torch.empty(chunks, in_features, per_chunk, dtype=weights[0].dtype, device=weights[0].device)
        column = 0
        for w in weights:  # each weight's rows land in one or more chunks' columns
            row = 0
            while row < w.shape[0]:
                c, j = divmod(column, per_chunk)
                n = min(per_chunk - j, w.shape[0] - row)
                operand[c, :, j : j + n].copy_(w[row : row + n].t())
                row, column = row + n, column + n
        return operand
    rows = torch.cat(weights) if len(weights) > 1 else weights[0].clone()  # an owned copy either way
    return rows.view(chunks, per_chunk, in_features).transpose(1, 2)


class WeightSource(Protocol):
    """What the model asks of its weights while it is built (`CheckpointReader` or a cached layout)."""

    def __contains__(self, name: str) -> bool: ...
    def copy(self, name: str) -> torch.Tensor: ...
    def projection(self, *names: str, chunks: int | None = None) -> Operand: ...
    def embedding(self, name: str, *, tied: bool) -> Embedding: ...
    def optional(self, name: str) -> torch.Tensor | None: ...


class CheckpointReader:
    """A loaded state dict, consumed name by name into owned (aligned, unmapped) copies.

    The pages of the memory-mapped file that each copy was read from are given back at once,
    so loading never holds the weights twice. With a packed format (`packs`, "fp16", "int8",
    "bf16"), projections are packed and the embedding kept at the format's width; with a panel
    format (`PANEL_PACKS`: "q8_0", "q4_1", "float32-panels", "fp16-panels") they are laid out in
    panels (q4_1's head in q8_0's; under "q4_1-exact" a projection its blocks would round in
    fp16's), and a tied embedding is read from the head's panels.
    """

    def __init__(self, sd: dict[str, torch.Tensor], packs: str | None = None) -> None:
        self.sd = sd
        self.pages = MappedFiles()
        self.packs = packs
        self.dense: set[str] = set()  # names a packed format leaves as dense operands (a tied float32 head)

    def __contains__(self, name: str) -> bool:
        return name in self.sd

    def _consumed(self, names: tuple[str, ...], made: torch.Tensor) -> torch.Tensor:
        for name in names:
            self.pages.release(self.sd.pop(name))
        return made

    def copy(self, name: str) -> torch.Tensor:
        """An owned copy of one tensor."""
        return self._consumed((name,), self.sd[name].clone())

    def projection(self, *names: str, chunks: int | None = None) -> Operand:
        """The [chunks, in, out/chunks] operand built from these [out, in] weights (see `projection_operand`),
        or their packed weight (`chunks` kept as its output layout).

        `chunks` defaults to one per CPU thread (one on CUDA; one for a packed kernel, which
        runs its own threads)."""
        weights = [self.sd[n] for n in names]
        if self.packs in PANEL_PACKS:
            stacked = torch.cat(weights) if len(weights) > 1 else weights[0]
            fmt = PANEL_PACKS[self.packs]
            if fmt == "q4_1" and names[0] in HEAD_NAMES:
                fmt = "q8_0"  # as a Q4_1 GGUF keeps its vocabulary matrix: every logit reads it, 8 bits
            made = PanelLinear(fmt, stacked, chunks or 1)
            if self.packs == "q4_1-exact" and not made.holds(stacked):
                made = PanelLinear("fp16", stacked, chunks or 1)  # its blocks would round this one
            return self._consumed(names, made)
        if self.packs is not None and self.dense.isdisjoint(names):
            stacked = torch.cat(weights) if len(weights) > 1 else weights[0]
            return self._consumed(names, PackedLinear(self.packs, stacked, chunks or 1))
        if chunks is None:
            chunks = chunk_count(sum(w.shape[0] for w in weights), weights[0].device)
        return self._consumed(names, projection_operand(*weights, chunks=chunks))

    def embedding(self, name: str, *, tied: bool) -> Embedding:
        """The token embedding: None when `tied` and the head's dense operand serves lookups, else
        a table (dense, or at the packed format's width). A tied weight is left for the head."""
        if self.packs in PANEL_PACKS:  # the head's panels hand out its rows: one copy serves both
            return None if tied else self.copy(name)
        if self.packs is None or self.packs == "float32":
            if tied and self.packs is not None:
                self.dense.add(name)  # the head stays dense, so that its columns serve the lookups
            return None if tied else self.copy(name)
        rows = EmbeddingRows(self.packs, self.sd[name])
        return rows if tied else self._consumed((name,), rows)

    def optional(self, name: str) -> torch.Tensor | None:
        """`copy(name)`, or None when the checkpoint has no such tensor."""
        return self.copy(name) if name in self.sd else None


class DenseProduct:
    """x [T, in] times a dense [chunks, in, out/chunks] operand (+ bias [out]), one `bmm` over its chunks."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = None if bias is None else bias.view(weight.shape[0], 1, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The linear layer: [T, out]."""
        y, T = self.chunks(x), x.shape[0]
        # One row: the chunks already lie end to end. More rows: interleave them (one copy).
        return y.view(1, -1) if T == 1 else y.transpose(0, 1).reshape(T, -1)

    def chunks(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x times each chunk: [chunks, T, out/chunks] (into `out` when given, a decode step's scratch)."""
        rows = x.expand(self.weight.shape[0], -1, -1)
        if self.bias is None:
            return torch.bmm(rows, self.weight, out=out)
        return torch.baddbmm(self.bias, rows, self.weight, out=out)

    def gating(self) -> None:
        """A dense product never gates its own sums (`KernelProduct.gating`): the layer gates after it."""
        return None


class KernelProduct:
    """x [T, in] times a packed or panel kernel's weight (+ bias [out]), by the kernel's own product."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: PackedLinear | PanelLinear, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The linear layer: [T, out]."""
        y = self.weight.linear(x)
        return y if self.bias is None else y.add_(self.bias)

    def chunks(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`DenseProduct.chunks`' layout, [chunks, T, out/chunks]: the kernel's columns cut into the chunks."""
        y, T, chunks = self(x), x.shape[0], self.weight.shape[0]
        y = y.view(chunks, 1, -1) if T == 1 else y.view(T, chunks, -1).transpose(0, 1)
        return y if out is None else out.copy_(y)

    def gating(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """silu(gate) * up of a gate/up weight in one call where its kernel gates its own sums with the C
        row operations' gating (`PanelLinear.gated`), else None."""
        if self.bias is None and isinstance(self.weight, PanelLinear) and self.weight.gates:
            return self.weight.gated
        return None


Product = DenseProduct | KernelProduct


def product(weight: Operand, bias: torch.Tensor | None = None) -> Product:
    """The linear layer of `weight` (+ `bias`), bound once when the model is built: a dense operand's
    `bmm`, or the packed or panel kernel's own product."""
    if isinstance(weight, torch.Tensor):
        return DenseProduct(weight, bias)
    return KernelProduct(weight, bias)


def token_lookup(embed: Embedding, head: Operand) -> Callable[[torch.Tensor], torch.Tensor]:
    """How token ids [T] become embedding rows [T, hidden] (a fresh tensor) for the layout the
    weights were built in, chosen once when the model is built: the table's rows (dense or a
    packed format's), else the tied head's (a panel head's rows, or a dense head's columns)."""
    if isinstance(embed, EmbeddingRows):
        return embed.lookup
    if embed is not None:
        return lambda ids: F.embedding(ids, embed)
    if isinstance(head, PanelLinear):
        return head.rows
    assert isinstance(head, torch.Tensor)
    per_chunk = head.shape[2]
    return lambda ids: head[ids // per_chunk, :, ids % per_chunk]  # column `id` of the head, [T, hidden]


def stored_bytes(weight: torch.Tensor | Operand | Embedding) -> int:
    """Bytes a weight is stored in (a packed kernel's padding included; 0 for a tied embedding)."""
    if weight is None:
        return 0
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else weight.stored_bytes


def read_bytes(weight: torch.Tensor | Operand | Embedding, rows: int | None = None) -> int:
    """Bytes a decode step reads of a weight: all of a projection or norm (a packed kernel's real
    rows, not its padding); of an embedding table, one row of `rows` values (0 for a tied one)."""
    if weight is None:
        return 0
    if isinstance(weight, EmbeddingRows):
        return weight.row_bytes
    if rows is not None:
        return rows * weight.element_size()
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else weight.read_bytes
