"""Greedy decoding on the CPU: opswap's StaticDecoder against transformers' generate, in
one interleaved run.

    PYTHONPATH=src python benchmarks/bench_decode_cpu.py                # results/decode_cpu.json
    PYTHONPATH=src python benchmarks/bench_decode_cpu.py --rounds 3 --new 16 --out /tmp/x

The model is the one of the new-user repro (j3_llm.py): a Llama config with hidden 256,
4 layers, 8 query heads over 2 kv heads, intermediate 688, vocab 2000, random weights
(initializer_range 0.1), float32; a 12-token prompt, 64 new tokens, batch 1 (`--batch`).
Contenders, each a full call (prefill and decode) that returns prompt + new tokens:

- hf_dynamic: `model.generate(do_sample=False)` with its default dynamic cache;
- hf_static: the same with `cache_implementation="static"` (no compile: transformers
  compiles only on accelerators unless told to);
- hf_static_compile: the same with `compile_config=CompileConfig(...)` forcing its
  torch.compile of the decoding forward on the CPU (`_compile_all_devices`, the flag
  transformers documents for that); skipped with a note when compiling fails here;
- opswap: `StaticDecoder` eager (its CPU step, opswap/llm/cpu_step.py);
- opswap_compile: `StaticDecoder(compile=True)`, the CPU step under torch.compile.

Timing: the two CPU cores of the development machine are shared with other work, so the
contenders run interleaved: each round calls every contender once, in an order that
rotates per round, and the figure that counts is the ratio of tokens/s within a round
(opswap's over each HF variant's), summarised by its median over the rounds; the median
tokens/s per contender is reported too. Every contender gets the same
`torch.set_num_threads` (2 unless `--threads`). Warm-up calls (compilation included)
come first and are not timed. The greedy tokens of every contender are compared with
hf_dynamic's (all of them must agree in float32; the count that does is recorded).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
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

#: the model of /work/shared/repros/new-user/j3_llm.py
CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "vocab_size": 2000,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def _versions() -> dict:
    out = {}
    for pkg in ("torch", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def contenders(model, ids: torch.Tensor, n_new: int) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a call returning prompt + n_new greedy tokens [B, T + n_new]."""
    import transformers

    from opswap.llm import StaticDecoder

    greedy = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": n_new,
        "do_sample": False,
        "eos_token_id": None,
    }
    max_len = ids.shape[1] + n_new
    ours = StaticDecoder(model, max_len=max_len, batch=ids.shape[0])
    ours_c = StaticDecoder(model, max_len=max_len, batch=ids.shape[0], compile=True)
    compile_cfg = transformers.CompileConfig()
    compile_cfg._compile_all_devices = True
    return {
        "hf_dynamic": lambda: model.generate(ids, **greedy),
        "hf_static": lambda: model.generate(ids, cache_implementation="static", **greedy),
        "hf_static_compile": lambda: model.generate(
            ids, cache_implementation="static", compile_config=compile_cfg, **greedy
        ),
        "opswap": lambda: ours.generate(ids, n_new),
        "opswap_compile": lambda: ours_c.generate(ids, n_new),
    }


def agree(a: torch.Tensor, b: torch.Tensor, prompt: int) -> int:
    """How many generated tokens agree, row by row from the first on (summed over rows)."""
    total = 0
    for x, y in zip(a[:, prompt:].tolist(), b[:, prompt:].tolist(), strict=True):
        total += next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="decode_cpu.json")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    args = ap.parse_args()

    import transformers
    from _results import write_results

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    ids = torch.randint(3, CONFIG["vocab_size"], (args.batch, args.prompt))
    calls = contenders(model, ids, args.new)
    if args.only:
        keep = {"hf_dynamic", *args.only.split(",")}
        calls = {k: v for k, v in calls.items() if k in keep}

    notes: dict[str, str] = {}
    tokens: dict[str, torch.Tensor] = {}
    for name, call in list(calls.items()):  # warm-up (compilation), and the tokens
        try:
            with torch.inference_mode():
                for _ in range(args.warm):
                    tokens[name] = call()
        except Exception as e:  # a contender that cannot run here is recorded, not fatal
            notes[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            traceback.print_exc()
            del calls[name]
            print(f"{name}: skipped ({notes[name]})")

    load_before = os.getloadavg()
    times: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            with torch.inference_mode():
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
        print(
            f"round {r + 1}: "
            + ", ".join(f"{k} {args.batch * args.new / times[k][-1]:.0f}" for k in names)
            + " tokens/s"
        )
    load_after = os.getloadavg()

    n_tok = args.batch * args.new
    ref = tokens["hf_dynamic"]
    rows = []
    for name in names:
        rate = [n_tok / s for s in times[name]]
        rows.append(
            {
                "name": name,
                "tokens_per_s_median": statistics.median(rate),
                "tokens_per_s_rounds": [round(x, 2) for x in rate],
                "tokens_agree_with_hf_dynamic": agree(tokens[name], ref, args.prompt),
                "tokens_generated": n_tok,
            }
        )
    ratios = {}
    for ours in ("opswap", "opswap_compile"):
        for peer in ("hf_dynamic", "hf_static", "hf_static_compile"):
            if ours in times and peer in times:
                per_round = [p / o for o, p in zip(times[ours], times[peer], strict=True)]
                ratios[f"{ours}/{peer}"] = {
                    "median": statistics.median(per_round),
                    "min": min(per_round),
                    "max": max(per_round),
                    "rounds": [round(x, 3) for x in per_round],
                }
    for k, v in ratios.items():
        print(f"{k}: median {v['median']:.2f}x (rounds {v['min']:.2f}-{v['max']:.2f})")
    write_results(
        args.out,
        args.name,
        f"cpu: {cpu_name()}",
        rows,
        versions=_versions(),
        threads=args.threads,
        cpu_count=os.cpu_count(),
        load_average_before_after=[load_before, load_after],
        model_config=CONFIG,
        prompt=args.prompt,
        new_tokens=args.new,
        batch=args.batch,
        rounds=args.rounds,
        ratios=ratios,
        skipped=notes,
    )


if __name__ == "__main__":
    main()
