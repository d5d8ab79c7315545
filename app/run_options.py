"""The flags every request-running mode shares, and turning them into engine objects."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from minengine.engine.request import GenerationRequest, SettingSource
from minengine.errors import RequestError
from minengine.kv.arithmetic import DTYPE_BYTES, MIB
from minengine.kv.usage import KV_DTYPE_ALIASES, KV_DTYPES, KV_LAYOUTS
from minengine.progress import StatusCallback
from minengine.sampling.model_defaults import FILE, ModelSamplingDefaults
from minengine.sampling.params import SamplingParams
from reqscope.console.progress_line import ProgressLine
from reqscope.engine_flags import MODEL_HELP, add_engine_arguments
from reqscope.flag_aliases import deprecated_alias
from reqscope.request_flags import FlagError, add_request_arguments, check_penalties, read_request_flags

if TYPE_CHECKING:
    from minengine.engine.engine import Engine

DEFAULT_PROMPT = "Show me wheelchair-accessible hotels in Kyoto"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, device, sampling and KV flags (shared by run, the UI and the benchmark)."""
    m = parser.add_argument_group("model")
    add_engine_arguments(m, "model", "device", model_help=f"Hugging Face style {MODEL_HELP}")
    m.add_argument(
        "--generation-config",
        default="auto",
        choices=("auto", "reqscope"),
        help="auto: unset sampling flags take the model's generation_config.json values, as in vLLM; "
        "reqscope: ignore that file and use reqscope's defaults",
    )
    add_engine_arguments(m, "dtype", "weights", "kernels")
    m.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay each decode step as a captured CUDA graph (default: on with CUDA; an error on the CPU)",
    )
    s = parser.add_argument_group("sampling")
    s.add_argument("--system", metavar="TEXT", help="system message sent before the prompt")
    # These default to None, not to their value, so that endpoint mode can tell a flag the user
    # gave from one left unset (it sends only the former); a local run fills in LOCAL_SAMPLING.
    # Their defaults are written by hand, in the help formatter's own form: argparse's is None.
    from_model = "the model's generation_config.json, else"
    d = LOCAL_SAMPLING
    s.add_argument("--temperature", type=float, help=f"0 = greedy (default: {from_model} {d.temperature:g})")
    s.add_argument("--top-k", type=int, help=f"0 = off (default: {from_model} {d.top_k})")
    s.add_argument("--top-p", type=float, help=f"1 = off (default: {from_model} {d.top_p:g})")
    s.add_argument("--min-p", type=float, help=f"0 = off (default: {from_model} {d.min_p:g})")
    s.add_argument("--seed", type=int, help=f"sampling seed (default: {d.seed})")
    s.add_argument(
        "--max-tokens", type=int, help=f"most tokens to generate, as vLLM's max_tokens (default: {from_model} "
        f"{d.max_tokens})",
    )  # fmt: skip
    s.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    s.add_argument(
        "--sampler-order",
        default="hf",
        metavar="ORDER",
        help="hf, llama.cpp, vllm, or a comma list of temperature,top_k,top_p,min_p",
    )
    add_request_arguments(parser)
    k = parser.add_argument_group("KV cache")
    k.add_argument("--kv-layout", default="gqa", choices=KV_LAYOUTS)
    k.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_DTYPES + tuple(KV_DTYPE_ALIASES),
        help="KV storage, as vLLM's flag (fp8 = float8_e4m3fn)",
    )
    deprecated_alias(k, "--kv-dtype", "--kv-cache-dtype")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    add_engine_arguments(k, "kv_budget_mib", "max_num_seqs", "max_num_batched_tokens")
    add_prefix_cache_argument(k)
    parser.add_argument_group("explorer").add_argument(
        "--service-model",
        metavar="FILE",
        help="a `reqscope calibrate --output` fit: the explorer shows its predicted prefill beside the measured",
    )


def add_prefix_cache_argument(group: argparse._ArgumentGroup) -> None:
    """`--enable-prefix-caching`/`--no-enable-prefix-caching`, vLLM's names (shared with serve)."""
    group.add_argument(
        "--enable-prefix-caching",
        dest="prefix_cache",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,  # absent unless given: the engine's default (on) applies
        help="keep finished requests' KV blocks for reuse by prompts that start the same way "
        "(default: on, within the KV budget)",
    )
    deprecated_alias(group, "--no-prefix-cache", "--no-enable-prefix-caching")


