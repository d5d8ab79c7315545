"""The CPU weight layout, kept on disk beside the checkpoint so a warm start maps it instead of building it.

Building the projection operands (`weight_layout`) copies every weight, transposing the wide
ones: on the 2-core development machine about half a second of a 3-second start, most of it
the kernel handing out fresh pages. Once built, the operands are written to
`<model>/.minengine/layout-<key>.safetensors`; later loads memory-map that file, so no weight
is copied at load and pages arrive, from the page cache, as the first forward pass reads them.
Decode streams mapped pages as fast as owned ones (measured), and the private mapping is
copy-on-write, so nothing done in memory can reach the file.

The key covers everything the layout depends on: the checkpoint files (name, size, mtime),
config.json, the dtype, the weight format, the CPU thread count (it sets the column chunks) and
this file format's version. Dense formats are cached, and reqscope's panel formats (a panel
operand is stored as its panels, scales inside, named in the file's metadata, and built back around
the mapped tensors); FBGEMM's and oneDNN's packed weights are opaque and are not. A file names
its format, and one made for another is rebuilt, never read. A folder keeps one dense layout and
one of each panel format (its name carries the format); a missing, stale or
unreadable one is rebuilt, and a folder that cannot be written to simply gets no cache. Only
the folders of pulled models (under reqscope's models home) get one unless
`REQSCOPE_LAYOUT_CACHE=1`; `=0` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minengine import settings
from minengine.checkpoint.mapped_pages import MappedFiles
from minengine.checkpoint.paths import models_home
from minengine.checkpoint.weight_format import DTYPE_FORMAT
from minengine.checkpoint.weight_layout import CheckpointReader, Operand
from minengine.fast.panel_kernels import PANEL_PACKS, PanelLinear
from minengine.progress import BYTES, ProgressCallback, Stage

FORMAT_VERSION = 3  # 3: q8_0 and q4_1 panels stored as one stream of groups (panel_kernels.GROUP)
CACHE_DIR = ".minengine"
DISABLE_ENV = settings.LAYOUT_CACHE_ENV
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8"}
_TRANSPOSED = "transposed"  # metadata: names stored as their last two dims swapped
_WEIGHTS = "weights"  # metadata: the weight format the operands were built for
_PANELS = "panels"  # metadata: operands stored as panels (`PanelLinear`), each [format, out_features, chunks]
_PAD = "__pad"
_PART = "#"  # a panel operand's tensors are stored as "<operand>#<part>" (`PanelLinear.tensors`: "panels")
# Every tensor starts on a cache line, as torch's own allocations do: MKL's kernels pick their
# code path, and with it the rounding of a sum, by the operands' alignment, so a mapped layout
# aligned differently from a built one would give slightly different logits.
ALIGN = 64


def enabled() -> bool:
    """False when the environment turns the cache off."""
    return settings.layout_cache().value not in settings.LAYOUT_CACHE_OFF


def wanted(folder: Path) -> bool:
    """Whether to cache `folder`'s layout: by default only for models reqscope pulled itself.

    The cache is as large as the weights, so it is not written into a folder the user brought
    (`--model PATH`) unless `REQSCOPE_LAYOUT_CACHE=1` asks for it; `0` turns it off everywhere.
    """
    setting = settings.layout_cache().value
    if not enabled():
        return False
    if setting in settings.LAYOUT_CACHE_EVERYWHERE:
        return True
    return models_home().resolve() in folder.resolve().parents


def layout_key(folder: Path, files: list[Path], dtype: torch.dtype, weights: str) -> str:
    """A digest of everything the operands built from `files` for weight format `weights` depend on.

    A dense format is its dtype's own, which the key holds already, so its key is the one layouts
    had before the format was a choice (they stay valid); any other format is hashed in."""
    h = hashlib.sha256()
    h.update(f"{FORMAT_VERSION}|{dtype}|{torch.get_num_threads()}|".encode())
    if weights != DTYPE_FORMAT.get(dtype):
        h.update(f"weights {weights}|".encode())
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in files:
        st = path.stat()
        h.update(f"|{path.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def layout_path(folder: Path, key: str, weights: str | None = None) -> Path:
    """Where the layout for `key` lives. A panel format's carries the format in its name, so that
    it is kept beside the dense layout instead of replacing it (`write_layout` keeps one of each)."""
    tag = f"{weights}-" if weights in PANEL_PACKS else ""
    return folder / CACHE_DIR / f"layout-{tag}{key}.safetensors"


def _kind(path: Path) -> str:
    """The format tag in a layout file's name ("" for a dense layout)."""
    stem = path.name.removeprefix("layout-").removesuffix(".safetensors")
    return stem.rsplit("-", 1)[0] if "-" in stem else ""


