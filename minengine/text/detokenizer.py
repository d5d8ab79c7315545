"""Incremental detokenization that never emits half a character.

Byte-level BPE tokens can split one UTF-8 character across several tokens. Decoding each
token on its own would print replacement characters, so text is released only once the
decoded suffix no longer ends in an incomplete sequence. A small window of previous tokens
is re-decoded with each step so that tokenizer decoders that depend on context (leading
spaces, byte fallback) produce the same text as decoding the whole sequence at once.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back the newly visible text for each."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window re-decoded each step
        self._read = 0  # tokens whose text has been emitted
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add a token; return the text it makes visible (possibly empty)."""
        self.ids.append(token_id)
        before = self._tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=self._skip)
        after = self._tok.decode(self.ids[self._prefix :], skip_special_tokens=self._skip)
        if after.endswith(_INCOMPLETE) or len(after) <= len(before):
            return ""  # wait for the rest of the character (or nothing visible yet)
        new = after[len(before) :]
        self._prefix = self._read
        self._read = len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Release whatever is held back (at the end of a request)."""
        full = self._tok.decode(self.ids[self._prefix :], skip_special_tokens=self._skip)
        before = self._tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new = full[len(before) :] if len(full) > len(before) else ""
        self._prefix = self._read = len(self.ids)
        self.text += new
        return new
