"""Greedy decoding at batch 1 on the GPU: opswap's StaticDecoder (static KV cache, split-K
decode attention, the step as one CUDA graph) against transformers' ways of generating,
in one run, next to the memory-bandwidth roofline.

    PYTHONPATH=src python3 benchmarks/bench_decode.py --out DIR     # H200: DIR/decode_h200.json
    PYTHONPATH=src python benchmarks/bench_decode.py --smoke       # CPU, a tiny model, seconds

The model: a Llama-style 1.1B (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 kv
heads, intermediate 5632, vocab 32000) built from its config with random weights, bf16;
a 32-token prompt and 128 new tokens, batch 1. Variants, each timed end to end (prefill
and decode; median of a few calls after warm-up calls that compile and capture):

- hf_dynamic: `model.generate(do_sample=False)` with its default dynamic cache;
- hf_static_compile: `generate(cache_implementation="static")` on the GPU, where
  transformers compiles the decoding forward itself (its CompileConfig: inductor,
  mode="reduce-overhead"), as HF's docs advise; compiling the forward by hand on top of
  that makes CUDA graphs overwrite the logits generate still reads;
- gpt_fast: the gpt-fast recipe on the HF model: a transformers StaticCache and a decode
  step (forward of one token, argmax) under torch.compile(mode="reduce-overhead"), stepped
  by hand;
- opswap_eager: StaticDecoder without CUDA graphs (what the launches cost);
- opswap_graphs: StaticDecoder with the step captured as a CUDA graph;
- opswap_kernels: StaticDecoder with the step captured and kernels=True (opswap's fused
  add+RMSNorm, RoPE and SwiGLU Triton ops in place of HF's elementwise ops);
- opswap_compile: StaticDecoder with the step under torch.compile, then captured.

Roofline: a decode step at batch 1 must read every weight once (the embedding only one
row) and the KV cache so far; the device-to-device copy bandwidth of a large tensor,
measured in the same run, over those bytes bounds tokens/s, and each variant's share of
that bound is reported. opswap's greedy tokens are checked against hf_dynamic's: the
count of leading tokens that agree is recorded, not asserted (in bf16 two correct
implementations part ways after a near-tie, random weights giving many). So the logits
are also checked by teacher forcing (`teacher_forced`): opswap's decoder, with and
without kernels=True, stepped along HF's tokens, against HF's float32 forward, beside HF's
own bf16 forward measured the same way. A variant that fails records its error.
The JSON is rewritten after every variant, so a run cut short keeps what it measured;
opswap's variants run right after hf_dynamic (the reference tokens), the other peers after.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import inspect
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

#: TinyLlama-1.1B's shape
LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
    "vocab_size": 32000,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 128,
}


def _versions() -> dict:
    out = {}
    for pkg in ("torch", "triton", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mib: int) -> float:
    """GB/s of a device-to-device copy of `mib` MiB (bytes read + bytes written)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times) / 1e9


def step_bytes(model, cache_tokens: float) -> dict:
    """Bytes one decode step reads: every weight once (an untied embedding: one row) and
    the keys and values of `cache_tokens` positions in every layer."""
    c = model.config
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    weights = sum(seen.values())
    if emb.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        weights -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * emb.element_size()
    return {"weights": weights, "kv_cache": kv * cache_tokens}


def _time(gen: Callable[[], torch.Tensor], device: str, warm: int, reps: int) -> dict:
    for _ in range(warm):
        gen()
    _sync(device)
    times, tokens = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        tokens = gen()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"s_per_call": statistics.median(times), "tokens": tokens}


