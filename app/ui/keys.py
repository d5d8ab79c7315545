"""Every key of the explorer in one table: bindings, the footer, the help screen and the palette."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding

LIVE = "live"
REPLAY = "replay"
ENDPOINT = "endpoint"  # the endpoint explorer (`--base-url URL`): its own app, keys and panels
BOTH = frozenset({LIVE, REPLAY})
LIVE_ONLY = frozenset({LIVE})
REPLAY_ONLY = frozenset({REPLAY})
ENDPOINT_ONLY = frozenset({ENDPOINT})
LIVE_AND_ENDPOINT = frozenset({LIVE, ENDPOINT})
EVERY = frozenset({LIVE, REPLAY, ENDPOINT})


@dataclass(frozen=True)
class Key:
    """One action and the keys that trigger it."""

    keys: str  # comma-separated Textual key names
    action: str
    label: str  # short, for the footer
    help: str  # one sentence, for the help screen and the command palette
    modes: frozenset[str] = BOTH
    footer: bool = True
    # The optional panel (`ExplorerBase.OPTIONAL_VIEWS`) the key shows: it is bound always, and
    # listed (help, palette) only while that panel applies. "" for every other key.
    panel: str = ""

    @property
    def display(self) -> str:
        """The keys as a person would type them."""
        names = {"space": "space", "question_mark": "?", "enter": "enter", "up": "↑", "down": "↓",
                 "left": "←", "right": "→", "home": "home", "end": "end", "left_square_bracket": "[",
                 "right_square_bracket": "]", "left_curly_bracket": "{", "right_curly_bracket": "}"}
        return " / ".join(names.get(k, k) for k in self.keys.split(","))


KEYS: tuple[Key, ...] = (
    Key("space", "toggle_run", "Run", "Run decode freely, or pause at the next step (replay: play or stop)"),
    Key("s,right", "step", "Step", "Decode one token and hold at the next step (replay: one step forward)"),
    Key("b,left", "step_back", "Back", "Replay: one step back", REPLAY_ONLY),
    Key("home", "first_step", "First", "Replay: back to the first step", REPLAY_ONLY, footer=False),
    Key("end", "last_step", "Last", "Replay: jump to the end", REPLAY_ONLY, footer=False),
    Key("o", "sampling", "Sample", "Change temperature, top-k, top-p, min-p, the penalties, logit bias, seed, max "
        "tokens or sampler order; turn the grammar (schema or tool call) off or on at the held step, the tools for "
        "the next run"),
    Key("up,k", "cursor(-1)", "Up", "Move the candidate cursor up", footer=False),
    Key("down,j", "cursor(1)", "Down", "Move the candidate cursor down", footer=False),
    Key("enter", "pick", "Pick", "Commit the highlighted candidate as the next token (while paused; one the "
        "grammar forbids is refused, with the reason)", LIVE_ONLY),
    Key("o", "sampling", "Sample", "Change sampling (blank = server default) or logprobs for the next request",
        ENDPOINT_ONLY),
    Key("up,k", "cursor(-1)", "Up", "Show an earlier chunk's logprobs", ENDPOINT_ONLY, footer=False),
    Key("down,j", "cursor(1)", "Down", "Show a later chunk's logprobs (the last one: follow the newest)",
        ENDPOINT_ONLY, footer=False),
    Key("c", "cancel", "Cancel", "Cancel the request (it stops before the next model step)", LIVE_ONLY, footer=False),
    Key("c", "cancel", "Cancel", "Cancel the request: close the stream (a server that notices stops decoding)",
        ENDPOINT_ONLY),
    Key("r", "restart", "Restart", "Run the same prompt again with the current settings", LIVE_AND_ENDPOINT,
        footer=False),
    Key("e", "edit_prompt", "Prompt", "Edit the prompt (and the system prompt), then run again", LIVE_AND_ENDPOINT),
    Key("p", "edit_system", "System", "Edit the system prompt (and the prompt), then run again", LIVE_AND_ENDPOINT,
        footer=False),
    Key("m", "switch_layout", "GQA/MHA", "Re-run this request with the other KV cache layout (gqa or mha)", LIVE_ONLY),
    Key("w", "compare_weights", "Formats", "Run the finished request in the next weight format beside its own: "
        "tok/s, TTFT, bytes per step, top-1 agreement and KL per step", LIVE_ONLY, footer=False),
    Key("x", "export", "Export", "Export the finished run (timeline CSV, metrics, trace, Perfetto) to a new folder"),
    Key("x", "export", "Export", "Export the finished request (every client event and the server's view) to a new "
        "folder, for reqscope replay", ENDPOINT_ONLY),
    Key("v", "next_view", "View", "Show the next detail panel (small terminals)", EVERY),
    Key("1", "view('logits')", "Logits", "Show the logits panel (small terminals)", footer=False),
    Key("2", "view('kv')", "KV", "Show the KV cache panel (small terminals)", footer=False),
    Key("3", "view('layouts')", "GQA/MHA", "Show the GQA vs MHA panel (small terminals)", footer=False),
    Key("4", "view('latency')", "Latency", "Show the latency panel (small terminals)", footer=False),
    Key("5", "view('template')", "Template", "Show the rendered chat template (small terminals)", footer=False),
    Key("6", "view('batch')", "Batch", "Show the batch panel: the steps other requests share (small terminals)",
        footer=False, panel="batch"),
    Key("7", "view('attention')", "Attention", "Show the attention panel: where the step's query looked, per layer "
        "and head (small terminals)", footer=False, panel="attention"),
    Key("8", "view('lens')", "Lens", "Show the logit lens panel: what each layer would have predicted (small "
        "terminals)", footer=False, panel="lens"),
    Key("left_square_bracket", "focus_layer(-1)", "Layer -", "Attention and lens: the previous layer", footer=False,
        panel="attention"),
    Key("right_square_bracket", "focus_layer(1)", "Layer +", "Attention and lens: the next layer", footer=False,
        panel="attention"),
    Key("left_curly_bracket", "focus_head(-1)", "Head -", "Attention: the previous head (through the mean over "
        "the layer's heads)", footer=False, panel="attention"),
    Key("right_curly_bracket", "focus_head(1)", "Head +", "Attention: the next head (through the mean over the "
        "layer's heads)", footer=False, panel="attention"),
    Key("9", "view('formats')", "Formats", "Show the weight formats panel, once w has compared (small terminals)",
        LIVE_ONLY, footer=False, panel="formats"),
    Key("1", "view('logits')", "Logprobs", "Show the top logprobs panel (small terminals)", ENDPOINT_ONLY,
        footer=False),
    Key("2", "view('kv')", "KV", "Show the KV cache panel (small terminals)", ENDPOINT_ONLY, footer=False),
    Key("3", "view('latency')", "Latency", "Show the latency panel (small terminals)", ENDPOINT_ONLY, footer=False),
    Key("4", "view('timeline')", "Timeline", "Show the timeline panel (small terminals)", ENDPOINT_ONLY, footer=False),
    Key("5", "view('template')", "Template", "Show the template and tokens the server made of the messages (small "
        "terminals)", ENDPOINT_ONLY, footer=False),
    Key("6", "view('batch')", "Batch", "Show the server's batch around the request: its /metrics, poll by poll "
        "(small terminals)", ENDPOINT_ONLY, footer=False),
    Key("question_mark,f1", "help", "Help", "List every key", EVERY),
    Key("q", "quit", "Quit", "Leave the explorer (cancels a running request)", EVERY),
)


def bindings(*modes: str) -> list[Binding]:
    """Textual bindings for the keys of `modes` (the footer shows those marked `footer`)."""
    return [Binding(k.keys, k.action, k.label, show=k.footer) for k in KEYS if k.modes & set(modes)]


def keys_for(mode: str, panels: tuple[str, ...] = ()) -> list[Key]:
    """The keys that do something in `mode` ("live", "replay" or "endpoint"), with the optional `panels` on screen."""
    return [k for k in KEYS if mode in k.modes and (not k.panel or k.panel in panels)]


def action_name(key: Key) -> str:
    """The action's method name without its arguments."""
    return key.action.split("(")[0]
