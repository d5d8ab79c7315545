"""Give back the resident pages of a memory-mapped checkpoint once a tensor has been copied out.

safetensors maps the checkpoint file privately and hands out tensors that view the mapping.
Every page a load-time copy reads (fusing q/k/v, transposing wide matrices) stays resident,
and counted in the process's memory, until the whole file is unmapped, which only happens
when the last view dies: loading would briefly hold the weights twice.
`madvise(MADV_DONTNEED)` on a clean, file-backed private mapping drops those pages; reading
them again would simply fault them back in from the file, so the data is never at risk.
Anonymous memory (where the same call would discard contents) is never advised: only ranges
that /proc/self/maps shows as backed by a file qualify. Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_MADV_DONTNEED = 4  # Linux value


class MappedFiles:
    """The file-backed address ranges of this process, read once, and a way to drop pages in them."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._madvise = None
        if not sys.platform.startswith("linux"):
            return
        try:
            with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
                lines = maps.read().splitlines()
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        self._madvise = madvise
        for line in lines:
            fields = line.split(maxsplit=5)
            # address perms offset dev inode [path]: a file mapping has a non-zero inode and a path
            if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                self.ranges.append((start, end))

    def release(self, tensor: torch.Tensor) -> bool:
        """Drop the whole pages under `tensor` if it views a file mapping; True if any were dropped."""
        if self._madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return False
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self.ranges):
            return False
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page  # pages wholly inside the tensor
        if last <= first:
            return False
        return self._madvise(first, last - first, _MADV_DONTNEED) == 0
