"""The live run on screen: the engine's run, and what the UI thread knows of it.

`LiveRun` is shared with the worker thread; this is the screen's side of it. The worker may
hold at a step before the screen has taken the events that lead there, so the step shown held
is the screen's own (`follow`). Beside it: the settings the session was last told to use (the
sampling parameters, the grammar on or off), and the held step previewed under the settings
shown (cached: a preview filters every logit).
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.sampling.params import SamplingParams
from reqscope.ui.run.frame import StepSubject
from reqscope.ui.run.inside.shown import ShownInspection, held_inspection
from reqscope.ui.run.live import LiveRun
from reqscope.ui.run.step_subject import held_subject
from reqscope.ui.run.view import RunView


@dataclass
class RunOnScreen:
    """One live run as the screen shows it; every run gets a new one."""

    run: LiveRun
    applied: SamplingParams  # what the session was last told to use
    grammar: bool = True  # whether the session was last told to mask by the request's grammar
    held: int | None = None  # the step the run holds at, as the screen shows it
    held_path: str = ""  # the way the held step ran (`minengine.steps.step_path`)
    failure_shown: bool = False  # the worker's failure has been notified
    full_view_shown: tuple[int, object] | None = None  # the held step's full view last drawn
    _preview: tuple[tuple[int, SamplingParams, bool], StepSubject | None] | None = None

    def follow(self, view: RunView) -> bool:
        """Take the step the run holds at once `view` shows it waiting; True when that changed."""
        held = self.run.held_at if view.waiting_step is not None else None
        changed, self.held = held != self.held, held
        self.held_path = view.waiting_path
        return changed

    def subject(self, params: SamplingParams) -> StepSubject | None:
        """The held step previewed under `params`; None while the run is not held."""
        if self.held is None:
            return None
        key = (self.held, params, self.grammar)  # the grammar switched changes the step's row
        if self._preview is None or self._preview[0] != key:
            self._preview = (key, held_subject(self.run, self.held, params, self.held_path))
        return self._preview[1]

    def inspection(self) -> ShownInspection | None:
        """The held step's full view, once the worker has computed it; None while the run is not held."""
        view = self.run.held_view
        if self.held is None or view is None or view[0] != self.held:
            return None
        return held_inspection(view[1], self.held)

    def full_view_arrived(self) -> bool:
        """True once per full view the worker computed: the screen should draw it."""
        view = self.run.held_view
        if view is None or view == self.full_view_shown:
            return False
        self.full_view_shown = view
        return True

    def toggle(self) -> None:
        """Run freely, or pause at the next step."""
        if self.run.pausing:
            self.run.resume()
        else:
            self.run.pause()

    def step(self) -> None:
        """Commit the held step's token and hold at the next one (running: hold at the next step)."""
        if self.held is not None:
            self.held = None
            self.run.step()
        else:
            self.run.pause()

    def pick(self, token_id: int) -> None:
        """Commit `token_id` at the held step and hold at the next one; ReqscopeError when it is refused."""
        self.run.force_next(token_id)
        self.held = None
        self.run.step()

    def apply(self, params: SamplingParams) -> None:
        """Use `params` from the held step on; RequestError when the session refuses them."""
        self.run.update_sampling(params)
        self.applied = params

    def set_grammar(self, on: bool) -> None:
        """Turn the request's grammar off or on from the held step on; RequestError when refused."""
        self.run.set_grammar(on)
        self.grammar = on
