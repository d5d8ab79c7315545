"""Convert a llama or qwen2 GGUF file into a Hugging Face model folder.

The folder holds safetensors weights, config.json, generation_config.json, tokenizer.json and
tokenizer_config.json, so minengine and transformers load it like any other checkpoint.
Quantized blocks are dequantized: the folder stores the GGUF's effective values, not the
original full-precision weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from minengine.checkpoint.atomic_dir import is_empty_or_missing, staged_dir
from minengine.checkpoint.shards import write_checkpoint
from minengine.errors import ModelNotFoundError, ReqscopeError, WeightsError
from minengine.gguf.hparams import GGUFHyperParams
from minengine.gguf.metadata import GGUFMetadata
from minengine.gguf.tensors import HFTensor, iter_hf_tensors
from minengine.gguf.tokenizer import build_tokenizer, tokenizer_config
from minengine.progress import TENSORS, ProgressCallback, Stage, report_to

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Small models keep the dequantized values exactly; big ones would double their disk and
# memory footprint for a precision the quantized source never had.
FLOAT32_MAX_PARAMS = 1_000_000_000


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    progress: ProgressCallback | None = None,
    dtype: str | None = None,
) -> Path:
    """Write the Hugging Face folder for `gguf_path` at `out_dir` and return `out_dir`.

    `dtype` is "float32", "bfloat16" or "float16"; by default float32 for models up to 1B
    parameters and bfloat16 above. `out_dir` must be missing or empty; the folder appears
    there only once complete. Raises ConfigError for architectures other than llama/qwen2.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    report = report_to(progress)
    if not is_empty_or_missing(out_dir):
        raise ReqscopeError(f"{out_dir} already exists and is not empty; pick a new output folder")
    reader = _open(gguf_path)
    meta = GGUFMetadata(reader, gguf_path.name)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    hparams = GGUFHyperParams.from_gguf(meta, shapes)
    tokenizer = build_tokenizer(meta)
    dtype = dtype or _default_dtype(sum(int(t.n_elements) for t in reader.tensors))
    if dtype not in DTYPES:
        raise ReqscopeError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")

    with staged_dir(out_dir) as stage:
        # One "convert" stage for the whole folder: the small files after the weights take
        # milliseconds, not worth a bar of their own.
        converting = Stage(report, "convert", len(shapes), TENSORS, gguf_path.name)
        tensors = _as_torch(iter_hf_tensors(reader, hparams), DTYPES[dtype], converting)
        write_checkpoint(tensors, stage)
        files: dict[str, Any] = {
            "config.json": hparams.hf_config(dtype),
            "generation_config.json": hparams.generation_config(),
            "tokenizer_config.json": tokenizer_config(meta, hparams.config.max_position_embeddings),
        }
        tokenizer.save(str(stage / "tokenizer.json"))
        for name, content in files.items():
            text = json.dumps(content, indent=2, ensure_ascii=False) + "\n"
            (stage / name).write_text(text, encoding="utf-8")
        converting.finish(f"{dtype} safetensors, config and tokenizer written")
    return out_dir


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}")
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise WeightsError(f"{path} is not a readable GGUF file ({exc})") from None


def _default_dtype(n_params: int) -> str:
    return "float32" if n_params <= FLOAT32_MAX_PARAMS else "bfloat16"


def _as_torch(
    tensors: Iterator[HFTensor], dtype: torch.dtype, stage: Stage
) -> Iterator[tuple[str, torch.Tensor]]:
    done = 0
    for done, tensor in enumerate(tensors, start=1):
        stage.advance(done, tensor.name)
        yield tensor.name, torch.from_numpy(tensor.values).to(dtype)
    stage.advance(done, "writing the safetensors file")  # the checkpoint writer saves after the last tensor
