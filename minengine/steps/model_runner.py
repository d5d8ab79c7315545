"""Running the model for requests: making their KV caches, and planning how each step runs.

Four ways run one sequence's step, and differ in where K/V live and what a step allocates:

- the static step (`cuda_graph.StaticDecoder`): one token in a K/V arena lent to one request
  at a time, captured in CUDA graphs (on by default on CUDA, where a step is several hundred
  kernel launches otherwise);
- the eager step (`eager_step.EagerDecoder`): one token into scratch buffers, for a cache that
  stores K/V as computed (a paged table too, while its blocks are consecutive): every block in
  one C call where the C stack serves the weights, else the Python blocks;
- the prompt stack (`prompt_stack.PromptStack`): a prompt chunk of one sequence, every block in one
  C call, into a cache that holds K/V as computed;
- the general path (`Transformer.forward`): any number of tokens, any cache (prefill, and
  decode over quantized, widened or outgrown caches).

A step shared by several sequences runs their stacked rows (`shared_step`): through the C stack
over rows, the Python blocks, or both in two passes. `pick` and `pick_rows` are the one place
these choices are made: each checks every condition of the path first (the cache, the pool
segment, the weights) and returns a `StepPlan` whose `run` carries it out as chosen; the runner
calls it and records its path (`last_path`). The choice depends on the cache, so it is made per
step; the cache is made here too, over the static decoder's arena when that can serve it. On
the CPU each step also runs on the thread count `decode_threads.StepThreads` chooses for the
machine's state. Every call runs on the process's model thread, where the engine loaded: model
work from a second thread would open a second OpenMP team, and with two, every parallel region
waits for a sleeping worker (`threads.ModelThread`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minengine.fast.cuda_graph import StaticDecoder
from minengine.fast.decode_threads import StepThreads
from minengine.fast.eager_step import EagerDecoder, LayerStack
from minengine.fast.panel_kernels import UNPACK_ROWS, amx_takes, amx_tiles_name
from minengine.fast.prompt_stack import PromptStack
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.kv.request_cache import request_cache
from minengine.model.transformer import Transformer
from minengine.steps.rows import PoolGroup, Row
from minengine.steps.shared_step import paged_chunks, pool_groups, run_blocks, run_stacked, stacked_group
from minengine.steps.step_path import NOT_RUN, StepPath, StepPlan, weights_label
from minengine.threads import model_thread

Logits = torch.Tensor
RowsLogits = list[torch.Tensor | None]


class ModelRunner:
    """A loaded `Transformer` and its decoders: `new_cache` for a request, then `forward` per step."""

    def __init__(self, model: Transformer, *, static_decode: bool | None = None) -> None:
        """Run `model`, decoding through the static step when `static_decode` (by default: on CUDA)."""
        self.model = model
        self.device = model.device
        self.eager_decoder = EagerDecoder(model)
        self.last_path: StepPath = NOT_RUN  # the path of the step that ran last (`pick`)
        self._label = weights_label(model.layers[0].qkv)  # "int16×q4_1": what the projections multiply
        self._stack = LayerStack.of(model)  # every block in one C call, where the weights allow it
        self._prompt = PromptStack.of(model)  # a prompt chunk's blocks in one C call, where the weights allow it
        # What the Python blocks' norms, rotations, gating and attentions run, and where the gating is
        # the gate/up product's own (`Layer.gated`).
        gating = ", gating in the gate/up product" if model.layers[0].gating_in_product else ""
        self._ops = f" ({model.ops.name} row ops{gating})"
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

    # -- one sequence ----------------------------------------------------------------------------

    def forward(
        self, ids: torch.Tensor, start: int, cache: KVCache | PagedKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        """`Transformer.forward`'s logits for positions [start, start+len(ids)), by the fastest
        path that serves `cache` (`pick`). Runs on the process's model thread
        (`threads.model_thread`), waited for when called from another."""
        steps = model_thread()
        if not steps.here():
            return steps.call(lambda: self.forward(ids, start, cache, all_logits=all_logits))
        if isinstance(cache, PagedKVCache):
            cache.make_room(start + ids.shape[0])  # the blocks first: the lean step writes in place
        return self._run(self.pick(ids, start, cache, all_logits))

    def pick(
        self, ids: torch.Tensor, start: int, cache: KVCache | PagedKVCache, all_logits: bool = False
    ) -> StepPlan[Logits]:
        """The plan of one sequence's step: a prompt chunk through the C prompt stack where it serves the
        weights and the cache; one token through the static step where it holds this cache, else the
        lean one-token step where the cache allows it (the C stack where it serves the weights and
        the cache, else the Python blocks); else the general path."""
        one = ids.shape[0] == 1 and not all_logits
        prompt, length, label = self._prompt, ids.shape[0], self._label
        refusal = None if prompt is None or one or all_logits else prompt.refusal(cache, start, length)
        if prompt is not None and not one and not all_logits and refusal is None:
            tiles = f" on {amx_tiles_name()}" if label.startswith("int16") and amx_takes(length) else ""
            why = f"{length} positions of one sequence on the CPU; {label} panels{tiles}, every block in one C call"
            return self._plan(f"c-stack prompt {label}", why, False, lambda: prompt.run(ids, start, cache))
        if not one:
            why = f"{ids.shape[0]} positions" if not all_logits else "every position's logits asked for"
            if refusal is not None:
                why += f"; no C prompt stack: {refusal}"
            return self._plan("torch general", why + self._ops, False,
                              lambda: self.model.forward(ids, start, cache, all_logits=all_logits))  # fmt: skip
        static, eager = self.static_decoder, self.eager_decoder
        if static is not None and static.serves(cache):
            name = "cuda-graph" if static.capture else "static eager"
            return self._plan(name, "one token; the static arena holds this cache", True,
                              lambda: static.step(ids, start, cache))  # fmt: skip
        if not eager.serves(cache, start):
            why = "one token, but the cache is quantized, widened, borrowed or full" + self._ops
            return self._plan("torch general", why, True, lambda: self.model.forward(ids, start, cache))
        label, slot_kernel = self._label, eager.slot_kernel_serves(cache)
        stack = self._stack if slot_kernel else None
        if stack is not None:
            why = f"one token on the CPU; {label} panels, every block in one C call"
            return self._plan(f"c-stack {label}", why, True, lambda: eager.step_stack(ids, start, cache, stack))
        lacking = f"no C stack for {label} weights on {self.device.type}" if self._stack is None else (
            "the C kernel does not take this cache's slots")
        why = f"one token into scratch buffers; {lacking}" + (", attended by the C slot kernel" if slot_kernel else "")
        why += self._ops
        return self._plan("torch eager", why, True,
                          lambda: eager.step_blocks(ids, start, cache, slot_kernel=slot_kernel))  # fmt: skip

    # -- a step shared by several sequences ----------------------------------------------------------

    def forward_rows(self, rows: list[Row], computing: Callable[[], object] | None = None) -> RowsLogits:
        """One step over several sequences' rows (`shared_step`); each row's logits or None, by the
        plan `pick_rows` makes. On the model thread, as `forward`. `computing` is called once the
        step's inputs are laid out, as its compute begins."""
        steps = model_thread()
        if not steps.here():
            return steps.call(self.forward_rows, rows, computing)
        for row in rows:  # blocks first: lean rows write in place, and a full pool fails before any compute
            if isinstance(row.cache, PagedKVCache):
                row.cache.make_room(row.start + len(row.ids))
        return self._run(self.pick_rows(rows, computing))

    def pick_rows(self, rows: list[Row], computing: Callable[[], object] | None = None) -> StepPlan[RowsLogits]:
        """The plan of a step shared by several sequences:

        - one row that wants its logits, uninspected: that sequence's own plan (`pick`), so a request
          alone decodes through the lean one-token steps;
        - decode rows only, each wanting its logits, in one pool segment the C kernel reads in place,
          fewer than hand the products to MKL, in weights the C stack serves: the C stack over rows;
        - decode rows the C stack would take beside prompt chunks: two passes, the decode rows
          through the C stack, then the chunks: a lone uninspected one through the C prompt stack where
          it serves the chunk's cache, else through the Python blocks;
        - else the Python blocks over the stacked rows (an inspected row's attention seen on its own).
        """
        if len(rows) == 1 and rows[0].logits and rows[0].observer is None:
            row = rows[0]
            ids = torch.tensor(row.ids, device=self.device)
            one = self.pick(ids, row.start, row.cache)
            return StepPlan(one.path, lambda: _after(computing, lambda: [one.run()]))
        decode = [i for i, r in enumerate(rows) if len(r.ids) == 1 and r.logits and r.observer is None]
        group, refusal = self._stack_group([rows[i] for i in decode])
        n, label, model = len(rows), self._label, self.model
        if len(decode) == n and refusal is None:
            tiles = f" on {amx_tiles_name()}" if label.startswith("int16") and amx_takes(n) else ""
            why = f"{n} decode rows in one pool segment, {label} panels{tiles}"
            stack = self._stack
            return self._rows_plan(f"c-stack rows {label}", why, lambda: run_stacked(model, rows, group, stack,
                                                                                     computing))  # fmt: skip
        if len(decode) < n and len(decode) >= 2 and refusal is None:
            others = [i for i in range(n) if i not in set(decode)]
            chunk, unserved = self._lone_chunk([rows[i] for i in others])
            if chunk is not None:
                why = f"{len(decode)} decode rows, then a prompt chunk of {len(chunk.ids)} positions in one C call"
                prompt, ids = self._prompt, torch.tensor(chunk.ids, device=self.device)

                def through_prompt_stack() -> RowsLogits:
                    return [prompt.run(ids, chunk.start, chunk.cache, logits=chunk.logits)]

                return self._rows_plan(f"c-stack rows {label} + c-stack prompt", why,
                                       lambda: self._two_passes(rows, decode, group, others, through_prompt_stack,
                                                                computing))  # fmt: skip
            one_chunk = len(others) == 1 and len(rows[others[0]].ids) > 1
            rest = f"{len(others)} rows" if len(others) > 1 else "a prompt chunk" if one_chunk else "one row"
            why = f"{len(decode)} decode rows, then {rest} through the Python blocks"
            why += f"; no C prompt stack: {unserved}" if unserved else ""
            chunks = [rows[i] for i in others]
            paged = paged_chunks(chunks, model)

            def through_blocks() -> RowsLogits:
                return run_blocks(model, chunks, [], paged, None)

            return self._rows_plan(f"c-stack rows {label} + torch chunks", why + self._ops,
                                   lambda: self._two_passes(rows, decode, group, others, through_blocks,
                                                            computing))  # fmt: skip
        if len(decode) == n:
            why = refusal
        elif any(len(r.ids) != 1 for r in rows):
            why = f"{n} rows with a prompt chunk among them"
        else:
            why = f"{n} rows, one inspected (its attention seen on its own)"
        groups, paged = pool_groups(rows, model), paged_chunks(rows, model)
        return self._rows_plan("torch rows", f"{why}{self._ops}", lambda: run_blocks(model, rows, groups, paged,
                                                                                         computing))  # fmt: skip

    def _stack_group(self, rows: list[Row]) -> tuple[PoolGroup | None, str | None]:
        """The pool group the C stack over rows would take these decode rows in, or why it cannot."""
        n, label = len(rows), self._label
        if not 2 <= n < UNPACK_ROWS:
            return None, f"{n} decode rows: from {UNPACK_ROWS} the products are MKL's" if n else "no decode rows"
        if self._stack is None:
            return None, f"{n} decode rows; no C stack for {label} weights on {self.device.type}"
        group = stacked_group(self.model, rows)
        if group is None:
            return None, f"{n} decode rows whose caches are not in one pool segment the C kernel reads in place"
        return group, None

    def _lone_chunk(self, rows: list[Row]) -> tuple[Row | None, str | None]:
        """The one prompt chunk of a step's second pass that the C prompt stack takes, or why it does not
        (None where the weights give it no prompt stack at all: the Python blocks are then the only way)."""
        if self._prompt is None:
            return None, None
        if len(rows) != 1:
            return None, f"{len(rows)} rows beside the decode rows, the stack takes one chunk"
        row = rows[0]
        if row.observer is not None:
            return None, "the chunk is inspected"
        refusal = self._prompt.refusal(row.cache, row.start, len(row.ids))
        return (row, None) if refusal is None else (None, refusal)

    def _two_passes(
        self,
        rows: list[Row],
        decode: list[int],
        group: PoolGroup,
        others: list[int],
        second_pass: Callable[[], RowsLogits],
        computing: Callable[[], object] | None,
    ) -> RowsLogits:
        """The decode rows through the C stack over rows, then `second_pass` over the other rows (the chunks:
        the C prompt stack or the Python blocks, as `pick_rows` chose). Each row's arithmetic is its own either
        way (both stacks give the Python blocks' bits), so only the time changes: a chunk no longer takes every
        decode row through the Python blocks. The second pass holds no row that could attend with others in
        the pool: no pool groups."""
        first = run_stacked(self.model, [rows[i] for i in decode], group, self._stack, computing)
        second = second_pass()
        out: RowsLogits = [None] * len(rows)
        for i, logits in zip(decode + others, first + second, strict=True):
            out[i] = logits
        return out

    # -- carrying a plan out ---------------------------------------------------------------------

    def _plan(self, name: str, why: str, one_token: bool, run: Callable[[], Logits]) -> StepPlan[Logits]:
        threads = self.step_threads

        def threaded() -> Logits:
            with threads.step(one_token):
                return run()

        return StepPlan(StepPath(name, why), threaded)

    def _rows_plan(self, name: str, why: str, run: Callable[[], RowsLogits]) -> StepPlan[RowsLogits]:
        threads = self.step_threads

        def threaded() -> RowsLogits:
            with threads.step(False):
                return run()

        return StepPlan(StepPath(name, why), threaded)

    @torch.inference_mode()
    def _run(self, plan: StepPlan):
        self.last_path = plan.path
        return plan.run()


def _after(computing: Callable[[], object] | None, run: Callable[[], RowsLogits]) -> RowsLogits:
    if computing is not None:
        computing()
    return run()