@dataclass(frozen=True)
class LocalSampling:
    """What a local run uses for each sampling flag the user did not give."""

    temperature: float = 0.7
    top_k: int = 50
    top_p: float = 0.9
    min_p: float = 0.0
    seed: int = 0
    max_tokens: int = 256


LOCAL_SAMPLING = LocalSampling()


@dataclass(frozen=True)
class ModelFolder:
    """The model folder a run uses, found once from the flags and handed to the request and the engine."""

    path: Path
    default: bool  # the default model's folder: `ensure` pulls the model into it when it is missing

    @classmethod
    def of(cls, args: argparse.Namespace) -> ModelFolder:
        """--model's folder, or where the default model lives (nothing is pulled here)."""
        if args.model:
            return cls(Path(args.model).expanduser(), default=False)
        from minengine.hub.pull import default_model_dir  # platformdirs: only when no --model

        return cls(default_model_dir(), default=True)

    def ensure(self, progress: StatusCallback | None = None) -> Path:
        """The folder, after pulling the default model into it when missing (its stages reported to `progress`)."""
        if not self.default:
            return self.path
        from minengine.hub.pull import ensure_default_model

        return ensure_default_model(progress=progress)


def model_sampling_defaults(args: argparse.Namespace, model: ModelFolder | None) -> ModelSamplingDefaults:
    """`model`'s generation_config.json defaults, unless --generation-config reqscope.

    Read before the model loads (the request is built first); a folder not there yet (the
    default model before its first pull) has none. Without a folder (`None`: an endpoint, whose
    --model is a served name) there are none either: the server applies its own.
    """
    if getattr(args, "generation_config", "auto") == "reqscope" or model is None:
        return ModelSamplingDefaults()
    return ModelSamplingDefaults.read(model.path) if model.path.is_dir() else ModelSamplingDefaults()


def request_from_args(args: argparse.Namespace, prompt: str, model: ModelFolder | None) -> GenerationRequest:
    """A GenerationRequest from the shared flags (validated later, at the gateway).

    Each sampling value comes from its flag when given, else from the generation_config.json of
    `model` (None for an endpoint) when it sets one (as vLLM and transformers do), else from
    reqscope's defaults (LOCAL_SAMPLING); the request records which.
    """
    check_penalties(args)
    extras = read_request_flags(args, vocab_size=model_vocab_size(model))
    defaults = model_sampling_defaults(args, model)
    model_file = FILE
    sources: list[SettingSource] = []

    def pick(name: str, flag, from_model, local):
        if flag is not None:
            sources.append(SettingSource(name, "flag"))
            return flag
        if from_model is not None:
            sources.append(SettingSource(name, model_file))
            return type(local)(from_model)
        sources.append(SettingSource(name, "reqscope default"))
        return local

    d = LOCAL_SAMPLING
    sampling = SamplingParams(
        temperature=pick("temperature", args.temperature, defaults.temperature, d.temperature),
        top_k=pick("top_k", args.top_k, defaults.top_k, d.top_k),
        top_p=pick("top_p", args.top_p, defaults.top_p, d.top_p),
        min_p=pick("min_p", args.min_p, defaults.min_p, d.min_p),
        seed=pick("seed", args.seed, None, d.seed),
        order=SamplingParams.parse_order(args.sampler_order),
        logit_bias=extras.logit_bias,
    )
    # The penalties are off unless their flag is given (vLLM reads repetition_penalty from
    # generation_config.json too; the default model's sets none).
    for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
        value = getattr(args, name, None)
        if value is not None:
            sources.append(SettingSource(name, "flag"))
            sampling = sampling.with_(**{name: value})
    max_tokens = pick("max_tokens", args.max_tokens, defaults.max_new_tokens, d.max_tokens)
    min_tokens = getattr(args, "min_tokens", None) or 0
    if min_tokens > max_tokens:
        raise FlagError(f"--min-tokens {min_tokens} is over max_tokens ({max_tokens}); lower it or raise --max-tokens")
    return GenerationRequest.from_prompt(
        prompt,
        system=args.system,
        sampling=sampling,
        setting_sources=tuple(sources),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=tuple(args.stop),
        kv_layout=args.kv_layout,
        kv_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        tools=extras.tools,
        tool_choice=extras.tool_choice,
        parallel_tool_calls=extras.parallel_tool_calls,
        generic_tools=extras.generic_tools,
        structured=extras.structured,
    )


