"""Running the model for requests: making their KV caches and choosing how each step runs.

Three ways run the same blocks (`Transformer.block`) and differ in where K/V live and what a
step allocates:

- the static step (`cuda_graph.StaticDecoder`): one token in a K/V arena lent to one request
  at a time, captured in CUDA graphs (on by default on CUDA, where a step is several hundred
  kernel launches otherwise);
- the eager step (`eager_step.EagerDecoder`): one token into scratch buffers, for a cache that
  stores K/V as computed (a paged table too, while its blocks are consecutive), a third fewer
  operations per layer than the general path;
- the general path (`Transformer.forward`): any number of tokens, any cache (prefill, and
  decode over quantized, widened or outgrown caches).

A step shared by several sequences runs their stacked rows (`shared_step`): through the C stack
over rows, or the Python blocks. `pick` and `pick_rows` are the one place these choices are made,
each naming the path and why (`step_path`); `last_path` is the one that ran. The choice depends on
the cache, so it is made per call; the cache is made here too, over the static decoder's arena
when that can serve it. On the CPU each call also runs on the thread count
`decode_threads.StepThreads` chooses for the machine's state (all threads unless other processes
want a core, when the command spins; see there). Every call runs on the process's model thread,
where the engine loaded: model work from a second thread would open a second OpenMP team, and
with two, every parallel region waits for a sleeping worker (`threads.ModelThread`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minengine.fast.cuda_graph import StaticDecoder
from minengine.fast.decode_threads import StepThreads
from minengine.fast.eager_step import EagerDecoder, LayerStack
from minengine.fast.panel_kernels import UNPACK_ROWS, amx_takes
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.kv.request_cache import request_cache
from minengine.model.transformer import Transformer
from minengine.steps.shared_step import Row, run_rows
from minengine.steps.step_path import NOT_RUN, StepPath, weights_label
from minengine.threads import model_thread

_GENERAL_ONE = StepPath("torch general", "one token, but the cache is quantized, widened, borrowed or full")


class ModelRunner:
    """A loaded `Transformer` and its decoders: `new_cache` for a request, then `forward` per step."""

    def __init__(self, model: Transformer, *, static_decode: bool | None = None) -> None:
        """Run `model`, decoding through the static step when `static_decode` (by default: on CUDA)."""
        self.model = model
        self.device = model.device
        self.eager_decoder = EagerDecoder(model)
        self.last_path: StepPath = NOT_RUN  # the path of the step that ran last (`pick`)
        self._label = weights_label(model.layers[0].qkv)  # "int16×q4_1": what the projections multiply
        # The lean step's two paths, named once: `pick` runs before every decode step.
        label, device = self._label, self.device.type
        self._stacked = StepPath(f"c-stack {label}", f"one token on the CPU; {label} panels, every block in one C call")
        no_stack = f"one token into scratch buffers; no C stack for {label} weights on {device}"
        self._eager = StepPath("torch eager", no_stack)
        self.static_decoder: StaticDecoder | None = None
        self.use_static_decode(model.device.type == "cuda" if static_decode is None else static_decode)
        cpu = model.device.type == "cpu"
        self.step_threads = StepThreads(torch.get_num_threads() if cpu else 1, steer=None if cpu else False)

    def use_static_decode(self, enabled: bool, *, capture: bool | None = None) -> None:
        """Decode through the static-shape step (captured in CUDA graphs unless `capture=False`).

        Caches made by `new_cache` afterwards decode that way; on the CPU the static step only
        runs eagerly (it exists there to be tested). The engine chooses at construction (see
        `static_decode`); switching later compares the paths over the same loaded weights.
        """
        if not enabled:
            self.static_decoder = None
            return
        capture = self.device.type == "cuda" if capture is None else capture
        self.static_decoder = StaticDecoder(self.model, capture=capture)

    def new_cache(self, tokens: int, **options: Any) -> KVCache | PagedKVCache:
        """A KV cache for `tokens` positions: over the static decoder's arena when that can
        serve it (unquantized storage in the model's dtype, arena not lent out), else
        `request_cache`'s, whose options (layout, storage_dtype, block_size, pool, owner) these are."""
        model = self.model
        if self.static_decoder is not None and options.get("storage_dtype") in (None, model.dtype):
            layout, block_size = options.get("layout", "gqa"), options.get("block_size", 16)
            cache = self.static_decoder.new_cache(tokens, layout=layout, block_size=block_size)
            if cache is not None:
                return cache
        return request_cache(model.cfg, model.device, model.dtype, tokens, **options)

    def forward(
        self, ids: torch.Tensor, start: int, cache: KVCache | PagedKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        """`Transformer.forward`'s logits for positions [start, start+len(ids)), by the fastest
        path that serves `cache`: a single token (not `all_logits`) through the static or eager
        step when one can, everything else through the general path. Runs on the process's model
        thread (`threads.model_thread`), waited for when called from another."""
        steps = model_thread()
        if not steps.here():
            return steps.call(lambda: self.forward(ids, start, cache, all_logits=all_logits))
        return self._forward(ids, start, cache, all_logits)

    def pick(self, ids: torch.Tensor, start: int, cache: KVCache | PagedKVCache, all_logits: bool) -> StepPath:
        """The path one sequence's step takes, and why: the static step where it holds this
        cache, else the lean one-token step where the cache allows it, else the general path."""
        if ids.shape[0] != 1 or all_logits:
            why = f"{ids.shape[0]} positions" if not all_logits else "every position's logits asked for"
            return StepPath("torch general", why)
        static = self.static_decoder
        if static is not None and static.serves(cache):
            name = "cuda-graph" if static.capture else "static eager"
            return StepPath(name, "one token; the static arena holds this cache")
        if self.eager_decoder.serves(cache, start):
            return self._stacked if self.eager_decoder.stack(cache) is not None else self._eager
        return _GENERAL_ONE

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, start: int, cache: KVCache | PagedKVCache, all_logits: bool) -> torch.Tensor:
        if isinstance(cache, PagedKVCache):
            cache.make_room(start + ids.shape[0])  # the blocks first: the lean step writes in place
        path = self.last_path = self.pick(ids, start, cache, all_logits)
        with self.step_threads.step(ids.shape[0] == 1 and not all_logits):
            if path.name in ("cuda-graph", "static eager"):
                return self.static_decoder.step(ids, start, cache)  # type: ignore[union-attr]
            if path.name != "torch general":
                return self.eager_decoder.step(ids, start, cache)
            return self.model.forward(ids, start, cache, all_logits=all_logits)

    def _split_rows(
        self, rows: list[Row], decode: list[int], computing: Callable[[], object] | None
    ) -> list[torch.Tensor | None]:
        """A step of decode rows and prompt chunks in two passes: the decode rows through the C stack
        over rows, then the chunks through the Python blocks. Each row's arithmetic is its own either
        way (the stack gives the Python blocks' bits), so only the time changes: a chunk no longer
        takes every decode row of the step through the Python blocks with it."""
        taken = set(decode)
        others = [i for i in range(len(rows)) if i not in taken]
        with self.step_threads.step(False):
            stacked, first = run_rows(self.model, [rows[i] for i in decode], computing, stack=True)
            _, second = run_rows(self.model, [rows[i] for i in others], None, stack=False)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for i, logits in zip(decode + others, first + second, strict=True):
            out[i] = logits
        stack = f"c-stack rows {self._label}" if stacked else "torch rows"
        self.last_path = StepPath(f"{stack} + torch chunks", f"{len(decode)} decode rows, then {len(others)} rows "
                                  "with a prompt chunk through the Python blocks")  # fmt: skip
        return out

    def pick_rows(self, rows: list[Row]) -> StepPath:
        """The path a step shared by several sequences takes, and why: the C stack over rows where
        every row is one decode token wanting its logits, in weights it serves, and fewer rows than
        hand the products to MKL; else the Python blocks over the stacked rows (`shared_step`)."""
        n, label = len(rows), self._label
        if any(len(r.ids) != 1 for r in rows):
            return StepPath("torch rows", f"{n} rows with a prompt chunk among them")
        if any(r.observer is not None or not r.logits for r in rows):
            return StepPath("torch rows", f"{n} rows, one inspected (its attention seen on its own)")
        if not 2 <= n < UNPACK_ROWS:
            return StepPath("torch rows", f"{n} decode rows: from {UNPACK_ROWS} the products are MKL's")
        if LayerStack.of(self.model) is None:
            return StepPath("torch rows", f"{n} decode rows; no C stack for {label} weights on {self.device.type}")
        tiles = " on AMX tiles" if label.startswith("int16") and amx_takes(n) else ""
        return StepPath(f"c-stack rows {label}", f"{n} decode rows in one pool segment, {label} panels{tiles}")

    def forward_rows(self, rows: list[Row], computing: Callable[[], object] | None = None) -> list[torch.Tensor | None]:
        """One step over several sequences' rows (`shared_step`); each row's logits or None.

        A step of one row that wants its logits is an ordinary `forward`, so a request alone
        decodes through the lean single-token steps as before; an observed row (inspection)
        takes this general path, whose attention hands the observer its operands. On the model
        thread, as `forward`. `computing` is called once the step's inputs are laid out, as its
        compute begins."""
        steps = model_thread()
        if not steps.here():
            return steps.call(self.forward_rows, rows, computing)
        for row in rows:  # blocks first: lean rows write in place, and a full pool fails before any compute
            if isinstance(row.cache, PagedKVCache):
                row.cache.make_room(row.start + len(row.ids))
        if len(rows) == 1 and rows[0].logits and rows[0].observer is None:
            row = rows[0]
            ids = torch.tensor(row.ids, device=self.device)
            if computing is not None:
                computing()
            return [self.forward(ids, row.start, row.cache)]
        decode = [i for i, r in enumerate(rows) if len(r.ids) == 1 and r.logits and r.observer is None]
        if 2 <= len(decode) < len(rows) and self.pick_rows([rows[i] for i in decode]).name != "torch rows":
            return self._split_rows(rows, decode, computing)
        path = self.pick_rows(rows)
        with self.step_threads.step(False):
            stacked, logits = run_rows(self.model, rows, computing, stack=path.name != "torch rows")
        if path.name != "torch rows" and not stacked:  # the stack reads one pool segment, in place
            path = StepPath("torch rows", f"{len(rows)} decode rows whose caches are not in one pool segment")
        self.last_path = path
        return logits
