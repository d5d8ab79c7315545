"""Which panels a terminal shows: all of them from 150x40 on, else the token panel and one detail panel.

Both explorers lay their panels out in `#body` (see explorer.tcss): a three-column grid when
wide, a stack with one detail panel (chosen with v or the number keys) when small.
"""

from __future__ import annotations

from collections.abc import Mapping

from textual.app import App
from textual.geometry import Size

from reqscope.ui.panel import Panel

WIDE_MIN = (150, 40)  # columns, rows from which every panel is shown at once


def mark_detail_panels(app: App, views: tuple[str, ...]) -> None:
    """Tag the panels that take turns on small terminals."""
    for name in views:
        app.query_one(f"#{name}").add_class("detail")


def fit_panels(
    app: App, size: Size, views: tuple[str, ...], shown: str, labels: Mapping[str, str] = {},
    numbers: Mapping[str, str] = {},
) -> bool:  # fmt: skip
    """Lay the panels out for `size`, `shown` being the detail panel on small terminals; True when wide.

    The hint numbers each panel by its place, or by `numbers` (a panel whose key is not its place)."""
    wide = size.width >= WIDE_MIN[0] and size.height >= WIDE_MIN[1]
    app.query_one("#body").set_class(wide, "-wide")
    keys = "  ".join(f"{numbers.get(name, i + 1)} {labels.get(name, name)}" for i, name in enumerate(views))
    for name in views:
        panel = app.query_one(f"#{name}", Panel)
        panel.set_class(name == shown, "-shown")
        panel.border_subtitle = "" if wide else f"v next · {keys}"
    return wide


def next_view(views: tuple[str, ...], shown: str) -> str:
    """The detail panel after `shown`, wrapping around."""
    return views[(views.index(shown) + 1) % len(views)]
