"""The grammar a request's output must follow, compiled and matched by llguidance.

A request is constrained by `structured` (OpenAI's `response_format`, vLLM's `structured_outputs`)
or by tools it must call (`tool_choice` `required` or a named function). `compile_grammar` turns
either into an llguidance grammar, checked against the model's tokenizer; `check` is the same
at a server's door, so a grammar that cannot compile is a 400 before the request is queued.
`GrammarMatcher` follows one request's output token by token and says, before each step, which
tokens may come next (llguidance's bitmask, one bit per vocabulary entry).

Why llguidance: a 3 MB abi3 wheel with no dependencies that reads `tokenizer.json` itself, whose
masks take a small fraction of a decode step (docs/serving.md, "What a grammar costs under load",
has the figures); llama.cpp and vLLM use it. xgrammar, vLLM's default, imports transformers
and pulls in triton.

The end of turn is given to llguidance explicitly (the tokenizer's `eos_ids`): it does not
recognise `<|im_end|>` as the end by itself. Once the grammar is done, the mask allows only it.
"""

from __future__ import annotations

import json
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from minengine.errors import RequestError
from minengine.text.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

if TYPE_CHECKING:
    from minengine.engine.request import GenerationRequest
    from minengine.sampling.structured import StructuredOutput
    from minengine.text.tokenizer import ModelTokenizer
    from minengine.text.tools import Tool

# Compact but readable JSON, as most models write it (`{"a": 1, "b": [2, 3]}`), with no free
# whitespace: a small model offered spaces and newlines between tokens fills them.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'
_SHOWN_CHARS = 24  # forced text shown in a grammar's state, at most
FEW_WORDS = 32  # 64-bit bitmask words holding every allowed id, at most, for `GrammarMatcher.masked`'s sparse copy