def clear(folder: Path) -> None:
    """Remove every cached layout of `folder` (the next load builds and writes a fresh one)."""
    for path in (folder / CACHE_DIR).glob("layout-*.safetensors"):
        path.unlink(missing_ok=True)


class CachedLayout:
    """Operands read back from a layout file, answering `CheckpointReader`'s questions."""

    def __init__(self, tensors: dict[str, torch.Tensor], panels: dict[str, list] | None = None) -> None:
        self.tensors = tensors
        self.panels = panels or {}  # operand name -> [format, out_features, chunks]
        self._mapped: MappedFiles | None = None  # the file's ranges, read when first needed

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def copy(self, name: str) -> torch.Tensor:
        """The stored tensor (a view of the mapping)."""
        return self.tensors[name]

    def projection(self, *names: str, chunks: int | None = None) -> torch.Tensor | PanelLinear:
        """The stored operand for these weights (built back into its panels where it was stored so)."""
        name = _projection_name(names)
        if name in self.panels:
            fmt, out_features, stored_chunks = self.panels[name]
            made = PanelLinear.stored(fmt, self.tensors[f"{name}{_PART}panels"], out_features, stored_chunks)
            if made.dot8 is not None:
                # Rounded activations multiply the DOT8 copy just packed; the groups are read again only
                # for a tied head's few rows a step (or an inspection), faulted back in from the file.
                self._mapped = self._mapped or MappedFiles()
                self._mapped.release(made.panels)
            return made
        return self.tensors[name]

    def embedding(self, name: str, *, tied: bool) -> torch.Tensor | None:
        """The stored table, or None when the head serves lookups (layouts are float32's own operands)."""
        return None if tied else self.tensors[name]

    def optional(self, name: str) -> torch.Tensor | None:
        """The stored tensor, or None when the checkpoint had none."""
        return self.tensors.get(name)


class RecordingReader:
    """A `CheckpointReader` that remembers what it handed out, under names `CachedLayout` reads.

    With a `stage`, it reports how many of the checkpoint's tensors have been laid out so far.
    """

    def __init__(self, reader: CheckpointReader, stage: Stage | None = None) -> None:
        self.reader = reader
        self.made: dict[str, torch.Tensor] = {}
        self.panels: dict[str, list] = {}  # the operands made as panels, as `CachedLayout.panels`
        self._stage = stage
        self._consumed = 0

    def _laid_out(self, names: tuple[str, ...]) -> None:
        self._consumed += len(names)
        if self._stage is not None:
            self._stage.advance(self._consumed, names[-1])

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def copy(self, name: str) -> torch.Tensor:
        """`CheckpointReader.copy`, recorded."""
        self.made[name] = t = self.reader.copy(name)
        self._laid_out((name,))
        return t

    def projection(self, *names: str, chunks: int | None = None) -> Operand:
        """`CheckpointReader.projection`, recorded (a panel kernel's weight as its tensors)."""
        name, t = _projection_name(names), self.reader.projection(*names, chunks=chunks)
        if isinstance(t, PanelLinear):
            self.panels[name] = [t.format, t.out_features, t.chunks]
            self.made.update({f"{name}{_PART}{part}": x for part, x in t.tensors().items()})
        else:
            self.made[name] = t
        self._laid_out(names)
        return t

    def embedding(self, name: str, *, tied: bool) -> torch.Tensor | None:
        """`CheckpointReader.embedding` of a dense layout, recorded when it is a table of its own."""
        return None if tied else self.copy(name)

    def optional(self, name: str) -> torch.Tensor | None:
        """`CheckpointReader.optional`, recorded when present."""
        return self.copy(name) if name in self.reader else None


