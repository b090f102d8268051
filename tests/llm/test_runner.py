"""opswap.llm.runner: the runner registry (a decorator fills it; unknown classes are
refused in one sentence naming the supported ones) and GPT-2 on the paged engine, greedy
tokens identical to transformers' `generate` in float32 with prompts of mixed lengths
arriving at different steps, a block size that divides none of them, chunked prefill."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from opswap.errors import OpswapError
from opswap.llm import LLMEngine, SamplingParams, generate
from opswap.llm.runner import RUNNERS, LlamaRunner, make_runner, register_runner, supported_models

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 200


def _gpt2(seed: int = 0, **over: Any) -> Any:
    torch.manual_seed(seed)
    cfg = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
               initializer_range=0.1)  # fmt: skip
    cfg.update(over)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()


def _hf(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("block_size, act", [(5, "gelu_new"), (3, "gelu_pytorch_tanh")])
def test_gpt2_greedy_tokens_equal_transformers_with_staggered_arrivals(block_size, act):
    model = _gpt2(activation_function=act)
    prompts = _prompts((1, 6, 13, 27))
    n_new = 9
    want = [_hf(model, p, n_new) for p in prompts]
    engine = LLMEngine(
        model, block_size=block_size, num_blocks=60, max_model_len=48, max_num_seqs=4,
        max_num_batched_tokens=12,
    )  # fmt: skip
    got: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:  # one request joins before each step
            i, p = pending.pop(0)
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=n_new), str(i))
        for out in engine.step():
            if out.finished:
                got[int(out.request_id)] = out.token_ids
    assert [got[i] for i in range(len(prompts))] == want
    s = engine.stats()
    assert s.blocks.in_use == 0 and s.steps > n_new + 2  # the 27-token prompt was chunked


def test_gpt2_logits_match_transformers():
    model = _gpt2(seed=2)
    runner = make_runner(model, 32, "cpu", torch.float32)
    ids = torch.tensor(_prompts((11,), seed=3)[0])
    pos = torch.arange(11)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return o.transpose(0, 1)

    x = runner.embed(ids, pos)
    for i in range(runner.num_layers):
        x = runner.layer(i, x, pos, attend)
    got = runner.logits(x, torch.tensor([3, 10]))
    with torch.no_grad():
        want = model(ids[None]).logits[0, [3, 10]]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_registry_picks_by_class_name_and_refuses_others_in_one_sentence():
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel"} <= set(
        supported_models()
    )
    assert RUNNERS["MistralForCausalLM"] is LlamaRunner

    class TinyLM(torch.nn.Module):
        pass

    with pytest.raises(OpswapError, match=r"LLMEngine runs .*GPT2LMHeadModel.*; TinyLM has"):
        make_runner(TinyLM(), 16, "cpu", torch.float32)

    @register_runner("TinyLM")
    class TinyRunner:  # a runner of one embedding and no layers: logits = its rows
        def __init__(self, model: Any, max_len: int, device: Any, dtype: torch.dtype) -> None:
            self.num_layers, self.heads, self.kv_heads, self.head_dim = 0, 1, 1, 4
            self.scale, self.vocab = 0.5, 4
            self.device, self.dtype = torch.device(device), dtype
            self.table = torch.eye(4, dtype=dtype) * 5

        def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.table[(ids + 1) % 4]  # next token: (t + 1) mod 4

        def layer(self, i: int, x: torch.Tensor, positions: torch.Tensor, attend: Any) -> Any:
            raise AssertionError("no layers")

        def logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
            return x if rows is None else x[rows]

    try:
        out = generate(
            TinyLM(), [[2]], SamplingParams(temperature=0, max_tokens=5), max_model_len=16
        )[0]
        assert out.token_ids == [3, 0, 1, 2, 3]
    finally:
        del RUNNERS["TinyLM"]


def test_gpt2_refusals_are_one_sentence():
    with pytest.raises(OpswapError, match="activation 'gelu_fast' is not supported"):
        LLMEngine(_gpt2(activation_function="gelu_fast"), max_model_len=16)
    with pytest.raises(OpswapError, match="inverse layer index is not supported"):
        LLMEngine(_gpt2(scale_attn_by_inverse_layer_idx=True), max_model_len=16)
    with pytest.raises(OpswapError, match="longer than GPT-2's 64 learned positions"):
        LLMEngine(_gpt2(), max_model_len=100)
