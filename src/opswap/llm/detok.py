"""Incremental detokenization for streaming (chapter 29): each new token's text, without
decoding the whole output again at every step and without ever sending half a character.

    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    for ids in new_token_ids_per_step:
        send(detok.push(ids))        # "" while the tail is an incomplete character
    send(detok.flush())              # what was held back, at the end

A token is not a piece of text on its own. Byte-level BPE (GPT-2, Llama 3, Qwen) maps
tokens to bytes, and one character's UTF-8 bytes may span several tokens: decoded alone,
the first of them is U+FFFD. Sentencepiece (Llama 2, Mistral) marks a word's leading
space on its first token and drops the space when that token starts the decoded text;
with byte fallback it too splits characters over tokens. So the text of the new tokens
is read as a difference, the usual way (Hugging Face's text-generation-inference, vLLM):
two offsets into the ids, `prefix` <= `read`; decode ids[prefix:read] (text already sent,
kept as context) and ids[prefix:]; what the second adds to the first is new, unless it
ends in U+FFFD, a character whose bytes have not all come yet, or the last token is a
sentencepiece byte-fallback token (<0xNN>: its run of bytes decodes as a whole, so a byte
valid on its own turns into U+FFFD when the bytes after it make the run invalid): then
nothing is sent and the offsets stay. When text is sent the window slides (prefix = read, read = end), so
each step decodes a few tokens, not the whole output: O(new tokens) per step.

The window starts on the prompt's last few tokens, so a first output token that begins
a word keeps its space. The deltas of a stream joined are `decode(output ids)` (the
tests check it on random id streams of byte-level BPE and byte-fallback sentencepiece
tokenizers).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

#: prompt tokens kept as context for the first output token (as vLLM)
_CONTEXT = 5


class IncrementalDetokenizer:
    """The text of a token stream, piece by piece (see the module's docstring).

    `tokenizer`: anything with `decode(ids, skip_special_tokens=...)` (a transformers
    tokenizer or a `tokenizers.Tokenizer`). `prompt_ids`: the tokens before the stream;
    only their text's effect on the first output tokens is used, none of it is returned.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(t) for t in prompt_ids[-_CONTEXT:]]
        self.ids: list[int] = context
        self.prefix = 0
        self.read = len(context)
        self.text = ""
        self._byte_tokens: dict[int, bool] = {}
        # skipped special tokens join the byte runs on either side of them
        self._skipped = set(
            getattr(tokenizer, "all_special_ids", ()) if skip_special_tokens else ()
        )

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens))

    def _is_byte_token(self, token: int) -> bool:
        known = self._byte_tokens.get(token)
        if known is None and token < 0:
            return False
        if known is None:
            tok = self.tokenizer
            to_str = getattr(tok, "convert_ids_to_tokens", None) or getattr(
                tok, "id_to_token", None
            )
            name = to_str(token) if to_str is not None else None
            known = isinstance(name, str) and _BYTE_TOKEN.fullmatch(name) is not None
            self._byte_tokens[token] = known
        return known

    def _last_kept(self) -> int:
        for t in reversed(self.ids):
            if t not in self._skipped:
                return t
        return -1

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; returns the text they complete ("" while a character is incomplete)."""
        self.ids += [int(t) for t in new_ids]
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character's U+FFFD), at the end of the
        stream."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        held = (
            len(after) <= len(before)
            or after.endswith(REPLACEMENT)
            or self._is_byte_token(self._last_kept())
        )
        if held and not final:
            return ""
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta
