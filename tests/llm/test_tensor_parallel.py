"""Tensor-parallel serving (opswap.llm.tensor_parallel) on the CPU: two ranks with gloo,
rank 1 spawned by the engine, against the single-process engine in float32.

Tiny random models (Llama: 4 heads over 2 KV heads, MLP 96; GPT-2: 4 heads, MLP 256;
odd vocab 161): greedy tokens of prompts of lengths 1, 6, 19 and 37 (block size 8, which
divides none of them; chunked prefill at 24 tokens a step) identical to one process's, the
KV blocks back to zero at the end and after an abort; each rank's shard (heads, KV cache,
MLP columns) checked in process against the whole layer; the step protocol (eager and
CUDA-graph-bucket steps packed as for the broadcast) replayed on a peer engine, whose KV
cache ends equal to rank 0's; the refusals before any process
starts (heads or KV heads that do not divide, a runner without a split, more ranks than
GPUs); a worker that raises surfaces on rank 0 as one sentence, and one that hangs fails
by the group's timeout instead of hanging the test; `opswap serve --tensor-parallel 2`
on the CPU and its refusals. The engines' step timeouts bound every test here. On a host
with 2 GPUs (gpu_suite.py --only tp): NCCL tokens against one GPU's, eager and with CUDA
graphs."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from opswap.errors import OpswapError
from opswap.llm import LLMEngine, SamplingParams
from opswap.llm import tensor_parallel as tpm
from opswap.llm.runner import RUNNERS, make_runner, run_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 161
LENGTHS = (1, 6, 19, 37)
ENGINE = dict(block_size=8, max_model_len=64, max_num_batched_tokens=24, max_num_seqs=4)


def _llama(heads: int = 4, kv_heads: int = 2) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        intermediate_size=96,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, initializer_range=0.1
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0)) for p in prompts]
    out: dict[str, list[int]] = {}
    with torch.inference_mode():
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] = o.token_ids
    return [out[i] for i in ids]


# -- the split, in process (two threads stand in for the ranks) -------------------------


def _attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_each_rank_holds_its_heads_and_the_sum_is_the_whole_layer(kind):
    model = _llama() if kind == "llama" else _gpt2()
    world, ids = 2, torch.tensor([3, 7, 9, 100, 160])
    pos = torch.arange(len(ids))
    ref = run_model(make_runner(model, 64, "cpu", torch.float32), ids, pos, _attend, None)
    parts: list[torch.Tensor] = []
    meet = threading.Barrier(world)
    lock = threading.Lock()
    shapes: dict[int, tuple[int, int, int]] = {}

    def reduce_for(rank: int) -> Any:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            with lock:
                parts.append(t.clone())
            meet.wait()
            total = torch.stack(parts).sum(0)
            meet.wait()
            if rank == 0:
                parts.clear()
            meet.wait()
            return t.copy_(total)

        return reduce

    outs: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        full = make_runner(model, 64, "cpu", torch.float32)
        sr = tpm.ShardedRunner(full, r, world, torch.device("cpu"), reduce=reduce_for(r))
        shapes[r] = (sr.heads, sr.kv_heads, sr.head_dim)
        outs[r] = run_model(sr, ids, pos, _attend, None)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    kv = 1 if kind == "llama" else 2
    assert shapes == {0: (2, kv, 16), 1: (2, kv, 16)}
    assert outs[1].shape == (0, VOCAB)  # only rank 0 computes logits
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


class _Loopback:
    """Stands in for rank 0's TPGroup in process: each step's header and payload go through
    the same packing as the broadcast, straight into a peer engine's `run_remote`."""

    def __init__(self, peer: LLMEngine) -> None:
        self.peer, self.ops = peer, []

    def send(self, op: str, tensors: Any, ints: Any = ()) -> None:
        header = tpm._header(op, tensors, ints)
        flat = torch.cat([t.reshape(-1).long() for t in tensors if t is not None])
        assert flat.numel() == tpm._payload_size(header)
        self.peer.run_remote(op, header[1], tpm._unpack(flat, header))
        self.ops.append(op)

    def close(self) -> None:
        pass


