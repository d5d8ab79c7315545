"""The sampling settings form: the chain's parameters, penalties and bias, seed, max tokens and order,
the request's grammar and tools, checked as typed."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from minengine.errors import RequestError
from minengine.sampling.params import NAMED_ORDERS, SamplingParams
from reqscope.request_flags import parse_bias
from reqscope.ui.field_form import Field, FieldForm, field_reader


@dataclass(frozen=True)
class SamplingChoice:
    """What the form returns: the parameters and the grammar for the next steps, the token limit
    and the tools for the next run."""

    params: SamplingParams
    max_tokens: int
    # Whether the next run sends the request's tools. They are written into the prompt (the
    # template's tool block), so a running request keeps the ones it started with: this applies on restart.
    tools: bool = True
    # Whether the request's grammar (its output schema, or the tool call it must make) masks the
    # steps: switched at the held step (`RequestSession.set_grammar`), and kept for the next run.
    grammar: bool = True


def order_text(order: tuple[str, ...]) -> str:
    """An order as its engine name when it has one, else as a comma list."""
    named = {v: k for k, v in NAMED_ORDERS.items()}
    return named.get(order, ",".join(order))


def _number(name: str, kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def read(text: str) -> int | float:
        text = text.strip()
        try:
            return kind(text)
        except ValueError:
            raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}; got {text!r}") from None

    return read


def _seed(text: str) -> int | None:
    return _number("seed", int)(text) if text.strip() else None  # blank: a new seed each run


def _penalty(name: str, off: float) -> Callable[[str], float]:
    def read(text: str) -> float:
        return float(_number(name, float)(text)) if text.strip() else off  # blank: the penalty is off

    return read


def _on_off(name: str) -> Callable[[str], bool]:
    def read(text: str) -> bool:
        word = text.strip().lower()
        if word not in ("on", "off", ""):
            raise RequestError(f"{name} must be on or off; got {text.strip()!r}")
        return word != "off"  # blank: on

    return read


def bias_text(bias: tuple[tuple[int, float], ...]) -> str:
    """`2=-100, 13=5`: logit bias as the form shows it (blank: none)."""
    return ", ".join(f"{token_id}={value:g}" for token_id, value in bias)


def parse_bias_text(text: str) -> tuple[tuple[int, float], ...]:
    """Logit bias from `ID=BIAS, ID=BIAS` (blank: none); RequestError names the bad pair."""
    pairs: dict[int, float] = {}
    for word in (w for w in text.replace(";", ",").split(",") if w.strip()):
        try:
            token_id, bias = parse_bias(word.strip())
        except RequestError as exc:
            raise RequestError(f"logit bias {exc}") from None
        pairs[token_id] = bias
    return tuple(sorted(pairs.items()))


FIELDS: tuple[Field[SamplingChoice], ...] = (
    Field("temperature", "temperature", "0 = greedy", lambda c: f"{c.params.temperature:g}",
          _number("temperature", float)),
    Field("top_k", "top-k", "0 = off", lambda c: str(c.params.top_k), _number("top_k", int)),
    Field("top_p", "top-p", "1 = off", lambda c: f"{c.params.top_p:g}", _number("top_p", float)),
    Field("min_p", "min-p", "0 = off", lambda c: f"{c.params.min_p:g}", _number("min_p", float)),
    Field("repetition_penalty", "repetition", "1 = off; prompt + output",
          lambda c: f"{c.params.repetition_penalty:g}",
          _penalty("repetition_penalty", 1.0)),
    Field("frequency_penalty", "frequency", "0 = off; per output count", lambda c: f"{c.params.frequency_penalty:g}",
          _penalty("frequency_penalty", 0.0)),
    Field("presence_penalty", "presence", "0 = off; once output", lambda c: f"{c.params.presence_penalty:g}",
          _penalty("presence_penalty", 0.0)),
    Field("logit_bias", "logit bias", "ID=BIAS, ... (blank = none)", lambda c: bias_text(c.params.logit_bias),
          parse_bias_text),
    Field("seed", "seed", "blank = random", lambda c: "" if c.params.seed is None else str(c.params.seed), _seed),
    Field("max_tokens", "max tokens", "applies on restart (r)", lambda c: str(c.max_tokens),
          _number("max_tokens", int)),
    Field("grammar", "grammar", "on or off: the schema or forced tool call, from the held step",
          lambda c: "on" if c.grammar else "off", _on_off("grammar")),
    Field("tools", "tools", "on or off; in the prompt: applies on restart (r)",
          lambda c: "on" if c.tools else "off", _on_off("tools")),
    Field("order", "sampler order", "hf, llama.cpp, vllm or a comma list", lambda c: order_text(c.params.order),
          SamplingParams.parse_order),
)


def parse_choice(values: Mapping[str, str], base: SamplingParams) -> SamplingChoice:
    """Read the fields into a validated choice; RequestError names the first bad field."""
    read = field_reader(FIELDS, values)
    params = base.with_(
        temperature=read("temperature"),
        top_k=read("top_k"),
        top_p=read("top_p"),
        min_p=read("min_p"),
        repetition_penalty=read("repetition_penalty"),
        frequency_penalty=read("frequency_penalty"),
        presence_penalty=read("presence_penalty"),
        logit_bias=read("logit_bias"),
        seed=read("seed"),
        order=read("order"),
    )
    params.validate()
    max_tokens = read("max_tokens")
    if max_tokens < 1:
        raise RequestError(f"max tokens must be at least 1; got {max_tokens}")
    return SamplingChoice(params, max_tokens, tools=read("tools"), grammar=read("grammar"))


class SamplingForm(FieldForm[SamplingChoice]):
    """Edit the sampling settings; every valid edit is previewed on the waiting step at once."""

    BOX_TITLE = "Sampling"
    FIELDS = FIELDS

    def parse(self, values: Mapping[str, str]) -> SamplingChoice:
        return parse_choice(values, self.current.params)
