"""opswap.llm.StaticDecoder on tiny random Llamas (and a Qwen2) against transformers:
greedy tokens equal to `generate(do_sample=False)` at batch 1 and 2 and several prompt
lengths, GQA and MHA; logits of the prefill and of every decode step close to HF's
forward over the same sequence (fp32); the user's model unchanged; the static cache's
in-place writes; a compiled step; the Triton decode-attention kernel inside the decoder
(interpreter child at head dim 64; on a GPU the compiled kernels and CUDA graphs); and
the errors, one sentence each, as OpswapError subclasses."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
import _rows_check as rc  # noqa: E402

from opswap.errors import OpswapError  # noqa: E402
from opswap.kernels import _rows  # noqa: E402
from opswap.llm import DecodeError, StaticDecoder, StaticKVCache  # noqa: E402

#: the GPU machine runs the same tests on CUDA: the Triton kernel and CUDA graphs
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _llama(kv_heads=2, head_dim=None, seed=0, **extra):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=128,
        intermediate_size=128,
        initializer_range=0.1,  # livelier logits than 0.02: greedy paths that do not loop at once
        **({"head_dim": head_dim} if head_dim else {}),
        **extra,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _hf_generate(model, ids, n):
    # an explicit all-ones mask: with a pad id set, HF would mask prompt tokens equal to it
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        eos_token_id=None,
    )  # fmt: skip


def _prompt(batch, length, seed):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kv_heads, batch, lengths",
    [(2, 1, (1, 5, 23)), (2, 2, (3, 16)), (4, 1, (9,)), (4, 2, (2, 11))],
    ids=["gqa-b1", "gqa-b2", "mha-b1", "mha-b2"],
)
def test_tokens_equal_hf_greedy_and_logits_match(kv_heads, batch, lengths):
    model = _llama(kv_heads).to(DEVICE)
    n = 10
    dec = StaticDecoder(model, max_len=max(lengths) + n, batch=batch)
    for t in lengths:
        ids = _prompt(batch, t, seed=t).to(DEVICE)
        want = _hf_generate(model, ids, n)
        tokens, prefill, steps = dec.generate_with_logits(ids, n)
        assert torch.equal(tokens, want), (t, tokens, want)
        with torch.no_grad():  # HF's logits at every position of the same sequence
            ref = model(want[:, :-1]).logits
        assert prefill.shape == (batch, t, 128) and steps.shape == (batch, n - 1, 128)
        torch.testing.assert_close(prefill, ref[:, :t], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(steps, ref[:, t:], rtol=1e-4, atol=1e-5)
        assert torch.equal(dec.generate(ids, n), want)  # and again: the cache resets


def test_a_batch_of_different_prompts_decodes_each_as_alone():
    model = _llama(seed=3).to(DEVICE)
    ids = _prompt(2, 6, seed=1).to(DEVICE)
    both = StaticDecoder(model, max_len=20, batch=2).generate(ids, 8)
    one = StaticDecoder(model, max_len=20, batch=1)
    for i in range(2):
        assert torch.equal(both[i : i + 1], one.generate(ids[i : i + 1], 8))
    assert not torch.equal(both[0], both[1])


def test_qwen2_with_biases_matches_hf():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        intermediate_size=128,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(cfg).eval().to(DEVICE)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = _prompt(1, 7, seed=2).to(DEVICE)
    got = StaticDecoder(model, max_len=24).generate(ids, 12)
    assert torch.equal(got, _hf_generate(model, ids, 12))


def test_the_users_model_is_unchanged():
    model = _llama().to(DEVICE)
    ids = _prompt(1, 5, seed=4).to(DEVICE)
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        out_before = model(ids).logits
    StaticDecoder(model, max_len=16).generate(ids, 8)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, out_before)
    assert not model.training


def test_the_cache_writes_in_place_at_tensor_positions():
    cache = StaticKVCache(2, 2, 3, 8, 4, device=DEVICE)
    k0 = cache.k[1]
    k = torch.randn(2, 3, 2, 4, device=DEVICE)
    cache.write(1, k, -k, cache.positions(2))
    cache.advance(2)
    pos = torch.tensor([[5], [2]], device=DEVICE)  # each sequence at its own slot
    k1 = torch.randn(2, 3, 1, 4, device=DEVICE)
    cache.write(1, k1, k1, pos)
    assert cache.k[1] is k0 and cache.lengths.tolist() == [2, 2]
    assert torch.equal(cache.k[1][:, :, :2], k) and torch.equal(cache.v[1][:, :, :2], -k)
    assert torch.equal(cache.k[1][0, :, 5], k1[0, :, 0])
    assert torch.equal(cache.k[1][1, :, 2], k1[1, :, 0])
    assert cache.nbytes == 2 * 2 * (2 * 3 * 8 * 4) * 4
    cache.reset()
    assert cache.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("kv_heads,batch", [(2, 1), (4, 2)], ids=["gqa-b1", "mha-b2"])
def test_the_fused_ops_give_hf_tokens_and_logits(kv_heads, batch):
    # on the CPU the ops run their PyTorch references: this checks the wiring (which
    # tensor is the residual, which norm weight reads which sum, the packed gate|up)
    model = _llama(kv_heads, seed=3).to(DEVICE)
    ids = _prompt(batch, 6, seed=4).to(DEVICE)
    dec = StaticDecoder(model, max_len=20, batch=batch, kernels=True)
    tokens, prefill, steps = dec.generate_with_logits(ids, 9)
    want = _hf_generate(model, ids, 9)
    assert torch.equal(tokens, want), (tokens, want)
    with torch.no_grad():
        ref = model(want[:, :-1]).logits
    torch.testing.assert_close(prefill, ref[:, :6], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(steps, ref[:, 6:], rtol=1e-4, atol=1e-5)


def test_the_fused_ops_are_the_default_on_a_cuda_device_only():
    model = _llama()
    assert StaticDecoder(model, max_len=8).net.kernels is False  # CPU: HF's own math
    assert StaticDecoder(model, max_len=8, kernels=True).net.kernels is True
    if torch.cuda.is_available():
        on_gpu = StaticDecoder(_llama().cuda(), max_len=8)
        assert on_gpu.net.kernels is (_rows.triton is not None)
        assert StaticDecoder(_llama().cuda(), max_len=8, kernels=False).net.kernels is False


def test_a_compiled_step_gives_the_same_tokens():
    model = _llama().to(DEVICE)
    ids = _prompt(1, 4, seed=5).to(DEVICE)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"  # no C++ build on a CPU run
    dec = StaticDecoder(model, max_len=16, compile=backend)
    assert torch.equal(dec.generate(ids, 6), _hf_generate(model, ids, 6))


def test_bad_inputs_and_models_are_refused_in_one_sentence():
    transformers = pytest.importorskip("transformers")
    model = _llama()
    dec = StaticDecoder(model, max_len=12)
    cases = [
        (lambda: dec.generate(_prompt(1, 8, 0), 5), "longer than max_len 12"),
        (lambda: dec.generate(_prompt(2, 4, 0), 5), "built for batch 1"),
        (lambda: dec.generate(_prompt(1, 4, 0)[0], 5), "2-D tensor"),
        (lambda: dec.generate(_prompt(1, 4, 0) + 500, 2), "outside the vocabulary"),
        (lambda: dec.generate(_prompt(1, 4, 0).float(), 2), "integer token ids"),
        (lambda: StaticDecoder(model, max_len=1), "max_len >= 2"),
    ]
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    )
    cases.append((lambda: StaticDecoder(gpt2, max_len=8), "GPT2LMHeadModel"))
    scaled = _llama(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    cases.append((lambda: StaticDecoder(scaled, max_len=8), "RoPE scaling 'linear'"))
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
            intermediate_size=64,
            sliding_window=8,
        )  # fmt: skip
    )
    cases.append((lambda: StaticDecoder(mistral, max_len=16), "sliding window of 8"))
    for call, words in cases:
        with pytest.raises(DecodeError) as err:
            call()
        msg = str(err.value)
        assert isinstance(err.value, OpswapError) and words in msg, msg
        assert msg.endswith(".") and msg.count(". ") == 0, msg  # one sentence
    # a sliding window as long as the cache is no window at all
    assert StaticDecoder(mistral, max_len=8).generate(_prompt(1, 3, 0) % 64, 4).shape == (1, 7)


@pytest.fixture(scope="module")
def kernel_run():
    pytest.importorskip("transformers")
    return rc.run_child(__file__)


def test_the_triton_kernel_in_the_decoder_gives_hf_tokens(kernel_run):
    # head dim 64: the kernel's size (the tiny models above have 16 and run the reference)
    assert "error" not in kernel_run, kernel_run.get("error")
    assert kernel_run["kernel"] and kernel_run["equal"], kernel_run
    assert kernel_run["max_logit_err"] <= 1e-4 * kernel_run["logit_scale"], kernel_run
    fused = kernel_run["fused"]  # kernels=True: every fused op's Triton kernel launched
    assert fused["launched"] == ["add_rms_norm", "glu", "rms_norm", "rope"], fused
    assert fused["equal"], fused
    assert fused["max_logit_err"] <= 1e-4 * kernel_run["logit_scale"], fused


def _kernel_child() -> dict:
    from opswap.kernels import decode_attention as DA

    calls = []
    launch = DA.triton_decode
    DA.triton_decode = lambda *a, **kw: calls.append(1) or launch(*a, **kw)
    device = rc.DEVICE
    model = _llama(kv_heads=2, head_dim=64, seed=7).to(device)
    ids = _prompt(2, 9, seed=9).to(device)
    dec = StaticDecoder(model, max_len=40, batch=2)
    tokens, _, steps = dec.generate_with_logits(ids, 8)
    want = _hf_generate(model, ids, 8)
    with torch.no_grad():
        ref = model(want[:, :-1]).logits[:, 9:]
    from opswap.kernels import rms_norm as RMS
    from opswap.kernels import rope as ROPE
    from opswap.kernels import swiglu as GLU

    launched = set()

    def spy(module, attr, name):
        real = getattr(module, attr)

        def run(*a, **kw):
            launched.add("add_rms_norm" if name == "rms_norm" and len(a) >= 6 else name)
            return real(*a, **kw)

        setattr(module, attr, run)

    spy(RMS, "triton_forward", "rms_norm")
    spy(ROPE, "triton_apply", "rope")
    spy(GLU, "triton_forward", "glu")
    fused_dec = StaticDecoder(model, max_len=40, batch=2, kernels=True)
    f_tokens, _, f_steps = fused_dec.generate_with_logits(ids, 8)
    fused = {
        "launched": sorted(launched),
        "equal": bool(torch.equal(f_tokens, want)),
        "max_logit_err": float((f_steps - ref).abs().max()),
    }
    return {
        "fused": fused,
        "kernel": len(calls) > 0,  # launched (eagerly, or while a CUDA graph was captured)
        "equal": bool(torch.equal(tokens, want)),
        "max_logit_err": float((steps - ref).abs().max()),
        "logit_scale": float(ref.abs().max()),
    }


if __name__ == "__main__":  # the child of `kernel_run`: interpreter on CPU, kernels on a GPU
    try:
        out = _kernel_child()
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(out))


def test_the_decoder_passes_opswaps_own_verification_and_a_broken_one_fails(monkeypatch):
    # the hand-written route answers to the same verification as the graph-rewrite route:
    # the logits of every new token against the transformers model, and their top-1
    from opswap.llm import verify_decoder

    model = _llama(kv_heads=2)
    ids = _prompt(2, 7, seed=3)
    dec = StaticDecoder(model, max_len=16, batch=2, device="cpu", cuda_graphs=False)
    v = verify_decoder(model, dec, ids, max_new_tokens=5, samples=2)
    assert v.passed, v.reasons
    assert v.outputs[0].decisions is not None  # judged as class scores too
    # a decoder that forgets the rotary embedding is caught by the same check
    from opswap.llm import cpu_step

    monkeypatch.setattr(cpu_step, "_rope", lambda qk, cos, sin: qk)
    broken = StaticDecoder(model, max_len=16, batch=2, device="cpu", cuda_graphs=False)
    bad = verify_decoder(model, broken, ids, max_new_tokens=5, samples=2)
    assert not bad.passed and any("logits" in r for r in bad.reasons), bad.reasons