def model_vocab_size(model: ModelFolder | None) -> int | None:
    """The vocabulary size in `model`'s config.json, read before the model loads; None when not known yet."""
    if model is None:
        return None
    try:
        value = json.loads((model.path / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # not pulled yet, or unreadable: the engine checks the ids once it has loaded
    return value if isinstance(value, int) and value > 0 else None


def open_engine(args: argparse.Namespace, model: ModelFolder, progress: StatusCallback | None = None) -> Engine:
    """Load `model` (pulled first when it is the default one, missing) with the flags' device,
    dtype, weight format, KV budget, step limits and CUDA-graph choice, and the chat template of
    `--chat-template` in place of the model's own.

    Step limits no request could run under are refused before the model loads, a KV budget
    that cannot hold the smallest request (one block of the run's KV storage) once it has
    (`minengine.engine.batch_limits`).

    `progress` hears status messages and the stages of a pull and of a first load (download,
    verify, convert, layout, cache) as `PullProgress` events.
    """
    # torch loads here, not with the flags: `--base-url` parses them too and never makes a tensor.
    from minengine.device import resolve_device
    from minengine.engine.engine import Engine
    from minengine.engine.step_loop import default_limits
    from minengine.kv.budget_floor import check_budget_holds_a_request, smallest_request_bytes

    if args.kv_budget_mib is not None and args.kv_budget_mib <= 0:
        raise RequestError("--kv-budget-mib must be greater than 0")
    # serve's requests take the engine's default KV storage and blocks; run's flags choose theirs.
    block_size = getattr(args, "block_size", GenerationRequest.block_size)
    tokens = getattr(args, "max_num_batched_tokens", None)  # None: the device's default limits
    seqs = getattr(args, "max_num_seqs", None)  # None: by capacity (`step_loop.default_limits`)
    limits = default_limits(resolve_device(args.device), seqs, tokens)
    limits.check(block_size)  # the engine checks them too, in its own 16-token blocks
    cuda_graph = getattr(args, "cuda_graph", None)  # verbs without the flag keep the engine's default
    if cuda_graph and resolve_device(args.device).type != "cuda":
        # Asked for by name, a graph that cannot exist is an error, not a silent no-op.
        raise RequestError("--cuda-graph needs a CUDA device; this run is on the CPU (drop it, or use --device cuda)")
    try:
        model_dir = model.ensure(progress)
        if progress is not None:
            progress(f"loading {model_dir}")
        budget = int(args.kv_budget_mib * MIB) if args.kv_budget_mib is not None else None
        engine = Engine(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            weights=getattr(args, "weights", "auto"),  # verbs without the flag keep auto
            kv_budget_bytes=budget,
            progress=progress,
            prefix_cache=getattr(args, "prefix_cache", True),  # verbs without the flag keep it on
            cuda_graph=cuda_graph is not False,  # unset: the engine's default (on, where there is CUDA)
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=tokens,
            kernels=getattr(args, "kernels", "fast"),  # verbs without the flag run the fast paths
        )
    finally:
        if isinstance(progress, ProgressLine):
            progress.close()  # a stage cut short by an error leaves its line open on a terminal
    template = getattr(args, "chat_template", None)
    if template:  # --chat-template: every request this engine renders uses it
        engine.tokenizer.use_chat_template_file(Path(template).expanduser())
    kv_dtype = getattr(args, "kv_cache_dtype", "auto")
    kv_dtype = KV_DTYPE_ALIASES.get(kv_dtype, kv_dtype)
    element = engine.dtype.itemsize if kv_dtype == "auto" else DTYPE_BYTES[kv_dtype]
    one_block = smallest_request_bytes(engine.cfg, getattr(args, "kv_layout", "gqa"), element, block_size)
    check_budget_holds_a_request(engine.scheduler.kv_budget_bytes, one_block, block_size)
    return engine


# The text modes' progress on stderr: `reqscope: ...` messages, and each pull or first-load stage
# as one line redrawn in place on a terminal (a line at its start and one at its end otherwise).
stderr_progress = ProgressLine(prefix="reqscope: ")
