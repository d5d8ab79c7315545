"""The benchmark's schedule: the fair comparison first, then the in-process rounds.

The headline is the fair comparison (`fair`): reqscope as the `reqscope --json` command,
transformers' `generate()` in a plain Python process with the user's own environment, and any
installed peer (llama.cpp), each in its own process, timed from outside. What follows runs in
this process, with the policy the benchmark set for both engines (`env`): a secondary, "same
policy" comparison, and the measurements that need the engine's insides.

After one warm-up round, every in-process round measures, for minengine and for transformers
on the same token ids: prefill of a short chat prompt, prefill of a long prompt, and greedy
decode; plus minengine's greedy decode between passes of a read-bandwidth probe (the roofline)
and the explorer's session stepping beside the bare loop (its overhead). The order of the two
engines flips every round (AB, BA, AB, ...), so a machine that speeds up or slows down during
the run favours neither, and every ratio is taken within a round. Launches of the real
`reqscope --plain` command (start-up time, peak memory, imports) run last, in subprocesses.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from minengine import settings
from minengine.checkpoint import layout_cache
from minengine.device import device_memory_bytes, synchronize
from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.kv.arithmetic import MIB, blocks_for, kv_bytes_per_token
from minengine.kv.cache import KVCache
from minengine.omp_env import user_environment
from minengine.sampling.params import SamplingParams
from reqscope.bench.fair.compare import (
    REQSCOPE,
    TRANSFORMERS,
    UNDER_LOAD,
    Contender,
    FairComparison,
    busy_neighbour,
    probe_environment,
    run_fair,
)
from reqscope.bench.fair.peers import (
    PeerChoice,
    PeerSelection,
    ensure_default_gguf,
    llama_child_argv,
    peer_bytes_per_step,
    select_peers,
)
from reqscope.bench.formats import (
    FormatPlan,
    FormatsResult,
    LongPrefill,
    format_rows,
    long_prefills,
    long_prompt_text,
    plan_formats,
    side_name,
)
from reqscope.bench.hf_reference import TransformersReference
from reqscope.bench.read_probe import (
    ReadProbe,
    achieved_bandwidth,
    decode_bytes_per_step,
    roofline_fraction,
    roofline_tokens_per_second,
)
from reqscope.bench.runs import (
    DecodeRun,
    RooflineRun,
    decode_beside_probes,
    explorer_beside_bare,
    greedy_decode,
    prefill_ms,
)
from reqscope.bench.start import PlainRun, child_environment, heavy_imports, launch_plain, plain_imports
from reqscope.bench.stats import Parity, Spread, overhead_percent, parity_of, ratios
from reqscope.run_options import DEFAULT_PROMPT

_LONG_TEXT = (
    "Kyoto keeps more than a thousand temples, and visitors who use a wheelchair plan their days "
    "around step-free routes: the station, the buses along Horikawa street, the level paths of the "
    "Imperial Palace park and the lift at the Kyoto Tower. Hotels near the station list roll-in "
    "showers and wide doors; ryokan in Higashiyama often have steps at the entrance. "
)


@dataclass(frozen=True)
class BenchConfig:
    """What to run and how often."""

    model_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"  # the projections' format (`--weights`), for reqscope's side only
    threads: int | None = None  # torch intra-op threads for both engines (None: torch's default)
    rounds: int = 5
    new_tokens: int = 128
    long_prompt_tokens: int = 1025
    prefill_repeats: int = 2  # prefills per engine per round; the round keeps the fastest
    prompt: str = DEFAULT_PROMPT
    warm_launches: int = 3  # `reqscope --plain` launches after the first (0: no launches at all)
    launch_max_tokens: int = 16
    memory_allowance_bytes: int = 384 * MIB  # interpreter, torch, tokenizer and activations
    cuda_graph: bool = True
    kernels: str = "fast"  # `Engine(kernels=...)`: the engine's fast paths, or the reference model
    probe_bytes: int | None = None  # read-bandwidth probe size (None: the roofline module's default)
    omp_policy_set_by_bench: bool = False  # the launches then run without it, as users do
    peers: PeerChoice = PeerChoice()  # default: every installed peer that has its model file
    under_load: bool = False  # run the fair comparison again beside one busy process
    fair_rounds: int | None = None  # rounds of the fair comparison (None: `rounds`)
    # Other weight formats, each a side of the fair comparison of its own (`formats.EVERY_FORMAT`:
    # every one this machine runs; none by default here, all by default in the command)
    formats: tuple[str, ...] = ()


@dataclass(frozen=True)
class Comparison:
    """One measurement for both engines, and minengine's speed relative to transformers."""

    unit: str
    minengine: Spread
    transformers: Spread
    speedup: Spread  # minengine speed / transformers speed, per round (> 1: minengine faster)


