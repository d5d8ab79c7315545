"""The README's 5-minute tour names only keys the explorer binds and panels it draws.

The tour is read from README.md itself: each key in its key table must be bound by the live
explorer (`LiveExplorer.BINDINGS`) to an action the app has, and each panel it names in quotes
must be a panel's title.
"""

from __future__ import annotations

import re
from pathlib import Path

from reqscope.ui import keys as ui_keys
from reqscope.ui.panel import Panel
from reqscope.ui.run.live_app import LiveExplorer

README = Path(__file__).resolve().parents[2] / "README.md"
HEADING = "## A 5-minute tour"
# The README spells keys as a person types them (`Key.display`); the bindings use Textual's names.
TYPED = {"space": "space", "↑": "up", "↓": "down", "←": "left", "→": "right", "enter": "enter", "?": "question_mark",
         "[": "left_square_bracket", "]": "right_square_bracket", "{": "left_curly_bracket",
         "}": "right_curly_bracket"}  # fmt: skip


def tour() -> str:
    """The tour section of README.md, up to the next heading of its level."""
    text = README.read_text(encoding="utf-8")
    assert HEADING in text, f"README.md has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1]
    return section.split("\n## ", 1)[0]


def tour_keys(section: str) -> list[str]:
    """The keys in the first column of the tour's key table, as Textual names them."""
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    typed = [key for row in rows for key in re.findall(r"`([^`]+)`", row.split("|")[1])]
    return [TYPED.get(key, key) for key in typed]


def _bound() -> dict[str, str]:
    """Every key the live explorer binds, and the action it runs."""
    return {key.strip(): binding.action for binding in LiveExplorer.BINDINGS for key in binding.key.split(",")}


def _panel_titles() -> set[str]:
    found, todo = set(), [Panel]
    while todo:
        cls = todo.pop()
        found |= {cls.TITLE} - {""}
        todo += cls.__subclasses__()
    return found


def test_every_key_in_the_tour_is_bound_by_the_explorer():
    keys = tour_keys(tour())
    assert len(keys) >= 10 and {"space", "s", "o", "question_mark", "q"} <= set(keys)
    bound = _bound()
    missing = [key for key in keys if key not in bound]
    assert not missing, f"the tour names keys the explorer does not bind: {missing}"
    actions = {bound[key].split("(")[0] for key in keys}
    assert all(callable(getattr(LiveExplorer, f"action_{action}", None)) for action in actions), actions


def test_every_panel_the_tour_names_is_drawn():
    import importlib
    import pkgutil

    import reqscope.ui.run.panels as panels

    for module in pkgutil.iter_modules(panels.__path__):
        importlib.import_module(f"{panels.__name__}.{module.name}")
    named = re.findall(r'\*\*"([^"]+)"\*\*', tour())
    assert len(named) >= 5
    titles = _panel_titles()
    assert not [name for name in named if name not in titles], (named, sorted(titles))


def test_the_check_catches_a_key_that_is_not_bound():
    section = "| key | what |\n| --- | --- |\n| `space` | run |\n| `z` `↑` | nothing |\n"
    assert tour_keys(section) == ["space", "z", "up"]
    assert "z" not in _bound() and "up" in _bound()
    assert {k.display for k in ui_keys.KEYS if "up" in k.keys.split(",")} == {"↑ / k"}