def test_the_step_protocol_replays_eager_and_graph_steps_on_a_peer():
    from opswap.llm.engine import _DecodeGraphs

    model, prompts = _llama(), _prompts()
    ref = _greedy(LLMEngine(model, **ENGINE), prompts)
    rank0, peer = LLMEngine(model, **ENGINE), LLMEngine(model, **ENGINE)
    for e in (rank0, peer):  # the CUDA-graph bucket path, run eagerly on the CPU
        e.graphs = _DecodeGraphs(e, 4, capture=False)
    link = _Loopback(peer)
    rank0.tp = link  # type: ignore[assignment]
    assert _greedy(rank0, prompts) == ref
    assert {"run", "graph"} <= set(link.ops)
    # the peer wrote every key and value rank 0 wrote, from the sent batches alone
    torch.testing.assert_close(peer.k_cache, rank0.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(peer.v_cache, rank0.v_cache, rtol=0, atol=0)
    with pytest.raises(OpswapError, match="unknown step"):
        peer.run_remote("jump", [], [])


# -- two processes, gloo ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_two_ranks_give_the_single_process_tokens(kind):
    model = _llama() if kind == "llama" else _gpt2()
    prompts = _prompts()
    ref = _greedy(LLMEngine(model, **ENGINE), prompts)
    engine = LLMEngine(model, tensor_parallel=2, tp_timeout_s=30, **ENGINE)
    try:
        assert engine.runner.kv_heads == (1 if kind == "llama" else 2)
        assert engine.k_cache.shape[3] == engine.runner.kv_heads  # the cache holds rank 0's
        assert _greedy(engine, prompts) == ref
        assert engine.stats().blocks.in_use == 0
        if kind == "gpt2":
            return
        # an abort mid-generation frees its blocks, and the ranks stay in step after it
        rid = engine.add_request(prompts[3], SamplingParams(max_tokens=20, temperature=0.0))
        with torch.inference_mode():
            engine.step()
        assert engine.stats().blocks.in_use > 0
        engine.abort(rid)
        assert engine.stats().blocks.in_use == 0
        assert _greedy(engine, prompts[:2]) == ref[:2]
    finally:
        engine.close()
        assert not multiprocessing.active_children()
    with pytest.raises(OpswapError, match="stopped"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2))
        engine.step()


def test_a_failing_rank_is_one_sentence_on_rank_0(monkeypatch):
    monkeypatch.setenv(tpm.FAULT_ENV, "1:1:raise")
    engine = LLMEngine(_llama(), tensor_parallel=2, tp_timeout_s=30, **ENGINE)
    try:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))
        with torch.inference_mode():
            engine.step()  # step 0 runs
            with pytest.raises(tpm.TPError) as e:
                engine.step()
        msg = str(e.value)
        assert msg.startswith("tensor-parallel rank 1 failed (RuntimeError: injected fault")
        assert msg.count(".") == 1 and "\n" not in msg
    finally:
        engine.close()
    assert not multiprocessing.active_children()


def test_a_hung_rank_fails_by_the_timeout(monkeypatch):
    monkeypatch.setenv(tpm.FAULT_ENV, "1:0:hang")
    engine = LLMEngine(_llama(), tensor_parallel=2, tp_timeout_s=3, **ENGINE)
    try:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))
        with torch.inference_mode(), pytest.raises(tpm.TPError, match="3 s step timeout"):
            engine.step()
        with pytest.raises(tpm.TPError, match="an earlier tensor-parallel step failed"):
            engine.step()  # never a second wait on the hung rank
    finally:
        engine.close()  # the hung worker is terminated
    assert not multiprocessing.active_children()


# -- refusals, before any process starts -------------------------------------------------


class _Odd:
    """A runner registered for a test model class, with no split written."""

    def __init__(self, model: Any, max_len: int, device: Any, dtype: torch.dtype) -> None:
        self.heads = self.kv_heads = 4


