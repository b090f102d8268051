"""A small tokenizer trained here, for models that come without one (chapter 29).

`hf:llama` and the other `hf:` types are built from configs with random weights: they
have no tokenizer, and opswap downloads nothing. A server and its benchmark still want
text: `train_tokenizer(texts, vocab_size)` trains a BPE on the given texts in a second or
two with Hugging Face `tokenizers` and wraps it as a transformers tokenizer, with a chat
template, in one of the two families the detokenizer must handle:

- "byte": byte-level BPE (GPT-2, Llama 3, Qwen): every byte is a token, so any text
  encodes; a character may span several tokens.
- "sentencepiece": Metaspace BPE with byte fallback (Llama 2, Mistral): `▁` marks a
  word's leading space; characters outside the learned pieces become <0xNN> byte tokens.

Ids 0, 1, 2 are <unk>, <s>, </s> (bos and eos).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SPECIALS = ("<unk>", "<s>", "</s>")

#: a plain chat template: one "<|role|>\ncontent\n" block per message, then the assistant's
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 1000,
    kind: str = "byte",
    chat_template: str | None = CHAT_TEMPLATE,
) -> Any:
    """A transformers `PreTrainedTokenizerFast` trained on `texts` (at most `vocab_size`
    tokens; fewer when the texts hold fewer merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in ("byte", "sentencepiece"):
        raise ValueError(f"kind must be 'byte' or 'sentencepiece', got {kind!r}.")
    texts = list(texts)
    if kind == "byte":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIALS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
    else:
        # learn pieces, then rebuild the model with the 256 byte tokens and byte fallback
        first = Tokenizer(models.BPE(unk_token="<unk>"))
        first.pre_tokenizer = pre_tokenizers.Metaspace()
        bytes_ = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(
            vocab_size=max(vocab_size - 256, len(SPECIALS) + 1),
            special_tokens=list(SPECIALS),
            show_progress=False,
        )
        first.train_from_iterator(texts, trainer)
        learned = first.get_vocab()
        vocab = {t: i for i, t in enumerate(SPECIALS)}
        for t in bytes_:
            vocab[t] = len(vocab)
        for t, _ in sorted(learned.items(), key=lambda kv: kv[1]):
            vocab.setdefault(t, len(vocab))
        merges = _merges(first)
        tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=chat_template,
    )


def _merges(tok: Any) -> list[tuple[str, str]]:
    import json

    model = json.loads(tok.to_str())["model"]
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    return [(str(a), str(b)) for a, b in pairs]