_tokenizers: weakref.WeakKeyDictionary[ModelTokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


@dataclass(frozen=True)
class Grammar:
    """A request's compiled grammar: llguidance's text for it, and what it constrains, in a few words."""

    text: str
    describe: str  # `json_schema "hotel"`, `regex`, `tool call (required)`, ...


def ll_tokenizer(tokenizer: ModelTokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, made once per tokenizer (its first use pays for it).

    Built from the tokenizer's own JSON, as llguidance's `hf.from_tokenizer` does, with the end of
    turn given as the tokenizer's `eos_ids`.
    """
    with _tokenizers_lock:
        found = _tokenizers.get(tokenizer)
        if found is None:
            found = llguidance.LLTokenizer(tokenizer.tok.to_str(), eos_token=sorted(tokenizer.eos_ids))
            _tokenizers[tokenizer] = found
        return found


def needs_grammar(request: GenerationRequest) -> bool:
    """Whether the request's output is constrained: structured output, or a tool it must call."""
    return request.structured is not None or (bool(request.tools) and request.tool_choice.forced)


def compile_grammar(request: GenerationRequest, tokenizer: ModelTokenizer) -> Grammar | None:
    """The grammar `request` decodes under, checked against `tokenizer`; None when it has none.

    Raises RequestError, one line starting with the field to fix (`response_format`,
    `structured_outputs.regex`, `tools[1].function.parameters`, `tool_choice`), when it cannot compile.
    """
    if request.structured is not None:
        grammar, field = _structured(request.structured)
    elif request.tools and request.tool_choice.forced:
        grammar, field = _tool_calls(request, tokenizer)
    else:
        return None
    _validate(grammar.text, field, tokenizer)
    return grammar


def check(request: GenerationRequest, tokenizer: ModelTokenizer) -> None:
    """A server's check at the door: raise RequestError (naming the field) when the request's
    grammar does not compile; nothing is run. A few milliseconds for a nested schema."""
    compile_grammar(request, tokenizer)


def _validate(text: str, field: str, tokenizer: ModelTokenizer) -> None:
    error = llguidance.LLMatcher.validate_grammar(text, ll_tokenizer(tokenizer))
    if error:
        raise RequestError(f"{field} does not compile: {_one_line(error)}")


def _one_line(error: str) -> str:
    """llguidance's message, first line only (the rest points into the grammar text)."""
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return first[:300]


def _structured(structured: StructuredOutput) -> tuple[Grammar, str]:
    """The grammar of `structured`, and the request field its errors name."""
    kind, from_, what = structured.kind, llguidance.LLMatcher, structured.describe()
    if kind == "json_object":
        return Grammar(from_.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS), what), "response_format"
    if kind == "json_schema":
        field = "response_format.json_schema.schema"
        _json_object(structured.spec, field)
        return Grammar(from_.grammar_from_json_schema(structured.spec, defaults=JSON_OPTIONS), what), field
    if kind == "regex":
        return Grammar(from_.grammar_from_regex(structured.spec), what), "structured_outputs.regex"
    if kind == "choice":
        if not structured.choices:
            raise RequestError("structured_outputs.choice is empty; give at least one answer")
        lark = "start: " + " | ".join(json.dumps(choice) for choice in structured.choices)
        return Grammar(from_.grammar_from_lark(lark), what), "structured_outputs.choice"
    if kind == "grammar":
        field = "structured_outputs.grammar"
        try:
            lark = any_to_lark(structured.spec)  # GBNF (llama.cpp's `::=` rules) becomes Lark; Lark stays
        except Exception as exc:  # the converter raises plain exceptions on GBNF it cannot read
            raise RequestError(f"{field} is neither Lark nor GBNF that converts: {_one_line(str(exc))}") from None
        return Grammar(from_.grammar_from_lark(lark), what), field
    raise RequestError(
        f"structured output kind {kind!r} is unknown; use json_object, json_schema, regex, choice or grammar"
    )


def _json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RequestError(f"{field} must be a JSON object (a JSON schema); got {type(value).__name__}")
    return value


def _tool_calls(request: GenerationRequest, tokenizer: ModelTokenizer) -> tuple[Grammar, str]:
    """The Hermes form, one call (or, for `required` with parallel calls, several), then end of turn:
    `<tool_call>\\n{"name": "<name>", "arguments": <its parameters>}\\n</tool_call>`."""
    choice, tools = request.tool_choice, request.tools
    if choice.mode == "function":
        named = [i for i, tool in enumerate(tools) if tool.name == choice.function]
        if not named:
            known = ", ".join(repr(tool.name) for tool in tools)
            raise RequestError(
                f"tool_choice names function {choice.function!r}, which is not among the tools ({known})"
            )
        chosen = named[:1]
    else:
        chosen = list(range(len(tools)))
    bodies = []
    for i in chosen:
        body = _call_schema(tools[i], f"tools[{i}].function.parameters")
        _validate(
            llguidance.LLMatcher.grammar_from_json_schema(body, defaults=JSON_OPTIONS),
            f"tools[{i}].function.parameters",
            tokenizer,
        )
        bodies.append(f"body_{i}: %json {body}")
    open_, close = _literal(TOOL_CALL_OPEN, tokenizer), _literal(TOOL_CALL_CLOSE, tokenizer)
    several = choice.mode == "required" and request.parallel_tool_calls
    lark = "\n".join(
        [
            'start: call ("\\n" call)*' if several else "start: call",
            f'call: {open_} "\\n" body "\\n" {close}',
            "body: " + " | ".join(f"body_{i}" for i in chosen),
            *bodies,
        ]
    )
    what = f"tool call ({choice.function})" if choice.mode == "function" else "tool call (required)"
    return Grammar(llguidance.LLMatcher.grammar_from_lark(lark), what), "tools"


def _call_schema(tool: Tool, field: str) -> str:
    """The JSON schema of one call's object: `name` this tool's, `arguments` its parameters; the
    key order and separators llguidance writes are the Hermes form's."""
    parameters = dict(_json_object(tool.parameters, field))
    body = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
    }
    # Definitions move to the root with the parameters nested below it, where `#/$defs/...` finds them.
    for key in ("$defs", "definitions"):
        if key in parameters:
            body[key] = parameters.pop(key)
    return json.dumps(body)