class OddLM(torch.nn.Module):
    pass


@pytest.mark.parametrize(
    ("make", "n", "device", "message"),
    [
        (lambda: _llama(heads=4, kv_heads=2), 3, "cpu", "4 attention heads do not divide by"),
        (lambda: _llama(heads=4, kv_heads=2), 4, "cpu", "2 KV heads do not divide by"),
        (lambda: _llama(heads=8, kv_heads=8), 3, "cpu", "8 attention heads"),
        (OddLM, 2, "cpu", "runner _Odd has none written"),
        (_llama, 2, "cuda", "needs 2 GPUs of this host and torch sees"),
        (_llama, 2, "cuda:1", "pass device 'cuda'"),
        (_llama, 0, "cpu", "tensor_parallel must be at least 1"),
    ],
)
def test_what_cannot_be_split_is_refused_in_one_sentence(monkeypatch, make, n, device, message):
    if device.startswith("cuda") and torch.cuda.device_count() >= n:
        pytest.skip("this host has the GPUs")
    monkeypatch.setitem(RUNNERS, "OddLM", _Odd)
    with pytest.raises(OpswapError, match=message) as e:
        LLMEngine(make(), tensor_parallel=n, device=device, **ENGINE)
    assert "\n" not in str(e.value) and str(e.value).endswith(".")
    assert not multiprocessing.active_children()  # refused before spawning


# -- opswap serve --tensor-parallel ------------------------------------------------------


def _main(*args: str) -> int:
    from opswap.cli import main

    try:
        main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_serve_splits_over_gloo_ranks_and_stops_them(monkeypatch, capfd):
    import opswap.llm.server as server

    built: dict[str, Any] = {}

    class Quiet:  # the server's thread: one step through the engine instead of serving
        url = "http://127.0.0.1:0"

        def __init__(self, *a: Any) -> None:
            self.server = self

        def run(self) -> None:
            engine = built["engine"]
            built["tokens"] = _greedy(engine, [[3, 4, 5]], n=3)

    def build_app(engine: Any, *a: Any, **k: Any) -> None:
        built["engine"] = engine

    monkeypatch.setattr(server, "ServerThread", Quiet)
    monkeypatch.setattr(server, "build_app", build_app)
    assert _main("serve", "hf:llama", "--device", "cpu", "--tensor-parallel", "2") == 0
    engine = built["engine"]
    assert engine.tensor_parallel == 2 and len(built["tokens"][0]) == 3
    assert engine.tp.closed and not multiprocessing.active_children()
    assert "2 ranks" in capfd.readouterr().out


def test_serve_refuses_more_ranks_than_gpus_in_one_sentence(monkeypatch, capfd):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _main("serve", "hf:llama", "--device", "cuda", "--tensor-parallel", "2") == 2
    err = capfd.readouterr().err
    assert "--tensor-parallel 2 needs 2 GPUs of this host and torch sees 1" in err
    assert "Traceback" not in err
    assert _main("serve", "hf:llama", "--device", "cpu", "--tensor-parallel", "0") == 2
    assert "--tensor-parallel must be at least 1, got 0." in capfd.readouterr().err


# -- two GPUs: NCCL, CUDA graphs (the "tp" part of benchmarks/gpu_suite.py) ---------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("graphs", [False, True])
def test_two_gpus_give_one_gpus_tokens(graphs):
    model = _llama()
    prompts = _prompts()
    kw = dict(ENGINE, device="cuda", cuda_graphs=graphs)
    one = LLMEngine(model, **kw)
    ref = _greedy(one, prompts)
    del one
    engine = LLMEngine(model, tensor_parallel=2, tp_timeout_s=120, **kw)
    try:
        assert engine.device == torch.device("cuda", 0)
        assert _greedy(engine, prompts) == ref
        if graphs:  # the decode-only steps replayed their bucket's graph on both ranks
            assert engine.stats().graph_steps > 0
        assert engine.stats().blocks.in_use == 0
    finally:
        engine.close()