@dataclass(frozen=True)
class RooflineResult:
    """minengine's decode against the memory bandwidth measured in the same rounds."""

    probe_matvec_bytes_per_s: Spread
    probe_sum_bytes_per_s: Spread
    peak_bytes_per_s: Spread
    probe_bytes: int  # one pass of either probe
    bytes_per_step: float
    decode_tokens_per_s: Spread  # the bare loop, between the probe passes
    achieved_bytes_per_s: Spread
    fraction: Spread  # of the peak (the faster probe): the strict reading
    matvec_fraction: Spread  # of the matvec probe: the measure of the roofline
    ceiling_tokens_per_s: Spread


@dataclass(frozen=True)
class ExplorerResult:
    """Decode with everything the explorer shows switched on, against the bare loop."""

    tokens: int
    top_n: int
    bare_tokens_per_s: Spread
    explorer_tokens_per_s: Spread
    overhead_percent: Spread
    same_tokens: bool


@dataclass(frozen=True)
class StartResult:
    """`reqscope --plain` launches: time to the first visible token, and what it imported."""

    cold_first_token_s: float
    warm_first_token_s: Spread
    heavy_imports: tuple[str, ...]


@dataclass(frozen=True)
class MemoryResult:
    """Peak resident memory of a `reqscope --plain` launch against what it needs to hold."""

    peak_rss_bytes: int
    weight_bytes: int
    kv_bytes: int
    allowance_bytes: int

    @property
    def budget_bytes(self) -> int:
        """Weights + KV + the stated allowance."""
        return self.weight_bytes + self.kv_bytes + self.allowance_bytes


@dataclass(frozen=True)
class DeviceMemoryResult:
    """CUDA only: what the allocator saw for KV beside what the KV formula says."""

    kv_allocated_bytes: int  # torch.cuda.memory_allocated() delta when the cache was made
    kv_computed_bytes: int  # KVCache.usage().reserved_bytes for the same cache
    kv_logical_bytes: int  # after prefilling the long prompt
    static_decode: bool
    graphs_captured: int
    decode_step_ms: Spread  # CUDA-event time per decode step (minengine)


@dataclass(frozen=True)
class MachineInfo:
    """Where and with what the numbers were measured."""

    device: str
    dtype: str
    threads: int
    cpu_count: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    omp_wait_policy: str
    torch: str
    transformers: str
    python: str
    model: str
    weight_bytes: int
    decode_weight_bytes: int  # what a decode step reads (an untied embedding: one row)
    kv_bytes_per_token: int


@dataclass(frozen=True)
class BenchReport:
    """Everything one benchmark run measured.

    `fair` (and `fair_under_load`) is the headline; `prefill_*`, `decode` and `parity` are the
    in-process, same-policy comparison.
    """

    machine: MachineInfo
    config: BenchConfig
    fair: FairComparison
    fair_under_load: FairComparison | None
    short_prompt_tokens: int
    prefill_short: Comparison
    prefill_long: Comparison
    decode: Comparison
    parity: Parity
    roofline: RooflineResult
    explorer: ExplorerResult
    start: StartResult | None
    memory: MemoryResult | None
    device_memory: DeviceMemoryResult | None
    formats: FormatsResult | None = None  # each weight format in its own processes, when asked for


@dataclass
class _Round:
    """Raw figures collected round by round."""

    prefill_short: dict[str, list[float]]
    prefill_long: dict[str, list[float]]
    decode: dict[str, list[DecodeRun]]
    roofline: list[RooflineRun]
    bare: list[DecodeRun]
    explorer: list[DecodeRun]


