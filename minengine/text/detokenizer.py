"""Incremental detokenization that never emits half a character, through `tokenizers`' DecodeStream.

Byte-level BPE tokens can split one UTF-8 character across several tokens, and decoders that
depend on context (leading spaces, byte fallback) give other text for a token alone than inside
the sequence. `tokenizers.decoders.DecodeStream` handles both in Rust: it keeps a window of
previous tokens and returns text only once it is complete. This class adds what a request
needs around it: the text so far, and a flush that releases whatever is still held back when
the request ends (an incomplete character then decodes as U+FFFD, as a whole decode would).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back the newly visible text for each."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._held = 0  # tokens pushed since the stream last released text
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add a token; return the text it makes visible (possibly empty)."""
        self.ids.append(token_id)
        new = self._stream.step(self._tok, token_id)
        if not new:
            self._held += 1
            return ""
        self._held = 0
        self.text += new
        return new

    def flush(self) -> str:
        """Release whatever is held back (at the end of a request)."""
        if not self._held:
            return ""
        full = self._tok.decode(self.ids, skip_special_tokens=self._skip)
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self._held = 0
        self._stream = DecodeStream(skip_special_tokens=self._skip)  # later pushes start afresh
        self.text += new
        return new
