"""`opswap serve` under load: the server on a 1.1B Llama-style model answers N ShareGPT
prompts sent all at once over loopback (opswap.llm.bench_serve, the figures of `opswap
bench-serve`), beside transformers' `generate` at batch 32 on the first prompts of the
same set (the peer, same run). The client runs in a process of its own. Last, the time a
user waits from starting `opswap serve` (a fresh process) to /health and to the first
streamed token.

    PYTHONPATH=src python3 benchmarks/bench_serve.py --out DIR     # GPU: DIR/serve_<card>.json
    PYTHONPATH=src python benchmarks/bench_serve.py --smoke        # CPU, a tiny model, seconds

The model: hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632, vocab 32000
(TinyLlama-1.1B's shape), random weights, bf16 on the GPU (--smoke: hidden 64, 2 layers,
fp32 on the CPU). No tokenizer ships offline, so a byte-level BPE of the model's vocabulary
size is trained on the sampled conversations (`opswap.llm.tokenizer`): it counts the
prompt and reply tokens (each request asks for its reply's length, with ignore_eos), the
prompts are sent as its token ids, and the server detokenizes with it.

The peer: `model.generate` greedy, left-padded batches of 32 in the set's order, each
batch running to its longest reply (eos off), timed over its first --peer-prompts prompts;
its tokens/s counts only the tokens each prompt asked for, the useful ones.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _results import card, write_results  # noqa: E402


def _dims(smoke: bool) -> dict[str, int]:
    """The model's shape: TinyLlama-1.1B's on the GPU, a tiny one with --smoke."""
    if smoke:
        return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128, vocab_size=1000)  # fmt: skip
    return dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, intermediate_size=5632, vocab_size=32000)  # fmt: skip


def _model(smoke: bool, device: str, dtype: torch.dtype, max_len: int) -> Any:
    import transformers

    dims = _dims(smoke)
    torch.manual_seed(0)
    # room for the peer's padded batches (the engine takes max_model_len itself)
    cfg = transformers.LlamaConfig(**dims, max_position_embeddings=2 * max_len)
    return transformers.LlamaForCausalLM(cfg).eval().to(device, dtype)


def _cold_start(dims: dict[str, int], device: str, dtype: str, max_len: int) -> dict:
    """`opswap serve hf:llama` with the run's model shape started as a user starts it (a
    fresh process, CUDA graphs on where the device is CUDA): seconds from the process's
    start to /health answering and to the first streamed token of a one-token request."""
    import json
    import os
    import subprocess
    import urllib.request

    from opswap.llm.server import free_port

    port = free_port()
    sets = [f"--set={k}={v}" for k, v in dims.items()]
    cmd = [sys.executable, "-m", "opswap.cli", "serve", "hf:llama", *sets, "--port", str(port),
           "--device", device, "--dtype", dtype, "--max-model-len", str(max_len)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out: dict[str, Any] = {"command": " ".join(cmd[1:])}
    try:
        while True:
            if proc.poll() is not None:
                out["error"] = (proc.stdout.read() if proc.stdout else b"").decode()[-2000:]
                return out
            if time.perf_counter() - t0 > 600:
                out["error"] = "no answer on /health within 600 s"
                return out
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        out["to_health_s"] = time.perf_counter() - t0
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            name = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": [1, 2, 3, 4], "max_tokens": 1,
                           "stream": True}).encode()  # fmt: skip
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    out["to_first_token_s"] = time.perf_counter() - t0
                    break
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _peer(model: Any, reqs: list, batch: int, device: str) -> dict:
    """transformers' generate over `reqs` in batches (left padding): wall time and the
    useful tokens/s."""
    useful = generated = 0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        part = reqs[i : i + batch]
        width = max(r.prompt_len for r in part)
        ids = torch.zeros((len(part), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(part):
            ids[j, width - r.prompt_len :] = torch.tensor(r.prompt)
            mask[j, width - r.prompt_len :] = 1
        new = max(r.output_len for r in part)
        with torch.inference_mode():
            out = model.generate(
                ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        generated += (out.shape[1] - width) * len(part)
        useful += sum(r.output_len for r in part)
    sync()
    seconds = time.perf_counter() - t0
    return {
        "name": f"transformers generate, batch {batch}",
        "prompts": len(reqs),
        "seconds": seconds,
        "output_tokens": useful,
        "generated_tokens_with_padding": generated,
        "output_throughput": useful / seconds,
        "total_token_throughput": (useful + sum(r.prompt_len for r in reqs)) / seconds,
    }


def main() -> None:
    from opswap.llm import LLMEngine
    from opswap.llm import bench_serve as bs
    from opswap.llm.server import ServerThread, build_app

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, in seconds")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 1000 (smoke 16)")
    ap.add_argument("--peer-prompts", type=int, default=None, help="default 64 (smoke 8)")
    ap.add_argument("--peer-batch", type=int, default=None, help="default 32 (smoke 4)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (smoke 8)")
    ap.add_argument("--kv-gib", type=float, default=20.0, help="KV cache on the GPU, GiB")
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        torch.set_num_threads(1)
    n = args.num_prompts or (16 if smoke else 1000)
    n_peer = args.peer_prompts or (8 if smoke else 64)
    peer_batch = args.peer_batch or (4 if smoke else 32)
    max_seqs = args.max_num_seqs or (8 if smoke else 256)
    max_len = 256 if smoke else 2048
    model = _model(smoke, device, dtype, max_len)
    vocab = model.config.vocab_size

    t0 = time.perf_counter()
    reqs, tok = bs.sharegpt_requests(n, seed=0, max_model_len=max_len, vocab=vocab)
    print(f"{n} ShareGPT prompts, a BPE of {len(tok)} tokens trained on them in "
          f"{time.perf_counter() - t0:.1f} s; prompt tokens {sum(r.prompt_len for r in reqs)}, "
          f"output tokens asked {sum(r.output_len for r in reqs)}")  # fmt: skip

    engine = LLMEngine(
        model, block_size=16, max_model_len=max_len, max_num_seqs=max_seqs,
        max_num_batched_tokens=512 if smoke else 2048, device=device, dtype=dtype,
        kv_memory=None if smoke else int(args.kv_gib * 2**30),
    )  # fmt: skip
    app = build_app(engine, tok, "llama-1.1b" if not smoke else "llama-tiny", max_queue=n)
    with ServerThread(app) as url:
        asyncio.run(bs.run_benchmark(url, reqs[: min(8, n)]))  # warm-up
        # the client in its own process: its parsing must not take the server's GIL
        results, seconds = bs.run_benchmark_process(url, reqs)
        stats = app.state.driver.stats
    figures = bs.summarize(results, seconds)
    print(
        f"opswap serve: {figures['completed']}/{n} requests in {seconds:.1f} s, "
        f"{figures['request_throughput']:.2f} req/s, {figures['output_throughput']:.0f} output "
        f"tok/s, {figures['total_token_throughput']:.0f} total tok/s; TTFT median "
        f"{figures['ttft_ms']['median']:.0f} ms, TPOT median {figures['tpot_ms']['median']:.1f} "
        f"ms, ITL p99 {figures['itl_ms']['p99']:.1f} ms; blocks in use after: "
        f"{stats.blocks.in_use}; preemptions {stats.preemptions}"
    )
    peer = _peer(model, reqs[:n_peer], peer_batch, device)
    print(
        f"peer ({peer['name']}, first {n_peer} prompts): {peer['output_throughput']:.0f} "
        f"output tok/s in {peer['seconds']:.1f} s"
    )
    # the start-up bar: `opswap serve` to the first token in at most 15 s (1.1B)
    num_blocks = engine.num_blocks
    del engine, app
    if device == "cuda":
        torch.cuda.empty_cache()
    cold = _cold_start(_dims(smoke), device, "float32" if smoke else "bfloat16", max_len)
    print("opswap serve, from the process's start:", cold)
    rows = [
        {"name": "opswap serve", **figures, "blocks_in_use_after": stats.blocks.in_use,
         "preemptions": stats.preemptions, "num_blocks": num_blocks},
        peer,
    ]  # fmt: skip
    name = "serve_cpu_smoke.json" if smoke else f"serve_{card()}.json"
    dev = "cpu" if smoke else torch.cuda.get_device_name()
    write_results(
        args.out, name, dev, rows, smoke=smoke, num_prompts=n, peer_prompts=n_peer,
        peer_batch=peer_batch,
        max_num_seqs=max_seqs, max_model_len=max_len, block_size=16, dtype=str(dtype),
        model=dict(model.config.to_diff_dict()) if hasattr(model.config, "to_diff_dict") else {},
        ratio_output_throughput_vs_peer=figures["output_throughput"] / peer["output_throughput"],
        cold_start=cold,
    )  # fmt: skip


if __name__ == "__main__":
    main()