def long_prompt_ids(engine: Engine, tokens: int) -> list[int]:
    """Exactly `tokens` token ids of plain English text (not repeated verbatim)."""
    parts, ids = [], []
    while len(ids) < tokens:
        parts.append(f"Note {len(parts) + 1}. {_LONG_TEXT}")
        ids = engine.tokenizer.encode("".join(parts))
    return ids[:tokens]


@dataclass(frozen=True)
class _Workload:
    """The two engines and the inputs both get."""

    engine: Engine
    reference: TransformersReference
    request: GenerationRequest  # the short chat prompt, greedy, with the explorer's trace on
    short_ids: list[int]
    long_ids: list[int]


def run_bench(config: BenchConfig, progress: Callable[[str], None] = lambda message: None) -> BenchReport:
    """Run the whole benchmark described by `config`."""
    if config.rounds < 1 or config.new_tokens < 2:
        raise ReqscopeError("the benchmark needs at least 1 round and 2 new tokens")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    load_before = os.getloadavg()
    # A bad choice fails before anything runs; the default GGUF is fetched here when missing.
    selection = select_peers(config.peers, config.model_dir, default_gguf=lambda: ensure_default_gguf(progress))
    progress(f"loading minengine from {config.model_dir}")
    engine = _engine(config)
    plan = plan_formats(config.formats, engine) if config.formats else None
    fair, fair_loaded = _fair(config, engine, selection, progress, plan.formats if plan else ())
    long = _long_prefills(config, engine, plan, progress) if plan is not None else {}
    progress(f"loading transformers from {config.model_dir} (in-process comparison)")
    work = _workload(config, engine)
    raw = _Round({"ours": [], "theirs": []}, {"ours": [], "theirs": []}, {"ours": [], "theirs": []}, [], [], [])
    probe = ReadProbe(work.engine.device, work.engine.dtype, config.probe_bytes)
    try:
        progress("warm-up round")
        _warm_up(work, config, probe)
        for r in range(config.rounds):
            progress(f"round {r + 1} of {config.rounds}")
            _measure_round(work, config, raw, probe, ours_first=r % 2 == 0)
    finally:
        probe.release()
    engine, model = work.engine, work.engine.model
    device_memory = _device_memory(engine, raw, len(work.long_ids) + config.new_tokens, work.long_ids)
    start, memory = _launches(config, engine, len(work.short_ids)) if config.warm_launches > 0 else (None, None)
    machine = MachineInfo(
        device=_device_name(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        cpu_count=settings.cpu_count() or 0,
        load_before=load_before,
        load_after=os.getloadavg(),
        omp_wait_policy=settings.environment().get(settings.OMP_WAIT_POLICY_ENV, "default"),
        torch=torch.__version__,
        transformers=work.reference.version,
        python=platform.python_version(),
        model=config.model_dir.name,
        weight_bytes=model.weight_bytes,
        decode_weight_bytes=model.decode_weight_bytes,
        kv_bytes_per_token=_kv_bytes_per_token(engine),
    )
    ours_rates = [run.tokens_per_second for run in raw.decode["ours"]]
    theirs_rates = [run.tokens_per_second for run in raw.decode["theirs"]]
    bytes_per_step = decode_bytes_per_step(
        model.decode_weight_bytes, machine.kv_bytes_per_token, len(work.short_ids), config.new_tokens - 1
    )
    roofline = _roofline(raw.roofline, bytes_per_step)
    formats = None
    if plan is not None:
        names = {fmt: side_name(fmt, engine) for fmt in long}
        formats = format_rows(fair, names, long, plan.skipped, roofline.probe_matvec_bytes_per_s.median)
    return BenchReport(
        machine=machine,
        config=config,
        fair=fair,
        fair_under_load=fair_loaded,
        short_prompt_tokens=len(work.short_ids),
        prefill_short=_timed("ms", raw.prefill_short),
        prefill_long=_timed("ms", raw.prefill_long),
        decode=Comparison(
            "tokens/s", Spread.of(ours_rates), Spread.of(theirs_rates), Spread.of(ratios(ours_rates, theirs_rates))
        ),
        parity=parity_of(raw.decode["ours"][0].tokens, raw.decode["theirs"][0].tokens),
        roofline=roofline,
        explorer=_explorer(raw.bare, raw.explorer, work.request.top_n),
        start=start,
        memory=memory,
        device_memory=device_memory,
        formats=formats,
    )


def _engine(config: BenchConfig) -> Engine:
    c = config
    return Engine(
        c.model_dir, device=c.device, dtype=c.dtype, weights=c.weights, cuda_graph=c.cuda_graph, kernels=c.kernels
    )


def _fair(
    config: BenchConfig,
    engine: Engine,
    selection: PeerSelection,
    progress: Callable[[str], None],
    formats: tuple[str, ...] = (),
) -> tuple[FairComparison, FairComparison | None]:
    """The fair comparison on an idle machine, and beside a busy process when asked."""
    contenders = fair_contenders(config, engine, selection, formats)
    rounds = config.fair_rounds or config.rounds
    idle = run_fair(contenders, rounds, config.new_tokens, skipped=selection.skipped, progress=progress)
    if not config.under_load:
        return idle, None
    with busy_neighbour(user_environment()):
        loaded = run_fair(
            contenders, rounds, config.new_tokens, condition=UNDER_LOAD, skipped=selection.skipped, progress=progress
        )
    return idle, loaded


def fair_contenders(
    config: BenchConfig, engine: Engine, selection: PeerSelection, formats: tuple[str, ...] = ()
) -> list[Contender]:
    """reqscope, transformers, the selected peers and reqscope in each of `formats`, each with its
    command line and environment.

    Every child gets the user's environment as it was before reqscope touched it (the policy the
    benchmark set for its own process is taken out), plus OMP_NUM_THREADS when `--threads` was
    given. reqscope then chooses its own policy, as the command always does.
    """
    env = _child_env(config)
    tok = engine.tokenizer
    request = GenerationRequest.from_prompt(config.prompt)
    ids = tok.encode(tok.render(list(request.messages)))
    eos = sorted(tok.eos_ids)
    device, dtype = engine.device.type, str(engine.dtype).removeprefix("torch.")
    ours = decode_bytes_per_step(
        engine.model.decode_weight_bytes, _kv_bytes_per_token(engine), len(ids), config.new_tokens - 1
    )
    reqscope_env = probe_environment(env)
    command = _reqscope_command(config, engine, engine.weights.format, config.new_tokens)
    hf = [sys.executable, "-m", "reqscope.bench.fair.hf_child", "--model", str(config.model_dir)]
    hf += ["--ids", ",".join(map(str, ids)), "--max-new-tokens", str(config.new_tokens)]
    hf += ["--eos", ",".join(map(str, eos)), "--device", device, "--dtype", dtype]
    contenders = [
        Contender(REQSCOPE, "`reqscope --json`, the command as users run it", (*command, config.prompt), env, ours,
                  reqscope_env),
        Contender(TRANSFORMERS, "generate() in a plain Python process, streamer on stdout", tuple(hf), env, ours),
    ]  # fmt: skip
    threads = config.threads or reqscope_env.threads  # llama.cpp gets the thread count torch uses
    for plan in selection.plans:
        argv = llama_child_argv(plan, ids, config.new_tokens, threads, eos)
        how = f"llama-cpp-python on {plan.gguf.name}, greedy, n_threads {threads}"
        per_step = peer_bytes_per_step(plan, len(ids), config.new_tokens - 1)
        contenders.append(Contender(plan.name, how, tuple(argv), env, per_step))
    for fmt in formats:  # their bytes per step: what each child reports its steps read
        how = f"`reqscope --json --weights {fmt}`, the command as users run it"
        argv = (*_reqscope_command(config, engine, fmt, config.new_tokens), config.prompt)
        contenders.append(Contender(side_name(fmt, engine), how, argv, env, None, reqscope_env))
    return contenders


def _child_env(config: BenchConfig) -> dict[str, str]:
    env = user_environment()
    if config.threads is not None:
        env["OMP_NUM_THREADS"] = str(config.threads)
    return env


def _reqscope_command(config: BenchConfig, engine: Engine, weights: str, max_tokens: int) -> tuple[str, ...]:
    """`reqscope --json`, greedy, on the benchmark's model, device and dtype, in `weights` (the prompt follows)."""
    device, dtype = engine.device.type, str(engine.dtype).removeprefix("torch.")
    command = [sys.executable, "-m", "reqscope", "--json", "--temperature", "0"]
    command += ["--max-tokens", str(max_tokens), "--model", str(config.model_dir)]
    command += ["--device", device, "--dtype", dtype, "--weights", weights]
    if device == "cuda" and not config.cuda_graph:
        command.append("--no-cuda-graph")
    return tuple(command)


def _long_prefills(
    config: BenchConfig, engine: Engine, plan: FormatPlan, progress: Callable[[str], None]
) -> dict[str, LongPrefill]:
    """Every format's long prompt (about `long_prompt_tokens`, chat-templated) and one token, in its own process."""
    text = long_prompt_text(engine, config.long_prompt_tokens, long_prompt_ids)
    formats = (engine.weights.format, *plan.formats)
    commands = {fmt: (*_reqscope_command(config, engine, fmt, 1), text) for fmt in formats}
    return long_prefills(commands, _child_env(config), config.fair_rounds or config.rounds, progress)


def _workload(config: BenchConfig, engine: Engine) -> _Workload:
    eos = sorted(engine.tokenizer.eos_ids)
    reference = TransformersReference(config.model_dir, engine.device, engine.dtype, pad_token_id=eos[0] if eos else 0)
    request = GenerationRequest.from_prompt(
        config.prompt, sampling=SamplingParams(temperature=0.0), max_tokens=config.new_tokens, trace=True
    )
    tok = engine.tokenizer
    short_ids = tok.encode(tok.render(list(request.messages)))
    return _Workload(engine, reference, request, short_ids, long_prompt_ids(engine, config.long_prompt_tokens))


def _warm_up(work: _Workload, config: BenchConfig, probe: ReadProbe) -> None:
    """One discarded pass over everything.

    It pays first-call costs (allocator growth, kernel selection, graph capture) and grows the
    static arena to its largest size before anything is timed.
    """
    runner = work.engine.runner
    prefill_ms(runner, work.long_ids)
    greedy_decode(runner, work.long_ids, 2)
    work.reference.prefill_ms(work.long_ids)
    greedy_decode(runner, work.short_ids, config.new_tokens)
    work.reference.decode(work.short_ids, 4)
    explorer_beside_bare(work.engine, work.request, work.short_ids)
    decode_beside_probes(runner, work.short_ids, 3, probe)


def _measure_round(work: _Workload, config: BenchConfig, raw: _Round, probe: ReadProbe, *, ours_first: bool) -> None:
    """One measured round, each pair of runs in the given order."""
    runner, reference, repeats = work.engine.runner, work.reference, config.prefill_repeats
    for which in ("ours", "theirs") if ours_first else ("theirs", "ours"):
        if which == "ours":
            raw.prefill_short[which].append(_best_of(repeats, lambda: prefill_ms(runner, work.short_ids)))
            raw.prefill_long[which].append(_best_of(repeats, lambda: prefill_ms(runner, work.long_ids)))
            raw.decode[which].append(greedy_decode(runner, work.short_ids, config.new_tokens))
        else:
            raw.prefill_short[which].append(_best_of(repeats, lambda: reference.prefill_ms(work.short_ids)))
            raw.prefill_long[which].append(_best_of(repeats, lambda: reference.prefill_ms(work.long_ids)))
            raw.decode[which].append(reference.decode(work.short_ids, config.new_tokens))
    bare, explorer = explorer_beside_bare(work.engine, work.request, work.short_ids)
    raw.bare.append(bare)
    raw.explorer.append(explorer)
    raw.roofline.append(decode_beside_probes(runner, work.short_ids, config.new_tokens, probe))


def _kv_bytes_per_token(engine: Engine) -> int:
    c = engine.cfg
    return kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, engine.dtype.itemsize)


