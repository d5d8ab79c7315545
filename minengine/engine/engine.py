"""The engine: a loaded model, its tokenizer, a device, an admission scheduler, the KV block pool
and the prefix cache its requests share."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from minengine import settings
from minengine.checkpoint.weight_format import compute_dtype_for, refuse_shapes, resolve_weights
from minengine.checkpoint.weights import load_state_dict
from minengine.config import ModelConfig
from minengine.device import resolve_device, resolve_dtype, synchronize
from minengine.engine.events import Event
from minengine.engine.request import GenerationRequest
from minengine.engine.scheduler import Scheduler
from minengine.engine.session import RequestSession
from minengine.engine.step_loop import Member, StepLoop, default_limits
from minengine.engine.timeline import Timeline
from minengine.errors import ConfigError, Mention, ModelNotFoundError, Setting
from minengine.kv.arithmetic import stored_kv_heads
from minengine.kv.block_pool import BlockFormat, BlockPool
from minengine.kv.paged_cache import PagedKVCache
from minengine.kv.prefix_cache import KVIdentity, PrefixCache
from minengine.kv.usage import PoolUsage
from minengine.model.transformer import Transformer
from minengine.progress import ProgressCallback
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from minengine.steps.reference_runner import EngineReferenceModel, ReferenceRunner, reference_weights
from minengine.text.tokenizer import ModelTokenizer
from minengine.threads import model_thread

KERNELS = ("fast", "reference")  # the ways an engine's steps compute (`Engine(kernels=...)`)


def model_fingerprint(folder: Path) -> str:
    """What identifies a loaded model's weights: its folder, and every config and weight file's
    name, size and modification time (read once, at load; hashing the weights would cost a
    second per 500 MB)."""
    folder = folder.resolve()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))
    stats = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha256("\n".join([str(folder), *stats]).encode()).hexdigest()


class Engine:
    """Load once, then run requests: each in its own session, their forwards in shared steps."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        weights: str = "auto",
        kv_budget_bytes: int | None = None,
        progress: ProgressCallback | None = None,
        prefix_cache: bool = True,
        cuda_graph: bool = True,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        kernels: str = "fast",
    ) -> None:
        """Load the model in `model_dir`; a first load that lays out the CPU weights reports its
        stages to `progress` (see `minengine.progress`). `prefix_cache` keeps finished requests'
        KV blocks for later requests with the same prompt prefix (`minengine.kv.prefix_cache`).
        `cuda_graph`: on a CUDA device, decode steps replay captured CUDA graphs (the static step,
        `minengine.fast.cuda_graph`), else they run eagerly; other devices have no graphs, and
        it changes nothing there. `max_num_seqs` and `max_num_batched_tokens` bound what one
        step of the step loop runs together (`minengine.engine.step_loop`; the token budget's
        default depends on the device); up to `max_num_seqs` requests run at once (by default as
        many as the KV pool holds and a step can give a token each, `step_loop.default_limits`). `weights` is
        the projections' storage ("auto", "float32", "fp16", "bf16", "int8";
        `minengine.checkpoint.weight_format` says what each means where, and what auto picks); it is
        checked before anything is loaded. `kernels` is "fast" (the engine's own paths,
        `minengine.steps.model_runner`) or "reference": every forward through the plain PyTorch model
        (`minengine.reference`), dense weights as the checkpoint stores them."""
        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        limits = default_limits(self.device, max_num_seqs, max_num_batched_tokens)
        limits.check()
        if not self.model_dir.is_dir():
            raise ModelNotFoundError(
                f"model folder {self.model_dir} does not exist; pass ", Mention(Setting.MODEL_DIR, every_way=True)
            )
        self.cfg = ModelConfig.from_file(self.model_dir)
        if dtype == "auto":
            dtype = compute_dtype_for(weights, self.device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kernels = kernels
        if kernels not in KERNELS:
            raise ConfigError(f"kernels {kernels!r} is none of {', '.join(KERNELS)}; pass ", Setting.KERNELS)
        # On the model thread (below): auto's probe of the checkpoint runs torch's parallel operations, and a
        # second OpenMP team left on this thread would throttle every step's workers, more than halving decode
        # (docs/engine.md, "Many requests, one step: continuous batching").
        if kernels == "reference":
            self.weights = reference_weights(weights, self.dtype)
        else:
            self.weights = model_thread().call(resolve_weights, weights, self.device, self.dtype, self.model_dir)
        refuse_shapes(self.weights, self.cfg)
        self.tokenizer = ModelTokenizer(self.model_dir)
        # On the thread every step will run on (`threads.model_thread`): one OpenMP team for both.
        self.model, self.runner = model_thread().call(self._load, progress, cuda_graph)
        # Every request's KV blocks and the prefix cache's, within the KV budget; admission waits for room in it.
        self.pool = BlockPool(kv_budget_bytes or settings.default_kv_budget(self.device), self.device)
        self.kv_budget_given = kv_budget_bytes is not None  # else probed: half the memory free at load
        self.scheduler = Scheduler(self.pool.budget_bytes, max_running=limits.max_num_seqs, pool=self.pool)
        self.fingerprint = model_fingerprint(self.model_dir)
        self.prefix_cache: PrefixCache | None = PrefixCache(self.pool) if prefix_cache else None
        # Every request's forwards run here, in steps shared with the others running.
        self.steps = StepLoop(
            self.runner,
            limits,
            waiting=lambda: self.scheduler.waiting,
            pool=self._pool_usage,
            weight_bytes=self.model.decode_weight_bytes,
        )
        self.load_ms = (time.perf_counter() - start) * 1000

    def _load(
        self, progress: ProgressCallback | None, cuda_graph: bool
    ) -> tuple[Transformer | EngineReferenceModel, ModelRunner | ReferenceRunner]:
        """The model and the runner requests make caches and run steps through."""
        if self.kernels == "reference":
            state = load_state_dict(self.model_dir, self.cfg, self.dtype, self.device)
            reference = EngineReferenceModel(self.cfg, state)
            return reference, ReferenceRunner(reference)
        model = load_model(self.model_dir, self.cfg, self.dtype, self.device, progress, packs=self.weights.packs)
        model.rope.ensure(min(self.cfg.max_position_embeddings, 4096))
        runner = ModelRunner(model, static_decode=cuda_graph and self.device.type == "cuda")
        synchronize(self.device)
        return model, runner

    def _pool_usage(self, member: Member, members: list[Member]) -> PoolUsage:
        """The KV budget as `member` sees it: the blocks its cache holds, the other running
        requests' blocks, the blocks only the prefix cache keeps, the rest free. A cache outside
        the pool (the static decoder's arena) counts its physical bytes."""
        pool = self.pool
        own = pool.held_bytes_by(member.cache.owner) if isinstance(member.cache, PagedKVCache) else 0
        arena = {m: m.cache.usage().physical_bytes for m in members if not isinstance(m.cache, PagedKVCache)}
        own += arena.get(member, 0)
        others = pool.request_bytes + sum(arena.values()) - own
        return PoolUsage(self.scheduler.kv_budget_bytes, own, others, pool.prefix_only_bytes)

    def prefault_kv(self, nbytes: int) -> int:
        """Make the first `nbytes` of the KV pool resident in the default request's block format
        (`BlockPool.prefault`: the CPU only); the bytes written."""
        cfg, default = self.cfg, GenerationRequest  # its field defaults: the layout, blocks, KV dtype "auto"
        heads = stored_kv_heads(default.kv_layout, cfg.num_attention_heads, cfg.num_key_value_heads)
        fmt = BlockFormat(cfg.num_hidden_layers, heads, cfg.head_dim, default.block_size, self.dtype)
        return model_thread().call(self.pool.prefault, fmt, nbytes) * fmt.nbytes  # the steps' OpenMP team

    def use_prefix_cache(self, enabled: bool) -> None:
        """Turn the prefix cache on or off for requests started from now on (off drops its blocks)."""
        if not enabled:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self.prefix_cache = None
        elif self.prefix_cache is None:
            self.prefix_cache = PrefixCache(self.pool)

    def kv_identity(self, layout: str, storage_dtype: torch.dtype, block_size: int) -> KVIdentity:
        """What, besides the tokens, decides the K/V of a request's cache on this engine."""
        return KVIdentity(
            model=self.fingerprint,
            dtype=str(self.dtype).removeprefix("torch."),
            weights=self.weights.format,
            device=str(self.device),
            layout=layout,
            storage_dtype=str(storage_dtype).removeprefix("torch."),
            block_size=block_size,
        )

    def start(
        self, request: GenerationRequest, timeline: Timeline | None = None, *, steered: bool = True
    ) -> RequestSession:
        """A session for `request`; iterate it to run the request. `steered=False` for a consumer
        that never holds, forces or changes a step (a server): the engine then samples each token
        in the step and goes on without waiting for the consumer (`minengine.engine.run_ahead`)."""
        return RequestSession(self, request, timeline, steered=steered)

    def generate(self, request: GenerationRequest) -> Iterator[Event]:
        """Run `request` to completion, yielding every event."""
        return iter(self.start(request))

    def describe(self) -> str:
        """One line naming the model, its attention layout, device, dtype and weight format (and why)."""
        c = self.cfg
        return (
            f"{self.model_dir.name}: {c.model_type}, {c.num_hidden_layers} layers, "
            f"{c.num_attention_heads} q heads / {c.num_key_value_heads} kv heads ({c.attention_kind}), "
            f"{self.device.type} {str(self.dtype).removeprefix('torch.')}, weights {self.weights.label}"
            + (", reference kernels" if self.kernels == "reference" else "")
        )