def _leading_match(a: torch.Tensor, b: torch.Tensor, prompt: int) -> int:
    """How many generated tokens agree from the first on (batch 1)."""
    x, y = a[0, prompt:].cpu(), b[0, prompt:].cpu()
    n = min(len(x), len(y))
    differ = (x[:n] != y[:n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def teacher_forced(model, ref: torch.Tensor, prompt: int, kernels: bool) -> dict:
    """The next-token logits of opswap's decoder along HF's own greedy tokens `ref`
    [1, T + n] (its prefill of the prompt, then one step per reference token: teacher
    forcing, so that a near-tie that sends two greedy runs apart does not hide how close
    their logits are), against HF's forward over `ref` in float32; HF's forward in the
    model's dtype is measured the same way, as the model's own rounding. Per row: the
    lowest cosine over the n positions, the relative L2 of all of them, and the share of
    positions whose argmax agrees with float32's."""
    import copy

    import torch.nn.functional as F

    from opswap.llm.hf_decoder import HFDecoder

    n = ref.shape[1]
    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        f32 = copy.deepcopy(model).float()
        want = f32(ref).logits[0, prompt - 1 : n - 1].float()
        del f32
        own = model(ref).logits[0, prompt - 1 : n - 1].float()
        net = HFDecoder(model, n, ref.device, dtype, kernels=kernels)
        cache = net.new_cache(1, n)
        got = [net.prefill(ref[:, :prompt], cache)[0, -1]]
        for i in range(prompt, n - 1):
            got.append(net.step(ref[:, i : i + 1], cache)[0])
        ours = torch.stack(got).float()

    def stats(x: torch.Tensor) -> dict:
        return {
            "min_cosine": F.cosine_similarity(x, want, dim=-1).min().item(),
            "rel_l2": ((x - want).norm() / want.norm()).item(),
            "argmax_agrees": (x.argmax(-1) == want.argmax(-1)).float().mean().item(),
        }

    return {"kernels": kernels, "ours": stats(ours), "hf_own_dtype": stats(own)}


def _forward_kw(model) -> str:
    """The name of the forward's cache argument (transformers 5: `cache`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def variants(model, ids: torch.Tensor, n_new: int, smoke: bool) -> dict[str, Callable]:
    """name -> a call that returns prompt + n_new greedy tokens [1, T + n_new]."""
    from transformers import StaticCache

    from opswap.llm import StaticDecoder

    t = ids.shape[1]
    max_len = t + n_new
    greedy = {
        "max_new_tokens": n_new,
        "min_new_tokens": n_new,
        "do_sample": False,
        "eos_token_id": None,
        "attention_mask": torch.ones_like(ids),
    }
    # a CPU smoke run has no CUDA graphs and no C++ build: aot_eager stands in for inductor
    compile_kw = {"backend": "aot_eager"} if smoke else {"mode": "reduce-overhead"}

    def hf_dynamic():
        return model.generate(ids, **greedy)

    from transformers import CompileConfig

    # transformers compiles the decoding forward of a static cache itself, on a GPU; on the
    # CPU only when told to (its private _compile_all_devices flag, a smoke run's stand-in)
    hf_compile = CompileConfig(fullgraph=True)
    if smoke:
        hf_compile = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        hf_compile._compile_all_devices = True

    def hf_static_compile():
        return model.generate(
            ids, cache_implementation="static", compile_config=hf_compile, **greedy
        )

    kw = _forward_kw(model)
    peer: dict = {}

    def gpt_fast():
        if "step" not in peer:

            def step(tok, pos, cache):
                logits = model(tok, **{kw: cache}, position_ids=pos, use_cache=True).logits
                return logits[:, -1].argmax(-1, keepdim=True)

            peer["step"] = torch.compile(step, fullgraph=True, **compile_kw)
            peer["cache"] = StaticCache(config=model.config, max_cache_len=max_len)
        cache = peer["cache"]
        cache.reset()
        pos = torch.arange(t, device=ids.device)[None]
        with torch.no_grad():
            out = model(ids, **{kw: cache}, position_ids=pos, use_cache=True).logits
            tok = out[:, -1].argmax(-1, keepdim=True)
            toks = [ids, tok]
            for i in range(n_new - 1):
                pos = torch.full((1, 1), t + i, device=ids.device, dtype=torch.int64)
                tok = peer["step"](tok, pos, cache).clone()  # a graph's output is reused
                toks.append(tok)
        return torch.cat(toks, 1)

    decoders: dict = {}

    def opswap(name: str, **kwargs) -> Callable:
        def run():
            if name not in decoders:
                decoders[name] = StaticDecoder(model, max_len=max_len, **kwargs)
            return decoders[name].generate(ids, n_new)

        return run

    return {  # the reference first, then ours, then the peers that compile longest
        "hf_dynamic": hf_dynamic,
        "opswap_eager": opswap("opswap_eager", cuda_graphs=False, kernels=False),
        "opswap_graphs": opswap("opswap_graphs", cuda_graphs=True, kernels=False),
        "opswap_kernels": opswap("opswap_kernels", cuda_graphs=True, kernels=True),
        "opswap_compile": opswap(
            "opswap_compile",
            cuda_graphs=True,
            kernels=False,
            compile="aot_eager" if smoke else True,
        ),
        "gpt_fast": gpt_fast,
        "hf_static_compile": hf_static_compile,
    }


def run(
    smoke: bool = False,
    on_row: Callable[[dict], None] | None = None,
    only: set[str] | None = None,
    reps: int = 0,
) -> dict:
    """The run's record; `on_row(record)` after every variant (to write it as it grows)."""
    import transformers

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    prompt, n_new = (8, 8) if smoke else (32, 128)
    warm, reps = (1, 1) if smoke else (2, reps or 5)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**(TINY if smoke else LLAMA_1B))
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device=device)
    bw = copy_bandwidth(device, 64 if smoke else 4096)
    nbytes = step_bytes(model, prompt + n_new / 2)  # the cache's mean length over the run
    per_step = nbytes["weights"] + nbytes["kv_cache"]
    bound = bw * 1e9 / per_step
    res: dict = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        **_versions(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "dtype": str(dtype),
        "model": {"config": TINY if smoke else LLAMA_1B, "weights": "random"},
        "batch": 1,
        "prompt_tokens": prompt,
        "new_tokens": n_new,
        "timing": f"end to end (prefill + decode), median of {reps} after {warm} warm-up",
        "copy_bandwidth_gbs": bw,
        "step_bytes": nbytes,
        "roofline_tokens_per_s": bound,
        "rows": [],
    }
    reference = None
    for name, gen in variants(model, ids, n_new, smoke).items():
        if only and name not in only and name != "hf_dynamic":  # the reference always runs
            continue
        row: dict = {"name": name}
        try:
            with torch.inference_mode(name.startswith("opswap")):
                got = _time(gen, device, warm, reps)
            tps = n_new / got["s_per_call"]
            row.update(
                tokens_per_s=tps,
                ms_per_token=got["s_per_call"] / n_new * 1e3,
                share_of_roofline=tps / bound,
            )
            if name == "hf_dynamic":
                reference = got["tokens"]
            elif reference is not None:
                row["tokens_equal_hf_for"] = _leading_match(got["tokens"], reference, prompt)
        except Exception as e:  # one variant's failure must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:600]
            row["trace"] = traceback.format_exc()[-1500:]
            if device == "cuda":
                torch.cuda.synchronize()
        finally:
            for attr in ("_compiled_call", "_last_compile_config"):  # generate's compile
                model.__dict__.pop(attr, None)
            torch._dynamo.reset()
        print({k: v for k, v in row.items() if k != "trace"}, flush=True)
        res["rows"].append(row)
        if on_row is not None:
            on_row(res)
    if reference is not None:
        res["teacher_forced"] = []
        for kernels in (False, True):
            try:
                res["teacher_forced"].append(teacher_forced(model, reference, prompt, kernels))
            except Exception as e:  # the check's failure must not lose the timings
                res["teacher_forced"].append({"kernels": kernels, "error": f"{e}"[:600]})
            print(res["teacher_forced"][-1], flush=True)
        if on_row is not None:
            on_row(res)
    return res


def table(res: dict) -> str:
    out = [
        f"roofline {res['roofline_tokens_per_s']:.0f} tok/s "
        f"(copy {res['copy_bandwidth_gbs']:.0f} GB/s, {res['step_bytes']['weights'] / 1e9:.3f} "
        "GB of weights a step)",
        "| variant | tok/s | ms/token | share of roofline | tokens equal to HF |",
        "|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            out.append(f"| {r['name']} | error: {r['error'][:80]} | | | |")
            continue
        out.append(
            f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.3f} | "
            f"{r['share_of_roofline']:.1%} | {r.get('tokens_equal_hf_for', '-')} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, in seconds")
    ap.add_argument(
        "--variants",
        default="",
        help="comma-separated variant names to run (hf_dynamic, the reference, always runs)",
    )
    ap.add_argument("--reps", type=int, default=0, help="timed calls a variant (default 5)")
    args = ap.parse_args()
    only = {v for v in args.variants.split(",") if v} or None
    from _results import write_kernel_run

    res = run(
        args.smoke,
        lambda r: write_kernel_run(r, args.out, "decode", args.smoke, False),
        only,
        args.reps,
    )
    print(table(res))


if __name__ == "__main__":
    main()