def _projection_name(names: tuple[str, ...]) -> str:
    return "+".join(names)


def open_layout(path: Path, weights: str) -> CachedLayout | None:
    """The layout at `path`, memory-mapped, or None when it is missing, unreadable or made for
    another weight format than `weights`."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            # A layout from before formats were named is its dtype's own, as its key says.
            if metadata.get(_WEIGHTS, weights) != weights:
                return None
            transposed = set(json.loads(metadata.get(_TRANSPOSED, "[]")))
            panels = json.loads(metadata.get(_PANELS, "{}"))
            tensors = {}
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith(_PAD):
                    continue
                t = handle.get_tensor(name)
                if t.data_ptr() % ALIGN:
                    return None  # not written by this module: rebuilding it is the safe answer
                tensors[name] = t.transpose(-2, -1) if name in transposed else t
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None
    return CachedLayout(tensors, panels)


def write_layout(
    path: Path,
    tensors: dict[str, torch.Tensor],
    weights: str,
    progress: ProgressCallback | None = None,
    panels: dict[str, list] | None = None,
) -> bool:
    """Write `tensors`, built for weight format `weights`, as a safetensors file at `path`
    (atomically, replacing other layouts); False on failure. `panels` names the operands stored
    as a panel kernel's tensors (`RecordingReader.panels`).

    Written directly from the tensors' memory: `safetensors.torch.save_file` would first copy
    every tensor into a bytes object, briefly holding the weights twice. `progress` hears a
    "cache" stage counting the bytes written.
    """
    if any(t.dtype not in _DTYPE_NAMES for t in tensors.values()):
        return False  # a dtype this format does not name: load without a cache
    header: dict[str, object] = {}
    transposed: list[str] = []
    stored: list[torch.Tensor] = []
    offset = 0
    for name, t in tensors.items():
        if not t.is_contiguous() and t.dim() >= 2 and t.transpose(-2, -1).is_contiguous():
            t = t.transpose(-2, -1)  # a transposed view of owned rows: store the rows
            transposed.append(name)
        t = t.contiguous()
        if offset % ALIGN:  # safetensors allows no gaps between tensors: fill with a padding tensor
            pad = ALIGN - offset % ALIGN
            header[f"{_PAD}{len(stored)}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            stored.append(torch.zeros(pad, dtype=torch.uint8))
            offset += pad
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        stored.append(t)
        offset += size
    header["__metadata__"] = {
        _TRANSPOSED: json.dumps(transposed), "format": str(FORMAT_VERSION), _WEIGHTS: weights,
        _PANELS: json.dumps(panels or {}),
    }  # fmt: skip
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the data, and so every tensor, starts aligned
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    except OSError:
        return False
    writing = Stage(progress, "cache", 8 + len(raw) + offset, BYTES, path.name)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(len(raw).to_bytes(8, "little"))
            out.write(raw)
            written = 8 + len(raw)
            for t in stored:
                out.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                written += t.numel() * t.element_size()
                writing.advance(written)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from the folder's other users
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        writing.finish(f"not written ({exc.strerror or exc}); the next load lays the weights out again")
        return False
    writing.finish()
    for other in path.parent.glob("layout-*.safetensors"):
        if other != path and _kind(other) == _kind(path):
            other.unlink(missing_ok=True)
    return True
