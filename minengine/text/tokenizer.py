"""The model's tokenizer and chat template, as a model folder defines them.

`tokenizer.json` is loaded with the `tokenizers` library; the chat template and special
tokens come from `tokenizer_config.json` (or `chat_template.jinja`), the end-of-sequence ids
from `generation_config.json`, `config.json` and the tokenizer's own eos token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from minengine.errors import TokenizerError
from minengine.text.chat_template import Message, fixed_generation_prompt, render_chat
from minengine.text.tool_prompt import ChatInput, chat_input
from minengine.text.tools import Tool


@dataclass(frozen=True)
class TokenPiece:
    """One prompt token: id, the text it stands for, and whether it is a special token."""

    token_id: int
    text: str
    special: bool
    start: int  # character offsets into the rendered prompt
    end: int


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class ModelTokenizer:
    """Encode, decode and template for one model folder.

    `chat_template_file` (`--chat-template FILE`, as vLLM and llama-server take it) replaces the
    folder's chat template; `use_chat_template_file` does the same on a built tokenizer.
    """

    def __init__(self, folder: Path, chat_template_file: Path | None = None) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {folder}; the model folder is incomplete")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"cannot load {path}: {exc}") from None
        tcfg = _read_json(folder / "tokenizer_config.json")
        self.chat_template = self._find_template(folder, tcfg)
        # Named in every template error, so the user knows which file to fix.
        jinja_file = folder / "chat_template.jinja"
        self.template_origin = jinja_file if jinja_file.is_file() else folder / "tokenizer_config.json"
        self.special_tokens = {
            key: text
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _token_text(tcfg.get(key))) is not None
        }
        self.special_ids = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
        self.eos_ids = frozenset(self._eos_ids(folder, tcfg))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._pieces: dict[int, str] = {}
        if chat_template_file is not None:
            self.use_chat_template_file(chat_template_file)

    def use_chat_template_file(self, path: Path) -> None:
        """Render with the template in `path` (a Jinja file) instead of the model folder's."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"cannot read the chat template {path}: {exc}; give a readable Jinja file") from None
        if not text.strip():
            raise TokenizerError(f"the chat template {path} is empty; give a Jinja chat template file")
        self.chat_template = text
        self.template_origin = path

    @staticmethod
    def _find_template(folder: Path, tcfg: dict[str, Any]) -> str | None:
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return template if isinstance(template, str) else None

    def _eos_ids(self, folder: Path, tcfg: dict[str, Any]) -> set[int]:
        ids: set[int] = set()
        for source in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
            value = source.get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
        eos_text = _token_text(tcfg.get("eos_token"))
        if eos_text is not None and (eos_id := self.tok.token_to_id(eos_text)) is not None:
            ids.add(eos_id)
        return ids

    def chat_input(
        self, messages: list[Message] | tuple[Message, ...], tools: tuple[Tool, ...] = (), generic_tools: bool = True
    ) -> ChatInput:
        """What the chat template is given for these messages and tools (see `tool_prompt.chat_input`):
        the tools natively, in reqscope's generic block, or a RequestError when refused."""
        return chat_input(self.chat_template, tuple(messages), tools, generic_tools)

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: tuple[Tool, ...] = (),
        generic_tools: bool = True,
    ) -> str:
        """The prompt text the model sees, from its own chat template, with `tools` as `chat_input` places them."""
        if self.chat_template is None:
            raise TokenizerError(
                "this model folder has no chat template (tokenizer_config.json chat_template); "
                "use an instruct/chat model"
            )
        chat = self.chat_input(messages, tools, generic_tools)
        try:
            return render_chat(
                self.chat_template,
                list(chat.messages),
                add_generation_prompt=add_generation_prompt,
                special_tokens=self.special_tokens,
                tools=chat.tools,
            )
        except TokenizerError as exc:
            raise TokenizerError(f"{self.template_origin}: ", exc.message) from None

    def generation_prompt_start(
        self, messages: list[Message], rendered: str, tools: tuple[Tool, ...] = (), generic_tools: bool = True
    ) -> int:
        """Where the generation prompt begins in `rendered`, `messages` rendered with it (its
        length when the template adds none).

        Known without rendering again for a template that appends a fixed text
        (`fixed_generation_prompt`); any other renders the messages once more, without it.
        """
        fixed = fixed_generation_prompt(self.chat_template or "")
        # An empty rest is left to the second render to report, as it always was.
        if fixed is not None and len(rendered) > len(fixed) and rendered.endswith(fixed):
            return len(rendered) - len(fixed)
        without = self.render(messages, add_generation_prompt=False, tools=tools, generic_tools=generic_tools)
        return len(without) if rendered.startswith(without) else len(rendered)

    def encode(self, text: str) -> list[int]:
        """Token ids for already-templated text (no extra special tokens added)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_pieces(self, text: str) -> list[TokenPiece]:
        """Token ids with the character span and display text of each."""
        enc = self.tok.encode(text, add_special_tokens=False)
        return [
            TokenPiece(i, text[a:b] if b > a else self.piece(i), i in self.special_ids, a, b)
            for i, (a, b) in zip(enc.ids, enc.offsets, strict=True)
        ]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for a sequence of ids."""
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str:
        """Human-readable text of one token (raw bytes shown as <0x..> when not a whole character)."""
        cached = self._pieces.get(token_id)
        if cached is not None:
            return cached
        text = self.tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text or text == "":
            raw = self.tok.id_to_token(token_id) or ""
            text = raw if raw else f"<{token_id}>"
            if "\ufffd" in text:
                text = f"<id {token_id}>"
        self._pieces[token_id] = text
        return text
