"""Old flag names kept working for a release: `deprecated_alias` adds one beside the flag that replaced it.

An old name parses exactly as its new one does (same type, choices and destination: the same
value), is left out of `--help` and the usage line, and says once on stderr, when used,
`reqscope: --old is deprecated; use --new`. Every renamed flag of every verb goes through here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class DeprecatedAlias(argparse.Action):
    """An old option string that warns, then acts as `target` given as `target_option` would."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, target: argparse.Action, target_option: str):
        super().__init__(
            option_strings,
            dest,
            nargs=target.nargs,
            const=target.const,
            default=argparse.SUPPRESS,  # never sets a default over the new flag's
            type=target.type,
            choices=target.choices,
            help=argparse.SUPPRESS,  # out of --help and the usage line
            metavar=target.metavar,
        )
        self.target = target
        self.target_option = target_option
        self.warned = False

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: D102 - argparse API
        if not self.warned:  # a repeatable flag given twice under its old name warns once
            self.warned = True
            print(f"reqscope: {option_string} is deprecated; use {self.target_option}", file=sys.stderr)
        self.target(parser, namespace, values, self.target_option)


def deprecated_alias(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, old: str, new: str
) -> DeprecatedAlias:
    """Make `old` a deprecated name of the flag `new`, which `parser` (or its group) already has."""
    target = parser._option_string_actions.get(new)
    if target is None:
        raise ValueError(f"{new} is not a flag of this parser; add it before its alias {old}")
    return parser.add_argument(old, action=DeprecatedAlias, dest=target.dest, target=target, target_option=new)


def is_alias(action: argparse.Action) -> bool:
    """Whether `action` is an old name (code that lists a parser's flags skips these)."""
    return isinstance(action, DeprecatedAlias)
