"""The base of each explorer's view of one request: the record its events fold into, one at a time.

The run explorer folds the engine's events (`reqscope.ui.run.view.RunView`), the endpoint
explorer the client's (`reqscope.ui.endpoint.view.EndpointView`); live runs and replays feed
the same fold, so a view rebuilt from a list of events is the one the live run drew.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, Self, TypeVar

EventT = TypeVar("EventT")


class RequestView(Generic[EventT]):
    """A record of one request that events are folded into; a subclass says how (`apply`)."""

    def apply(self, event: EventT) -> None:
        """Fold one event in."""
        raise NotImplementedError

    @classmethod
    def of(cls, events: Iterable[EventT]) -> Self:
        """The view after `events`, in order."""
        view = cls()
        for event in events:
            view.apply(event)
        return view
