"""The low-precision schemes on the GPU, end to end: bfloat16 whole models (bench_half) at
the sizes of the variants race, and `optimize --exactness lossy --rules 'precision.*'` on a
Llama-style decoder in bfloat16 at a decode-like shape, raced against torch.compile.

    PYTHONPATH=src python benchmarks/gpu_suite.py --only precision --out DIR

Writes DIR/precision_h200.json (device, versions, date, every figure).
"""

from __future__ import annotations

import time
import traceback

import torch

HALF_SPECS = [
    "hf:resnet?depths=[3,4,6,3]&hidden_sizes=[256,512,1024,2048]&embedding_size=64"
    "&layer_type=bottleneck&image_size=224&batch=64",
    "hf:bert?num_hidden_layers=12&hidden_size=768&num_attention_heads=12"
    "&intermediate_size=3072&max_position_embeddings=512&vocab_size=30522&batch=32&seq=128",
]
LLAMA = {
    "hidden_size": "2048",
    "intermediate_size": "5632",
    "num_hidden_layers": "4",
    "num_attention_heads": "32",
    "num_key_value_heads": "4",
    "vocab_size": "32000",
    "max_position_embeddings": "2048",
    "batch": "1",
    "seq": "16",
}


def lossy_llama(device: str = "cuda") -> dict:
    """optimize on the decoder in bfloat16: which schemes the plan takes, verification, and
    the race (input, opswap, compile, opswap+compile) in one interleaved run."""
    from opswap.config import OptimizeConfig
    from opswap.models import load
    from opswap.pipeline import optimize

    m = load("hf:llama", overrides=LLAMA)
    model = m.module.to(device, torch.bfloat16).eval()
    xs = tuple(t.to(device) for t in m.example_inputs)
    t0 = time.time()
    r = optimize(
        model,
        xs,
        OptimizeConfig(
            rules=["precision.*"],
            exactness="lossy",
            target="h200",
            device=device,
            samples=2,
            layers=False,
        ),
        name="hf:llama (bf16, 4 layers of the 1.1B shape)",
    )
    data = r.to_json()
    return {
        "model": "hf:llama",
        "overrides": LLAMA,
        "dtype": "bfloat16",
        "optimize_s": round(time.time() - t0, 1),
        "applied": sorted({a["rule"] for a in data["applied"]}),
        "sites": {
            k: sum(a["rule"] == k for a in data["applied"])
            for k in {a["rule"] for a in data["applied"]}
        },
        "skipped": data["skipped"][:20],
        "rolled_back": data["rolled_back"],
        "verification": {k: data["verification"][k] for k in ("passed", "cosine", "rel_l2")},
        "variants": data["variants"],
        "best": data["best"],
        "rule_timings": data.get("rule_timings"),
    }


def run(device: str = "cuda", parts: tuple[str, ...] = ("half", "llama")) -> dict:
    import bench_half

    out: dict = {}
    try:
        if "half" in parts:
            out["half"] = bench_half.run(device, HALF_SPECS)
    except Exception as e:
        out["half"] = {
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
    torch.cuda.empty_cache()
    try:
        if "llama" in parts:
            out["lossy_llama"] = lossy_llama(device)
    except Exception as e:
        out["lossy_llama"] = {
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
    return out