def _best_of(repeats: int, run: Callable[[], float]) -> float:
    # Interference from other processes only ever adds time, so within a round the fastest
    # of a few prefills is the best estimate of the engine's own cost.
    return min(run() for _ in range(max(1, repeats)))


def _timed(unit: str, times: dict[str, list[float]]) -> Comparison:
    # Times, so speed ratio = their time / our time.
    return Comparison(
        unit, Spread.of(times["ours"]), Spread.of(times["theirs"]), Spread.of(ratios(times["theirs"], times["ours"]))
    )


def _roofline(runs: list[RooflineRun], bytes_per_step: float) -> RooflineResult:
    rates = [run.tokens_per_second for run in runs]
    achieved = [achieved_bandwidth(bytes_per_step, rate) for rate in rates]
    matvec = [run.matvec_bytes_per_second for run in runs]
    peaks = [max(run.matvec_bytes_per_second, run.sum_bytes_per_second) for run in runs]
    return RooflineResult(
        probe_matvec_bytes_per_s=Spread.of(matvec),
        probe_sum_bytes_per_s=Spread.of([run.sum_bytes_per_second for run in runs]),
        peak_bytes_per_s=Spread.of(peaks),
        probe_bytes=runs[0].probe_bytes,
        bytes_per_step=bytes_per_step,
        decode_tokens_per_s=Spread.of(rates),
        achieved_bytes_per_s=Spread.of(achieved),
        fraction=Spread.of([roofline_fraction(a, p) for a, p in zip(achieved, peaks, strict=True)]),
        matvec_fraction=Spread.of([roofline_fraction(a, p) for a, p in zip(achieved, matvec, strict=True)]),
        ceiling_tokens_per_s=Spread.of([roofline_tokens_per_second(bytes_per_step, p) for p in peaks]),
    )


