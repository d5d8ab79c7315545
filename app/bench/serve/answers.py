"""Every finished answer of a structured-output run, checked: does its text follow the format it was asked for?

vLLM's `bench serve` checks nothing of what comes back, and its repository's structured-output
script only tries `json.loads`. Here a `json_schema` answer must parse and validate against the
schema (`jsonschema`, the schema's own draft), and a `json_object` answer must parse as a JSON
object. An answer that ended at `max_tokens` (`finish_reason: "length"`) is counted apart, as cut
by length: a grammar holds the text to the schema's prefix, so it cannot be whole JSON, and
counting it as invalid would blame the server for the client's token limit. Failed requests have
no answer and are not counted here. The check runs after the load, never while requests are timed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from minengine.sampling.structured import StructuredOutput
from reqscope.bench.serve.stream import RequestOutcome

Verdict = Literal["valid", "invalid", "cut by length"]
_SHOWN_CHARS = 80  # of an answer's text, in the problem line


@dataclass(frozen=True)
class AnswerCheck:
    """What the check found for one answer; `problem` says why when it is invalid."""

    verdict: Verdict
    problem: str = ""


@dataclass(frozen=True)
class AnswerTally:
    """The checks of one run, in prompt order (None where the request failed), and their counts."""

    checks: tuple[AnswerCheck | None, ...]

    def count(self, verdict: Verdict) -> int:
        """How many answers got `verdict`."""
        return sum(1 for c in self.checks if c is not None and c.verdict == verdict)

    @property
    def valid(self) -> int:
        """Answers that follow the format."""
        return self.count("valid")

    @property
    def validated(self) -> int:
        """Answers that ended on their own, so could be checked: the valid and the invalid."""
        return self.valid + self.count("invalid")

    @property
    def cut_by_length(self) -> int:
        """Answers that reached max_tokens first."""
        return self.count("cut by length")

    @property
    def share(self) -> float | None:
        """valid / validated; None when no answer ended on its own."""
        return self.valid / self.validated if self.validated else None

    @property
    def first_problem(self) -> str | None:
        """Why the first invalid answer is invalid."""
        return next((c.problem for c in self.checks if c is not None and c.verdict == "invalid"), None)


def answer_checker(structured: StructuredOutput) -> Callable[[str, str | None], AnswerCheck]:
    """A check of (text, finish_reason) against `structured`, its validator built once for the whole run."""
    if structured.kind == "json_schema":
        # Imported here, not at the top: only a run with --json-schema validates, and the other verbs
        # that import this package should not pay for loading jsonschema.
        import jsonschema

        schema = json.loads(structured.spec)
        validator = jsonschema.validators.validator_for(schema)(schema)

        def schema_problem(value: object) -> str | None:
            error = jsonschema.exceptions.best_match(validator.iter_errors(value))
            return None if error is None else f"{error.json_path}: {error.message}"

    elif structured.kind == "json_object":

        def schema_problem(value: object) -> str | None:
            return None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"

    else:
        raise ValueError(f"bench serve checks json_object or json_schema answers, not {structured.kind}")

    def check(text: str, finish_reason: str | None) -> AnswerCheck:
        if finish_reason == "length":
            return AnswerCheck("cut by length")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return AnswerCheck("invalid", f"not JSON ({exc.msg} at char {exc.pos}): {_shown(text)}")
        problem = schema_problem(value)
        return AnswerCheck("valid") if problem is None else AnswerCheck("invalid", problem)

    return check


def tally_answers(outcomes: Sequence[RequestOutcome], structured: StructuredOutput) -> AnswerTally:
    """Check the answer of every successful request of a run."""
    check = answer_checker(structured)
    return AnswerTally(tuple(check(o.text or "", o.finish_reason) if o.ok else None for o in outcomes))


def _shown(text: str) -> str:
    shown = json.dumps(text[:_SHOWN_CHARS], ensure_ascii=False)
    return shown + (" ..." if len(text) > _SHOWN_CHARS else "")
