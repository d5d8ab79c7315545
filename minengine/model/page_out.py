"""Hand the pages of a tensor the process no longer reads back to the kernel, without losing them.

With rounded activations a block format multiplies its DOT8 copy (`panel_kernels`), and its groups
are read again only for a tied head's lookups (a few rows a step) or an inspection. On a warm load
the groups are views of the layout cache's memory-mapped file, so once the copy is packed their
pages can go: madvise's MADV_PAGEOUT reclaims them, and a later read faults them back in from the
file. The advice never loses a byte (memory of the process's own, with no swap, simply stays), and
where the kernel does not know it (before Linux 5.4, or another OS) nothing happens.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # Linux's value, where Python was built without it
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def page_out(t: torch.Tensor) -> bool:
    """Advise the kernel to reclaim the whole pages under the contiguous tensor `t`; False where it
    declined or cannot (not Linux, an older kernel, less than a page)."""
    if _libc is None or not t.is_contiguous() or t.device.type != "cpu":
        return False
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only: the ends may hold other tensors
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return False
    return _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), ctypes.c_int(MADV_PAGEOUT)) == 0