def _explorer(bare: list[DecodeRun], explorer: list[DecodeRun], top_n: int) -> ExplorerResult:
    bare_rates = [run.tokens_per_second for run in bare]
    explorer_rates = [run.tokens_per_second for run in explorer]
    return ExplorerResult(
        tokens=len(explorer[0].tokens),
        top_n=top_n,
        bare_tokens_per_s=Spread.of(bare_rates),
        explorer_tokens_per_s=Spread.of(explorer_rates),
        overhead_percent=Spread.of(overhead_percent(explorer_rates, bare_rates)),
        same_tokens=all(b.tokens == e.tokens for b, e in zip(bare, explorer, strict=True)),
    )


def _device_memory(engine: Engine, raw: _Round, tokens: int, long_ids: list[int]) -> DeviceMemoryResult | None:
    if engine.device.type != "cuda":
        return None
    synchronize(engine.device)
    before = device_memory_bytes(engine.device) or 0
    # A cache of its own (not the static arena), so the allocation is this cache's alone.
    cache = KVCache(engine.cfg, tokens, device=engine.device, compute_dtype=engine.dtype)
    synchronize(engine.device)
    allocated = (device_memory_bytes(engine.device) or 0) - before
    engine.runner.forward(torch.tensor(long_ids, device=engine.device), 0, cache)
    usage = cache.usage()
    cache.release()
    decoder = engine.runner.static_decoder
    steps = [ms for run in raw.decode["ours"] for ms in run.step_ms]
    return DeviceMemoryResult(
        kv_allocated_bytes=allocated,
        kv_computed_bytes=usage.reserved_bytes,
        kv_logical_bytes=usage.logical_bytes,
        static_decode=decoder is not None,
        graphs_captured=decoder.captures if decoder is not None else 0,
        decode_step_ms=Spread.of(steps),
    )


def _launches(config: BenchConfig, engine: Engine, prompt_tokens: int) -> tuple[StartResult, MemoryResult | None]:
    env = child_environment(drop=("OMP_WAIT_POLICY",) if config.omp_policy_set_by_bench else ())
    run = PlainRun(config.prompt, config.launch_max_tokens, config.model_dir, config.device, config.dtype)
    # The cold launch is a first run: it builds (and caches) the CPU weight layout itself.
    layout_cache.clear(config.model_dir)
    launches = [launch_plain(run, env=env) for _ in range(1 + config.warm_launches)]
    warm = [launch.first_token_s for launch in launches[1:]]
    start = StartResult(launches[0].first_token_s, Spread.of(warm), heavy_imports(plain_imports(run, env=env)))
    if engine.device.type == "cuda":
        return start, None  # weights live in device memory there; see DeviceMemoryResult
    memory = MemoryResult(
        peak_rss_bytes=max(launch.peak_rss_bytes for launch in launches),
        weight_bytes=engine.model.weight_bytes,
        kv_bytes=blocks_for(prompt_tokens + config.launch_max_tokens, 16) * 16 * _kv_bytes_per_token(engine),
        allowance_bytes=config.memory_allowance_bytes,
    )
    return start, memory


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()})"
