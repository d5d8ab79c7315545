"""Reading a few named samples out of a server's `/metrics` page (Prometheus' text format).

A vLLM page runs to thousands of lines, most of them histogram buckets. The client reads it
on the thread that stamps the streamed chunks, so parsing all of it would delay those stamps:
lines are first kept by name (a prefix test per line), and only those go through
prometheus_client's parser, which handles labels, escapes and number formats as the format says.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families


def read_metrics(text: str, names: Iterable[str]) -> dict[str, float]:
    """The value of each sample named in `names`, summed over its label sets (a server with
    several engines or models reports one series each); a name absent from `text` is absent."""
    wanted = set(names)
    kept = [line for line in text.splitlines() if line and not line.startswith("#") and _name(line) in wanted]
    values: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(kept) + "\n"):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _name(line: str) -> str:
    end = len(line)
    for mark in ("{", " "):
        at = line.find(mark)
        if at != -1:
            end = min(end, at)
    return line[:end]