def _literal(text: str, tokenizer: ModelTokenizer) -> str:
    """`text` in a Lark rule: the special token of that name where the tokenizer has one (Qwen's
    `<tool_call>`; a quoted string would never match it), else the quoted text."""
    token_id = tokenizer.tok.token_to_id(text)
    if token_id is not None and token_id in tokenizer.special_ids:
        return text
    return json.dumps(text)


class GrammarMatcher:
    """One request's place in its grammar: which tokens may come next, and each token it took.

    A session's consumer (the explorer's, a steered request's) has its next mask computed while the
    model runs that step: `accept` (and the start) hand llguidance's mask to a worker thread, and the
    step's sampling waits for it. llguidance's Rust releases the GIL for it, and the worker makes no
    torch call (a torch parallel region would give it an OpenMP team of its own: `threads.ModelThread`
    says why that throttles every step). A step loop that chooses its rows' tokens itself
    (`engine.run_ahead`) turns the worker off (`fill_in_step`) and fills the masks of all its
    constrained rows on the model thread, right after the forward (`run_ahead.prepare_choices`):
    beside the forward's OpenMP threads on two cores the worker took a core from them, and each
    mask took several times as long there (docs/lab/structured-output-cost.md). `overlap=False`
    computes the mask when it is asked for.
    """

    def __init__(self, grammar: Grammar, tokenizer: ModelTokenizer, *, overlap: bool = True) -> None:
        self.grammar = grammar
        self.tokenizer = ll_tokenizer(tokenizer)
        self.end_ids = tuple(sorted(tokenizer.eos_ids))
        # Silent: a forbidden token is refused by the engine with its own message, not on stderr (a TUI's screen).
        self.matcher = llguidance.LLMatcher(self.tokenizer, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise RequestError(f"the grammar does not compile: {_one_line(self.matcher.get_error())}")
        self.overlap = overlap
        # llguidance's bitmask (32-bit words), padded to whole 64-bit words for `_few_allowed`'s look.
        self._mask_bytes = (self.tokenizer.vocab_size + 31) // 32 * 4
        self._bitmask = np.zeros((self.tokenizer.vocab_size + 63) // 64 * 2, dtype=np.int32)
        self._filled = False  # `_bitmask` holds this step's mask
        self._pending: Future[None] | None = None  # the next mask, being computed
        self._allowed: torch.Tensor | None = None  # this step's, over the tokenizer's vocabulary
        self._ahead()

    def _fill(self) -> None:
        # What `llguidance.torch.fill_next_token_bitmask` calls (importing that module costs 2.4 s of
        # torch.compile set-up for a kernel not used here).
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._mask_bytes)
        self._filled = True

    def _ahead(self) -> None:
        if self.overlap and not self.matcher.is_error():
            self._pending = _mask_worker().submit(self._fill)

    def _settle(self) -> None:
        """Wait for a mask being computed: the matcher is not to be touched meanwhile."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def fill_in_step(self) -> None:
        """From now on the next mask is computed when the step asks for it (`fill`, or the first
        use), not on the worker thread."""
        self._settle()
        self.overlap = False

    def fill(self) -> None:
        """Compute this step's mask now, on this thread, unless it is already computed (or being:
        then wait for it). A matcher in error has none: only the end of turn may follow."""
        self._settle()
        if not self._filled and not self.matcher.is_error():
            self._fill()

    def allowed(self) -> torch.Tensor:
        """This step's mask: a bool per token of the tokenizer's vocabulary (computed once per step)."""
        if self._allowed is None:
            self.fill()
            if self.matcher.is_error():  # nothing valid can follow: end the turn
                allowed = torch.zeros(self.tokenizer.vocab_size, dtype=torch.bool)
                allowed[list(self.end_ids)] = True
            else:
                # Bit b of word w is token 32w + b: little-endian bytes, each unpacked low bit first.
                bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.tokenizer.vocab_size]
                allowed = torch.from_numpy(bits.view(np.bool_))
            self._allowed = allowed
        return self._allowed

    def _few_allowed(self) -> np.ndarray | None:
        """The ids this step allows, ascending, when they lie in at most `FEW_WORDS` 64-bit words
        of the bitmask (a JSON schema's steps mostly allow a token or a handful); None when more do."""
        if self.matcher.is_error():
            return np.array(self.end_ids, dtype=np.int64)
        words = self._bitmask.view(np.uint64)
        if np.count_nonzero(words) > FEW_WORDS:
            return None
        nonzero = np.flatnonzero(words)
        # Bit b of word w is token 64w + b: little-endian bytes, each unpacked low bit first.
        bits = np.flatnonzero(np.unpackbits(words[nonzero].view(np.uint8), bitorder="little"))
        ids = nonzero[bits >> 6] * 64 + (bits & 63)
        if ids.size and ids[-1] >= self.tokenizer.vocab_size:
            ids = ids[ids < self.tokenizer.vocab_size]
        return ids

    def masked(self, row: torch.Tensor) -> torch.Tensor:
        """A copy of `row` (one step's logits) with the tokens the grammar forbids at -inf; entries
        past the tokenizer's vocabulary (a padded head) are never allowed.

        Where the allowed ids are few, the copy is -inf with only them copied over; else each entry
        is chosen by the mask in one pass (`torch.where`). Both cost a fraction of a masked_fill over
        the row (docs/lab/structured-output-cost.md), and both are held against it by the tests."""
        self.fill()
        few = self._few_allowed()
        if few is not None:
            if few.size and few[-1] >= row.numel():
                few = few[few < row.numel()]
            ids = torch.from_numpy(few).to(row.device)
            return torch.full_like(row, float("-inf")).index_copy_(0, ids, row.index_select(0, ids))
        allowed = self.allowed()
        n = min(row.numel(), allowed.numel())
        out = torch.where(allowed[:n].to(row.device), row[:n], float("-inf"))
        if row.numel() > n:
            out = torch.cat((out, torch.full_like(row[n:], float("-inf"))))
        return out

    def allows(self, token: int) -> bool:
        """Whether the grammar lets `token` come next."""
        allowed = self.allowed()
        return 0 <= token < allowed.numel() and bool(allowed[token])

    def accept(self, token: int) -> None:
        """Advance past `token`, the one committed, and start on the next step's mask."""
        self._settle()
        self.matcher.consume_token(token)  # on a forbidden token it errs and stays so: only the end follows
        self._filled = False
        self._allowed = None
        self._ahead()

    def replay(self, tokens: list[int]) -> int:
        """Feed `tokens` (a request's output so far, in order) to a matcher at its start; how many
        it took: `len(tokens)` when they all fit, else the index of the first that does not (the
        matcher then stands after the ones it took, to be thrown away)."""
        self._settle()
        taken = self.matcher.try_consume_tokens(list(tokens)) if tokens else 0
        self._filled = False
        self._allowed = None
        self._ahead()
        return taken

    @property
    def done(self) -> bool:
        """Whether nothing but the end of turn may follow."""
        self._settle()
        return self.matcher.is_stopped() or self.matcher.is_error()

    def state(self) -> str:
        """Where the grammar is, in a few words."""
        self._settle()
        if self.matcher.is_error():
            return f"error: {_one_line(self.matcher.get_error())}"
        if self.matcher.is_stopped():
            return "done: only end of turn"
        forced = self.matcher.compute_ff_bytes().decode("utf-8", errors="replace")
        if forced:
            shown = forced if len(forced) <= _SHOWN_CHARS else forced[:_SHOWN_CHARS] + "…"
            return f"forces {json.dumps(shown, ensure_ascii=False)} next"
        if self.matcher.is_accepting():
            return "complete: may end or go on"
        return f"free: {int(self.allowed().sum())} tokens allowed"


_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _mask_worker() -> ThreadPoolExecutor:
    """The one thread every request's next mask is computed on (made on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return _worker
