"""opswap.llm.cpu_step, the CPU decode path of StaticDecoder: its attention (one query, and
a prompt's causal blocks) against float64 SDPA at odd shapes, GQA and MHA, on both sides
of the grain size; greedy tokens equal to transformers' generate with the inline and the
SDPA branches; the aten ops of a step (none of those that open a parallel region whatever
their size: SDPA, softmax, exp, bmm; no scatter); the cache's state after a call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from opswap.llm import StaticDecoder
from opswap.llm import cpu_step as cs


def _llama(kv_heads=2, seed=0, hidden=64, heads=4):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=128,
        intermediate_size=96,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _hf_generate(model, ids, n):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        eos_token_id=None,
    )  # fmt: skip


def _prompt(batch, length, seed):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _sdpa64(q, k, v, scale, causal):
    g = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(g, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v, is_causal=causal, scale=scale)


@pytest.mark.parametrize(
    "b, h, hk, length, d", [(3, 6, 3, 37, 24), (1, 5, 5, 1, 8), (2, 8, 1, 19, 16)]
)
def test_one_query_attention_matches_float64_sdpa(b, h, hk, length, d):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(b, h, d, generator=g)
    k, v = torch.randn(2, b, hk, length, d, generator=g)
    scale = 0.3
    got = cs._attend_inline(q, k, v, scale)  # [B, 1, H * D]
    want = _sdpa64(q[:, :, None], k, v, scale, causal=False)  # [B, H, 1, D]
    assert got is not None and got.shape == (b, 1, h * d) and got.dtype == torch.float32
    torch.testing.assert_close(got.view(b, h, d).double(), want[:, :, 0], rtol=1e-5, atol=1e-6)


def test_one_query_attention_past_max_blocks_is_left_to_sdpa(monkeypatch):
    q, k = torch.randn(2, 8, 32), torch.randn(2, 4, 600, 32)  # G = 2
    assert cs._attend_inline(q, k, k, 0.2) is None  # one row alone: 2 * 600 * 32 > 32768
    assert cs._attend_inline(q, k[:, :, :300], k[:, :, :300], 0.2) is not None  # 8 blocks
    monkeypatch.setattr(cs, "MAX_BLOCKS", 7)
    assert cs._attend_inline(q, k[:, :, :300], k[:, :, :300], 0.2) is None


@pytest.mark.parametrize(
    "b, h, hk, t, d", [(2, 6, 2, 13, 24), (1, 4, 4, 1, 32), (1, 4, 2, 150, 32)],
    ids=["blocks", "one-token", "sdpa-past-max-blocks"],
)  # fmt: skip
def test_causal_prompt_attention_matches_float64_sdpa(b, h, hk, t, d):
    g = torch.Generator().manual_seed(t)
    q = torch.randn(b, h, t, d, generator=g).transpose(1, 2).contiguous().transpose(1, 2)
    k, v = torch.randn(2, b, hk, t, d, generator=g)
    got = cs.causal_attend(q, k, v, 0.25)
    torch.testing.assert_close(got.double(), _sdpa64(q, k, v, 0.25, True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grain", [cs.GRAIN, 1], ids=["inline", "sdpa"])
@pytest.mark.parametrize("kv_heads, batch", [(2, 1), (4, 2)], ids=["gqa-b1", "mha-b2"])
def test_tokens_equal_hf_greedy_through_either_attention(monkeypatch, grain, kv_heads, batch):
    monkeypatch.setattr(cs, "GRAIN", grain)  # 1: every attention through SDPA
    model = _llama(kv_heads, seed=5)
    ids = _prompt(batch, 7, seed=batch)
    dec = StaticDecoder(model, max_len=20, batch=batch)
    assert dec.host_step
    tokens, prefill, steps = dec.generate_with_logits(ids, 11)
    want = _hf_generate(model, ids, 11)
    assert torch.equal(tokens, want), (tokens, want)
    with torch.no_grad():
        ref = model(want[:, :-1]).logits
    torch.testing.assert_close(prefill, ref[:, :7], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(steps, ref[:, 7:], rtol=1e-4, atol=1e-5)
    assert dec.cache.lengths.tolist() == [7 + 10] * batch


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


#: ops that open a parallel region whatever their size (each waits for a second thread)
FORKING = {
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "softmax", "_softmax", "exp", "exp_", "bmm", "matmul",
}  # fmt: skip


def test_a_step_calls_no_op_that_forks_for_small_work(monkeypatch):
    model = _llama(seed=2, hidden=96, heads=6)
    dec = StaticDecoder(model, max_len=40)
    dec.generate(_prompt(1, 9, seed=3), 4)
    with torch.inference_mode(), _Ops() as seen:
        logits = cs.step_at(dec.net, torch.tensor([[3]]), dec.cache, 12)
    assert logits.shape == (1, 128)
    assert not seen.names & FORKING, seen.names & FORKING
    assert not seen.names & {"scatter", "scatter_", "index"}, sorted(seen.names)
    assert {"exp2_", "linear", "copy_"} <= seen.names, sorted(seen.names)
    with torch.inference_mode(), _Ops() as seen:  # and the prompt
        dec.net.prefill(_prompt(1, 9, seed=3), dec.net.new_cache(1, 40), cs.causal_attend)
    assert not seen.names & FORKING, seen.names & FORKING
    monkeypatch.setattr(cs, "GRAIN", 1)  # past the grain size: SDPA, which the mode sees
    with torch.inference_mode(), _Ops() as seen:
        cs.step_at(dec.net, torch.tensor([[3]]), dec.cache, 12)
    assert "scaled_dot_product_attention" in seen.names, sorted(seen.names)


@pytest.mark.parametrize("rows", [1, 3, cs.GEMV_ROWS + 1])
def test_small_batches_run_their_linears_row_by_row(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 1, 40, generator=g), torch.randn(23, 40, generator=g), None
    with _Ops() as seen:
        got = cs._linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert got.shape == (rows, 1, 23)
    assert ("cat" in seen.names) == (1 < rows <= cs.GEMV_ROWS), sorted(seen.names)


def test_the_fused_ops_keep_the_generic_step_on_the_cpu():
    dec = StaticDecoder(_llama(), max_len=12, kernels=True)
    assert not dec.host_step  # their wiring is what kernels=True tests on the CPU
