"""Device and dtype choice, and honest timing on asynchronous devices."""

from __future__ import annotations

import torch

from minengine.dtype_names import DTYPE_ALIASES, DTYPE_NAMES
from minengine.errors import Mention, ReqscopeError, Setting

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ReqscopeError(
            Mention(Setting.DEVICE, "cuda"),
            " was asked for but no CUDA device is available; use ",
            Mention(Setting.DEVICE, "cpu"),
        )
    if name not in ("cpu", "cuda"):
        raise ReqscopeError(f"unknown device {name!r}; choose auto, cpu or cuda")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ReqscopeError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so a host timestamp covers the work it claims to."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_memory_bytes(device: torch.device) -> int | None:
    """Bytes the allocator holds on a CUDA device (None on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return None
