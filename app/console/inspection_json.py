"""A token record's inspection keys for --json: the step's attention, its logit lens, their cost.

Opt-in (`--attention TOP_N`, `--lens`): a record carries them only for steps that captured
them. Positions and weights are written as [position, weight] pairs, weights and probabilities
to 5 decimals, so a step's attention over 30 layers stays one readable line.
"""

from __future__ import annotations

from minengine.inspect.records import Attended, StepAttention, StepInspection, StepLens

_DIGITS = 5


def inspection_keys(inspection: StepInspection | None) -> dict:
    """The keys a token record gains: none when its step was not inspected."""
    if inspection is None:
        return {}
    cost = inspection.cost
    keys: dict = {
        "inspect_cost": {
            "cost_ms": round(cost.cost_ms, 3),
            "step_ms": round(cost.step_ms, 3),
            "plain_step_ms": None if cost.plain_step_ms is None else round(cost.plain_step_ms, 3),
            "work_ms": round(cost.work_ms, 3),
        }
    }
    if inspection.attention is not None:
        keys["attention"] = attention_json(inspection.attention)
    if inspection.lens is not None:
        keys["lens"] = lens_json(inspection.lens)
    return keys


def attention_json(a: StepAttention) -> dict:
    """Every layer's heads: the KV head each reads, entropy (nats), top positions; the heads' mean."""
    layers = []
    for layer in a.layers:
        record = {
            "layer": layer.layer,
            "mean_entropy": round(layer.mean_entropy, _DIGITS),
            "mean_top": _pairs(layer.mean_top),
            "heads": [
                {"head": h.head, "kv_head": h.kv_head, "entropy": round(h.entropy, _DIGITS), "top": _pairs(h.top)}
                for h in layer.heads
            ],
        }
        if layer.strip is not None:
            weights = [round(w, _DIGITS) for w in layer.strip.weights]
            record["strip"] = {"bucket": layer.strip.bucket, "weights": weights}
        layers.append(record)
    return {
        "query_position": a.query_position,
        "context": a.context,
        "layout": a.layout,
        "q_heads": a.q_heads,
        "kv_heads": a.kv_heads,
        "layers": layers,
    }


def lens_json(lens: StepLens) -> dict:
    """Each layer's top guess and the chosen token's rank and probability, on the record's basis."""
    return {
        "chosen": lens.chosen,
        "chosen_piece": lens.chosen_piece,
        "basis": lens.basis,
        "candidates": lens.candidates,
        "forms_at": lens.forms_at,
        "layers": [
            {
                "layer": x.layer,
                "top_token": x.top_token,
                "top_piece": x.top_piece,
                "top_prob": round(x.top_prob, _DIGITS),
                "chosen_rank": x.chosen_rank,
                "chosen_prob": round(x.chosen_prob, _DIGITS),
            }
            for x in lens.layers
        ],
    }


def _pairs(top: tuple[Attended, ...]) -> list[list]:
    return [[a.position, round(a.weight, _DIGITS)] for a in top]
