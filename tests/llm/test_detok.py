"""opswap.llm.detok: the streamed pieces of random id streams, pushed a few tokens at a
time, join to `tokenizer.decode(all ids)` for a byte-level BPE and a byte-fallback
sentencepiece tokenizer (both trained here on a few sentences with characters of 1 to 4
UTF-8 bytes); no piece of valid text ever holds U+FFFD; a first output token keeps the
space the prompt's context gives it; each step decodes a short window, not the output."""

from __future__ import annotations

import random

import pytest

from opswap.llm.detok import IncrementalDetokenizer
from opswap.llm.tokenizer import train_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln, naïve café: 東京は晴れ。 🙂 and 🚀 too",
    "def f(x):\n    return x * 2  # doubled\n",
] * 3


@pytest.fixture(scope="module", params=["byte", "sentencepiece"])
def tok(request):
    return train_tokenizer(TEXTS, 400, request.param)


def _stream(tok, ids, rng, prompt=()):
    d = IncrementalDetokenizer(tok, prompt)
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 4)
        pieces.append(d.push(ids[i : i + k]))
        i += k
    pieces.append(d.flush())
    return pieces, d


def test_random_id_streams_join_to_the_whole_decode(tok):
    rng = random.Random(0)
    special = set(tok.all_special_ids)
    for _ in range(400):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        pieces, d = _stream(tok, ids, rng)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True), ids
        assert d.text == "".join(pieces)
    assert special  # the streams above drew special tokens too (ids 0 to 2)


def test_valid_text_never_streams_a_broken_character(tok):
    text = "naïve 東京 🙂🚀 Grüße café fox"
    ids = tok(text)["input_ids"]
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([t]) for t in ids] + [d.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens held a partial character


def test_the_first_output_token_keeps_its_space_from_the_prompt(tok):
    prompt = tok("The quick brown")["input_ids"]
    out = tok("The quick brown fox jumps")["input_ids"][len(prompt) :]
    d = IncrementalDetokenizer(tok, prompt)
    text = "".join(d.push([t]) for t in out) + d.flush()
    whole = tok.decode(prompt + out)
    assert text == whole[len(tok.decode(prompt)) :]
    assert text.startswith(" ")


def test_each_step_decodes_a_short_window():
    tok = train_tokenizer(TEXTS, 400, "byte")
    seen: list[int] = []

    class Counting:
        all_special_ids = tok.all_special_ids

        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

        def convert_ids_to_tokens(self, t):
            return tok.convert_ids_to_tokens(t)

    ids = tok(" ".join(TEXTS) * 4)["input_ids"]
    d = IncrementalDetokenizer(Counting(), ids[:7])
    text = "".join(d.push([t]) for t in ids[7:]) + d.flush()
    assert text == tok.decode(ids)[len(tok.decode(ids[:7])) :]
    assert len(ids) > 300 and max(seen) <= 12
