"""The layer and head the attention detail shows, moved by the explorer's keys; the lens follows the layer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionFocus:
    """The chosen layer (None until one is chosen: the attention detail shows layer 0, the lens the
    layers round where the answer forms), and the chosen query head or None for the mean over the
    layer's heads."""

    layer: int | None = None
    head: int | None = None

    @property
    def shown_layer(self) -> int:
        """The layer the attention detail shows."""
        return self.layer or 0

    def clamped(self, layers: int, heads: int) -> AttentionFocus:
        """Within a model of `layers` layers and `heads` query heads."""
        head = None if self.head is None else min(max(self.head, 0), max(heads - 1, 0))
        layer = None if self.layer is None else min(max(self.layer, 0), max(layers - 1, 0))
        return AttentionFocus(layer, head)

    def moved_layer(self, delta: int, layers: int) -> AttentionFocus:
        """`delta` layers on, wrapping round (from none chosen: from layer 0)."""
        return AttentionFocus((self.shown_layer + delta) % max(layers, 1), self.head)

    def moved_head(self, delta: int, heads: int) -> AttentionFocus:
        """`delta` heads on through the cycle mean, head 0, ..., head heads-1, mean."""
        cycle = [None, *range(heads)]
        at = cycle.index(self.head) if self.head in cycle else 0
        return AttentionFocus(self.layer, cycle[(at + delta) % len(cycle)])


def window_start(at: int, count: int, room: int) -> int:
    """The first of `room` rows (of `count`) to show so that row `at`, the focus, is among them."""
    if count <= room:
        return 0
    return min(max(at - room // 2, 0), count - room)
