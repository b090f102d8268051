"""Everything that needs the GPU, in one call (the device machine is lent by the minute).

    PYTHONPATH=src python3 benchmarks/gpu_suite.py --out DIR

1. the test suite under the GPU machine's torch (a second torch version for CI's
   CPU-only run; tests with CUDA paths take them here),
2. measured ceilings of the GPU next to the target profile's datasheet figures,
3. the variants race in bfloat16 (input, capture, opswap, torch.compile of the input and
   of opswap's result, verified and timed in one interleaved loop) on a ResNet-50-like
   and a BERT-base-like model,
4. `optimize` on zoo and Hugging Face models with timing on the GPU, reference and
   optimized interleaved in one process.

Writes DIR/gpu_suite.json (device, versions, date, every figure) and the pytest log.
Commit the JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def env() -> dict:
    d = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu_count": os.cpu_count(),
    }
    for mod in ("triton", "transformers", "onnxruntime"):
        try:
            d[mod] = __import__(mod).__version__
        except Exception:  # optional
            d[mod] = None
    return d


def run_tests(out: Path, workers: int, paths: list[str]) -> dict:
    log = out / "pytest.log"
    t0 = time.time()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        str(workers),
        *[str(ROOT / p) for p in paths],
    ]
    with open(log, "w") as f:
        rc = subprocess.call(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            # the carried peers' wheels (Liger-Kernel, ...) stay importable after src
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])
                ),
            },
        )
    tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
    return {
        "returncode": rc,
        "summary": tail[0] if tail else "",
        "paths": paths,
        "seconds": round(time.time() - t0, 1),
    }


def ceilings() -> dict:
    """bf16/fp32 matmul FLOP/s and copy bandwidth, next to the h200 target's figures."""
    from opswap.bench.timing import benchmark
    from opswap.targets import get_target

    dev = "cuda"
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    af, bf = a.float(), b.float()
    x = torch.empty(2 * 1024**3 // 4, device=dev)  # 2 GiB
    y = torch.empty_like(x)
    torch.backends.cuda.matmul.allow_tf32 = False
    r = benchmark(
        {"bf16": lambda: a @ b, "fp32": lambda: af @ bf, "copy": lambda: y.copy_(x)},
        device=dev,
        warmup=3,
        repeats=10,
    )
    med = {k: r.stats[k].median_s for k in ("bf16", "fp32", "copy")}
    t = get_target("h200")
    return {
        "bf16_matmul_tflops": 2 * n**3 / med["bf16"] / 1e12,
        "fp32_matmul_tflops": 2 * n**3 / med["fp32"] / 1e12,
        "copy_tb_s": 2 * x.numel() * 4 / med["copy"] / 1e12,
        "target_h200_bf16_tflops": t.peak("bfloat16") / 1e12,
        "target_h200_fp32_tflops": t.peak("float32") / 1e12,
        "target_h200_tb_s": t.mem_bandwidth / 1e12,
    }


# the tests of the Triton norm and gated-activation kernels and their rules (and the
# launch contracts every kernel keeps)
KERNEL_TESTS = [
    "tests/kernels/test_rms_norm.py",
    "tests/kernels/test_layer_norm.py",
    "tests/kernels/test_group_norm.py",
    "tests/kernels/test_launch_contract.py",
    "tests/kernels/test_swiglu.py",
    "tests/kernels/test_activation.py",
    "tests/kernels/test_crossover.py",
    "tests/rules/norm",
    "tests/rules/activation",
]

# the tests of the issue-18 kernels (softmax, reductions, RoPE, CUDA bias + GELU) and rules
KERNEL18_TESTS = [
    "tests/kernels/test_softmax.py",
    "tests/kernels/test_reduction.py",
    "tests/kernels/test_rope.py",
    "tests/kernels/test_bias_gelu_cuda.py",
    "tests/rules/softmax",
    "tests/rules/reduce",
    "tests/rules/fusion/test_rope.py",
]

# the FlashAttention kernel (its interpreter cases run compiled on the GPU) and its rule
ATTENTION_TESTS = [
    "tests/kernels/test_flash_attention.py",
    "tests/rules/attention",
]

# the split-K decode-attention kernel and the static-cache decoder (CUDA graphs on the GPU)
DECODE_TESTS = [
    "tests/kernels/test_decode_attention.py",
    "tests/llm",
]

# the bias + activation kernel (its interpreter cases run compiled on the GPU), its rule and
# its ONNX lowering
ACTIVATION_TESTS = [
    "tests/kernels/test_activation.py",
    "tests/kernels/test_launch_contract.py",
    "tests/kernels/test_crossover.py",
    "tests/rules/activation",
    "tests/backends/test_lowerings.py",
]
# the activation rules; with a GPU the Linear epilogue test also runs its rewrite on CUDA
EPILOGUE_TESTS = ["tests/rules/activation", "tests/backends/test_lowerings.py"]

#: the width sweep's widths (non-powers of two among them)
WIDTHS = "768,2048,3072,5120,8192,16384"

#: --only parts that run a test list on the GPU, then benchmark scripts (with arguments)
KERNEL_PARTS: dict[str, tuple[list[str], list[list[str]]]] = {
    "kernels": (KERNEL_TESTS, [["bench_norm_kernels.py"]]),
    "kernels18": (KERNEL18_TESTS, [["bench_kernels18.py"]]),
    "attention": (ATTENTION_TESTS, [["bench_attention.py"]]),
    "decode": (DECODE_TESTS, [["bench_decode.py"]]),
    # issue 46: tensor-parallel serving on 2 GPUs (NEEDS a multi-GPU kind, nvidia-h100-x2):
    # NCCL tokens against one GPU, then throughput and batch-1 latency of 2 GPUs against 1
    "tp": (["tests/llm/test_tensor_parallel.py"], [["bench_tp.py", "--tp", "2"]]),
    # serving engine (ch29); then decode tokens/s with bf16 / int8 / int4 / fp8 projections
    "engine": (
        ["tests/llm/test_engine.py", "tests/llm/test_quant_runner.py"],
        [["bench_engine.py"], ["bench_engine.py", "--part", "weights"]],
    ),
    # opswap serve under 1000 ShareGPT prompts at once beside transformers generate (ch29)
    "serve": (["tests/llm/test_server.py"], [["bench_serve.py"]]),
    # issue 41: the paged decode and chunked-prefill kernels (compiled on the GPU) and their sweep
    "paged": (["tests/kernels/test_paged_attention.py"], [["bench_paged_attention.py"]]),
    "activation": (ACTIVATION_TESTS, [["bench_activation.py"]]),
    # issue 42: opswap::topk on the GPU (tests), its 460-case grid against torch.topk and
    # torch.compile (rewrites the crossover table), and the table-batched embedding bags
    "topk": (
        ["tests/kernels/test_topk.py", "tests/rules/topk"],
        [["bench_topk.py", "--update-crossover"]],
    ),
    "embedding": (
        ["tests/kernels/test_embedding_bag.py", "tests/rules/embedding"],
        [["bench_embedding.py"]],
    ),
    "epilogue": (EPILOGUE_TESTS, [["bench_epilogue.py"]]),
    # issue 40: opswap::gemm against cuBLAS / torch.compile (square, LLM, odd, FP8, TF32), each
    # variant (tiled, persistent TMA, split-K) timed; rewrites kernels/gemm_launch.json
    "gemm": (
        ["tests/kernels/test_gemm.py", "tests/rules/matmul"],
        [["bench_gemm.py", "--update-crossover"]],
    ),
    # chapter 11's lossy decompositions: each chain against its conv under cuDNN, batch 1 and 8
    "conv_decompose": (
        ["tests/rules/conv/test_decompose.py"],
        [["bench_conv_decompose.py", "--device", "cuda", "--skip-accuracy"]],
    ),
    # every row kernel's tests, then their sweeps (eager and CUDA-graph times) rewriting the
    # crossover table, and the Llama end to end against torch.compile
    "rows": (
        KERNEL_TESTS + KERNEL18_TESTS,
        [
            ["bench_norm_kernels.py", "--update-crossover"],
            ["bench_kernels18.py", "--update-crossover"],
            ["bench_llama_kernels.py"],
        ],
    ),
    # launch choices and candidate rewrites of the row kernels beside today's (no tests)
    "tune": ([], [["tune_rows.py"]]),
    # issue 44: the joint search against greedy on the GPU, torch.compile max-autotune as
    # the peer (its compile time and speed-up beside the search's; writes search_cuda.json)
    "search": (
        ["tests/tuning/test_search.py"],
        [["bench_search.py", "--device", "cuda", "--peer", "--time", "2"]],
    ),
    # the width sweep (768 to 16384 at 4096 rows) of the norms, SwiGLU, softmax and
    # the row reductions against torch.compile and Liger, rewriting the crossover table
    "widths": (
        [],
        [
            ["bench_norm_kernels.py", "--update-crossover", "--widths", WIDTHS],
            ["bench_kernels18.py", "--update-crossover", "--widths", WIDTHS],
        ],
    ),
    # `_int4_gemv`'s launch per shape chosen in a graph of dependent launches, and the
    # decode stacks with the measured table (writes tune_int4_<card>.json)
    "tune_int4": (["tests/kernels/test_weight_only.py"], [["tune_int4.py"]]),
    # the decode stacks alone with the committed table (writes tune_int4_stacks_<card>.json)
    "int4_stacks": ([], [["tune_int4.py", "--stacks-only"]]),
    # issue 40, chapters 5 and 13: parallel convs / batched matmuls and the pooling layers
    # against the original, on the GPU (writes big_ops_<card>.json and pooling_<card>.json)
    "bigops": (
        [],
        [
            ["bench_big_ops.py", "--device", "cuda"],
            ["bench_pooling.py", "--device", "cuda", "--skip-accuracy"],
        ],
    ),
    # issue 37 §5: where the host time of one eager call of a row op goes, layer by layer
    "host": ([], [["bench_host_overhead.py"]]),
    # the backward kernels alone (GPU time) per launch choice, and the host's cost of a call
    "backward": (
        KERNEL_TESTS[:3],
        [["bench_row_backward.py", "--sweep", "--update-table", "--host"]],
    ),
    # issue 42, chapter 7: 2:4 and BSR on the GPU (tests), then 2:4 / torchao / FP8+2:4 / BSR
    # against dense at ViT-H MLP shapes and the MLP stack end to end, and structured pruning
    # against Torch-Pruning (writes sparsity_<card>.json and pruning_<card>.json)
    "sparsity": (
        ["tests/rules/sparsity", "tests/train/test_prune.py"],
        [["bench_sparsity.py", "--device", "cuda"], ["bench_pruning.py", "--device", "cuda"]],
    ),
    # issue 40: the convolution algorithms' tests and their per-layer race against cuDNN
    "conv": (
        [
            "tests/kernels/test_conv_fft.py",
            "tests/kernels/test_conv_im2col.py",
            "tests/rules/conv/test_algorithm.py",
        ],
        [["bench_conv.py"]],
    ),
    # issue 40: Winograd F(2,3)/F(4,3), Triton products against float64, then per-layer
    # times against cuDNN in bf16/fp16 and the digits each keeps
    "winograd": (["tests/kernels/test_conv_winograd.py"], [["bench_winograd.py"]]),
    # issue 42 (ch19): opswap::lstm_seq / gru_seq compiled (split hidden blocks, CUDA graphs),
    # the rules, then cell loop vs cuDNN vs the kernel vs compile, rewriting the crossover
    "rnn": (
        ["tests/kernels/test_rnn_cell.py", "tests/rules/rnn"],
        [["bench_rnn.py", "--device", "cuda", "--update-crossover"]],
    ),
    # issue 43, chapter 27: fused linear + cross-entropy and the fused AdamW, their tests on
    # the GPU, then each against its peers (writes lce_<card>.json and adamw_<card>.json)
    "lce": (
        ["tests/kernels/test_linear_cross_entropy.py", "tests/kernels/test_adamw.py"],
        [["bench_lce.py"], ["bench_adamw.py"]],
    ),
    # issue 43: train.prepare's tests, then one training step of a Llama-style 1B (bf16, seq
    # 2048) raced: eager, compile, opswap, opswap+compile and Liger (train_step_<card>.json)
    "train": (
        [
            "tests/train/test_prepare.py",
            "tests/train/test_verify_grads.py",
            "tests/train/test_train_race.py",
            "tests/train/test_precision.py",  # bf16/fp16 on CUDA, fp8 where CC >= 8.9
        ],
        # then a float32 Llama-style 350M's step in float32, bf16 and fp8
        # (train_precision_<card>.json)
        [["bench_train_step.py"], ["bench_train_precision.py"]],
    ),
    # issue 46: the DDP/FSDP2 tests (gloo on the CPU), then the Llama-style 1B's DDP step at
    # 1 and N GPUs, eager/compile/opswap/opswap+compile (ddp_<card>x<N>.json). Needs a
    # multi-GPU kind (nvidia-h100-x2 or larger): bench_ddp.py stops on fewer than 2 GPUs
    "ddp": (["tests/train/test_distributed.py"], [["bench_ddp.py"]]),
}

# the tests with CUDA paths of the low-precision schemes
#: issue 37: the race on torchvision ResNet-50 and BERT-base in bf16 saves the fastest
#: verified variant, and it reloads (one pytest worker: the races must not overlap)
RACE_TESTS = [
    "tests/bench/test_gpu_race.py",
    "tests/backends/test_cudagraph.py",
    "tests/backends/test_eager.py",  # the loaded program's direct calls, on CUDA
]

PRECISION_TESTS = [
    "tests/kernels/test_weight_only.py",
    "tests/kernels/test_fp8_linear.py",
    "tests/rules/precision",
    "tests/verify/test_mixed.py",
]

MODELS = [
    ("zoo:resnet", {"batch": "32"}),
    ("zoo:mobilenet", {"batch": "32"}),
    ("zoo:largekernel", {"batch": "16"}),
    ("zoo:bert", {}),
    ("zoo:gpt", {}),
    ("hf:bert", {}),
    ("hf:resnet", {}),
]


def optimize_models(device: str, target: str) -> list[dict]:
    from opswap.config import OptimizeConfig
    from opswap.models import load
    from opswap.pipeline import optimize

    rows = []
    for spec, sets in MODELS:
        row: dict = {"model": spec, "overrides": sets, "device": device}
        try:
            m = load(spec, sets)
            res = optimize(
                m.module,
                m.example_inputs,
                OptimizeConfig(target=target, device=device, layers=False),
                name=spec,
            )
            data = res.to_json()
            row.update(
                {
                    "applied": len(data["applied"]),
                    "rules": sorted({a["rule"] for a in data["applied"]}),
                    "verification": {
                        k: data["verification"][k]
                        for k in ("passed", "cosine", "max_abs", "rel_l2")
                    },
                    "benchmark": data["benchmark"],
                    "skipped": data["skipped"],
                    "rolled_back": data["rolled_back"],
                }
            )
        except Exception as e:  # one model failing must not lose the others' figures
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-2000:]
        print(
            json.dumps(
                {k: row.get(k) for k in ("model", "device", "applied", "benchmark", "error")}
            ),
            flush=True,
        )
        rows.append(row)
    return rows


# Sizes of the measurements: a ResNet-50-like CNN at batch 64 (224x224) and a
# BERT-base-like encoder at batch 32, sequence 128, both in bfloat16.
VARIANT_MODELS = [
    (
        "hf:resnet",
        {
            "depths": "[3,4,6,3]",
            "hidden_sizes": "[256,512,1024,2048]",
            "embedding_size": "64",
            "layer_type": "bottleneck",
            "image_size": "224",
            "batch": "64",
        },
    ),
    (
        "hf:bert",
        {
            "num_hidden_layers": "12",
            "hidden_size": "768",
            "num_attention_heads": "12",
            "intermediate_size": "3072",
            "max_position_embeddings": "512",
            "vocab_size": "30522",
            "batch": "32",
            "seq": "128",
            "attn_implementation": "sdpa",
        },
    ),
]


#: issue 19's end-to-end row: BERT-base with transformers' eager (hand-written) attention,
#: which `attention.sdpa` replaces
ATTENTION_E2E_MODELS = [
    ("hf:bert", {**VARIANT_MODELS[1][1], "attn_implementation": "eager"}),
]


#: issue 40's end-to-end rows: torchvision ResNet-50 and ConvNeXt-T (large depthwise
#: kernels), bf16, batch 64; the race holds input, opswap, compile, opswap+compile and
#: their CUDA-graph forms (the issue: opswap without compile at most compile's time, and
#: opswap+compile at least 1.25x compile in the same run)
CONV_E2E_MODELS = [
    ("torchvision:resnet50", {"batch": "64"}),
    ("torchvision:convnext_tiny", {"batch": "64"}),
]


def variants_table(device: str, target: str, dtype: str, models: list | None = None) -> list[dict]:
    """The variants race (input, capture, opswap, torch.compile of each) per model."""
    from opswap.config import OptimizeConfig
    from opswap.models import load
    from opswap.pipeline import optimize

    dt_ = getattr(torch, dtype)
    rows = []
    for spec, sets in VARIANT_MODELS if models is None else models:
        row: dict = {"model": spec, "overrides": sets, "device": device, "dtype": dtype}
        try:
            m = load(spec, sets)
            module = m.module.to(dt_)
            inputs = tuple(x.to(dt_) if x.is_floating_point() else x for x in m.example_inputs)
            t0 = time.time()
            res = optimize(
                module,
                inputs,
                OptimizeConfig(target=target, device=device, layers=False, samples=2),
                name=spec,
            )
            data = res.to_json()
            row.update(
                {
                    "seconds": round(time.time() - t0, 1),
                    "variants": data["variants"],
                    "best": data["best"],
                    "applied": len(data["applied"]),
                    "rules": sorted({a["rule"] for a in data["applied"]}),
                    "verification": {
                        k: data["verification"][k] for k in ("passed", "cosine", "rel_l2", "shapes")
                    },
                    "tolerance": data["verification"]["tolerance"],
                    "dynamic": data["dynamic"],
                    "rolled_back": data["rolled_back"],
                    "skipped": data["skipped"],
                }
            )
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-3000:]
        print(
            json.dumps(
                {k: row.get(k) for k in ("model", "best", "variants", "error")}, default=str
            ),
            flush=True,
        )
        rows.append(row)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def capture_cost(device: str, dtype: str) -> list[dict]:
    """Why a captured or exported graph may run slower than its module: the same model as
    eager, FX capture, torch.export's module() (with its guard function) and opswap's
    trimmed reload of the saved program, timed in one interleaved run, with the kernels
    each launches (profiler) and the device's per-op dispatch cost."""
    import tempfile

    from opswap.api import capture
    from opswap.backends.pt2 import export, load
    from opswap.bench.timing import benchmark
    from opswap.models import load as load_spec
    from opswap.targets.cpu import measure_dispatch

    dt_ = getattr(torch, dtype)
    rows = [
        {
            "dispatch_s": measure_dispatch(device),
            "view_dispatch_s": measure_dispatch(device, view=True),
            "device": device,
        }
    ]
    for spec, sets in VARIANT_MODELS:
        row: dict = {"model": spec, "dtype": dtype}
        try:
            m = load_spec(spec, sets)
            module = m.module.to(dt_).to(device)
            inputs = tuple(
                (x.to(dt_) if x.is_floating_point() else x).to(device) for x in m.example_inputs
            )
            cap = capture(module, inputs)  # FX where it traces, else torch.export
            row["capture_method"] = cap.method
            ep, _ = export(module, inputs, None)
            path = Path(tempfile.mkdtemp()) / "m.pt2"
            torch.export.save(ep, str(path))
            fns = {
                "eager": module,
                f"captured ({cap.method})": cap.gm,
                "export.module()": ep.module(),
                "reloaded, trimmed": load(path),
            }
            with torch.inference_mode():
                res = benchmark(
                    {k: (lambda f=f, xs=inputs: f(*xs)) for k, f in fns.items()},
                    warmup=3,
                    repeats=15,
                    min_time_s=1.0,
                    device=device,
                )
                row["ms"] = {k: res[k].median * 1e3 for k in fns}
                row["iqr_ms"] = {k: res[k].iqr * 1e3 for k in fns}
                kernels = {}
                for k, f in fns.items():
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        f(*inputs)
                        torch.cuda.synchronize()
                    ev = prof.key_averages()
                    gpu = [
                        e
                        for e in ev
                        if getattr(e, "device_type", None) is not None
                        and "CUDA" in str(e.device_type)
                    ]
                    kernels[k] = {
                        "cuda_kernels": sum(e.count for e in gpu),
                        "cuda_time_ms": sum(getattr(e, "self_device_time_total", 0) for e in gpu)
                        / 1e3,
                        "top": sorted(
                            (
                                (e.key, round(getattr(e, "self_device_time_total", 0) / 1e3, 3))
                                for e in gpu
                            ),
                            key=lambda t: -t[1],
                        )[:8],
                    }
                row["profile"] = kernels
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-3000:]
        print(json.dumps(row, default=str)[:3000], flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def int8_tables(out: Path) -> dict:
    """benchmarks/bench_int8_linear.py on each device here; its JSON files land in `out`."""
    done = {}
    for dev in (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]:
        run = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks/bench_int8_linear.py"),
                "--device",
                dev,
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
            timeout=900,
        )
        done[dev] = {"rc": run.returncode, "tail": (run.stdout + run.stderr)[-3000:]}
        if dev == "cpu" and (out / "int8_linear_cpu.json").is_file():
            # the GPU machine's host CPU, kept apart from the development machine's table
            (out / "int8_linear_cpu.json").replace(out / "int8_linear_cpu_h200host.json")
        print(f"int8 {dev}: rc={run.returncode}", flush=True)
    return done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks/results"))
    )
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument(
        "--tests", nargs="*", default=["tests"], help="test paths to run (default: the whole suite)"
    )
    ap.add_argument("--no-cpu", action="store_true", help="skip the optimize runs on the host CPU")
    ap.add_argument("--no-optimize", action="store_true", help="skip the per-model optimize runs")
    ap.add_argument(
        "--no-variants",
        action="store_true",
        help="skip the bf16 variants race (ResNet-50-like, BERT-base-like)",
    )
    ap.add_argument(
        "--no-capture-cost",
        action="store_true",
        help="skip timing eager against its FX capture and exported program",
    )
    ap.add_argument(
        "--int8",
        action="store_true",
        help="also run benchmarks/bench_int8_linear.py on the GPU and on the host CPU",
    )
    ap.add_argument(
        "--only",
        # every KERNEL_PARTS key is a part, beside the parts with their own code below
        choices=sorted({"race", "lowbit", "precision", "attention_e2e", "conv_e2e", *KERNEL_PARTS}),
        help="run one part alone: host = benchmarks/bench_host_overhead.py (the host time per eager call of opswap::rms_norm and opswap::layer_norm, layer by layer, beside torch eager and torch.compile; writes host_overhead_CARD.json); race = tests/bench/test_gpu_race.py on one worker (the bf16 race on torchvision ResNet-50 and BERT-base saves the fastest verified variant and it reloads; writes race_CARD.json); int4_stacks = benchmarks/tune_int4.py --stacks-only (the "
        "INT4 decode stacks with the committed launch table, beside bf16 and tinygemm); "
        "tune_int4 = the weight-only kernel's GPU tests, then "
        "benchmarks/tune_int4.py (the INT4 GEMV's launch per shape timed in a graph of "
        "dependent launches, and the decode stacks with that table); tune = benchmarks/tune_rows.py (launch choices and "
        "candidate rewrites of the row kernels beside today's, writes tune_rows_h200.json); "
        "widths = the width sweep (768 to 16384 at 4096 rows) of bench_norm_kernels.py and "
        "bench_kernels18.py, rewriting the crossover table; rows = every row kernel's GPU tests, then "
        "bench_norm_kernels.py and bench_kernels18.py (eager and CUDA-graph times, rewriting "
        "the crossover table), and bench_llama_kernels.py; backward = the norm kernels' tests and "
        "bench_row_backward.py --sweep --host; lowbit = benchmarks/bench_lowbit.py (INT8/INT4 "
        "weight-only and FP8 Linears of a 1.1B Llama, writes lowbit_h200.json); precision = "
        "the precision tests on CUDA, bf16 whole models and optimize --exactness lossy on a "
        "Llama decoder (benchmarks/bench_precision_gpu.py, writes precision_h200.json); kernels = "
        "benchmarks/bench_norm_kernels.py (Triton RMSNorm, add + RMSNorm, LayerNorm, SwiGLU "
        "against eager, torch.compile and Liger-Kernel, writes norm_kernels_h200.json); kernels18 = "
        "the tests of the softmax, reduction, RoPE and CUDA bias + GELU kernels and rules, then "
        "benchmarks/bench_kernels18.py (writes kernels18_h200.json); attention = the "
        "FlashAttention kernel's and rule's tests on the GPU, then benchmarks/bench_attention.py "
        "(forward and forward+backward against SDPA's backends, writes attention_h200.json); "
        "conv_e2e = the variants race of torchvision ResNet-50 and ConvNeXt-T, bf16, batch 64 (writes conv_e2e_CARD.json); attention_e2e = the variants race of BERT-base with eager attention, bf16, batch 32, "
        "seq 128 (input, opswap, compile, opswap+compile; writes attention_e2e_h200.json); "
        "decode = the decode-attention kernel's and opswap.llm's tests on the GPU, then "
        "benchmarks/bench_decode.py (greedy tokens/s of a 1.1B Llama at batch 1: StaticDecoder "
        "against HF generate, HF static cache + compile and a gpt-fast-style loop, next to the "
        "bandwidth roofline; writes decode_h200.json); activation = the bias + activation "
        "kernel's, rule's and lowering's tests on the GPU, then benchmarks/bench_activation.py "
        "(opswap::bias_act against the written-out formulas in eager and torch.compile, "
        "forward and forward+backward; writes activation_h200.json); tp = the tensor-parallel "
        "tests on 2 GPUs (NCCL, CUDA graphs) and benchmarks/bench_tp.py --tp 2 (2 GPUs against 1: "
        "throughput, batch-1 latency, tokens; needs a 2-GPU kind; writes tp_CARD.json); "
        "epilogue = the activation rules' tests on "
        "the GPU, then benchmarks/bench_epilogue.py (Linear + ReLU / tanh-GELU: eager, "
        "aten._addmm_activation's cuBLASLt epilogue and torch.compile, bf16 and fp16 at "
        "BERT, GPT-2 and Llama shapes; writes epilogue_h200.json); sparsity = the sparsity "
        "rules' and pruning tests on the GPU, then benchmarks/bench_sparsity.py --device cuda "
        "(2:4 cuSPARSELt/CUTLASS, torchao sparsify_, FP8+2:4 vs FP8, BSR vs cuBLAS at ViT-H MLP "
        "shapes and the MLP stack end to end; writes sparsity_CARD.json) and "
        "benchmarks/bench_pruning.py --device cuda (opswap vs Torch-Pruning; pruning_CARD.json)",
    )
    ap.add_argument(
        "--parts", default="half,llama", help="with --only precision: half, llama or both"
    )
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument(
        "--name",
        default="gpu_suite.json",
        help="file name of the results (e.g. cpu_suite.json for a run without a GPU)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "src"))
    if args.only == "race":  # one at a time: two races on one GPU would time each other
        # the tests record each race; a compiled winner is packaged with AOTInductor
        rows = args.out / "races"
        rows.mkdir(exist_ok=True)
        os.environ.update({"OPSWAP_RACE_OUT": str(rows), "OPSWAP_AOT": "1"})
        res = {"env": env(), "tests": run_tests(args.out, 1, RACE_TESTS)}
        for f in sorted(rows.glob("*.json")):
            res[f.stem] = json.loads(f.read_text())
        shutil.rmtree(rows)
        log = args.out / "pytest.log"
        res["log_tail"] = log.read_text()[-6000:] if log.exists() else ""
        card = (
            torch.cuda.get_device_name(0).split()[1].lower() if torch.cuda.is_available() else "cpu"
        )
        path = args.out / f"race_{card}.json"
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(res["tests"], "\nwrote", path)
        return
    if args.only == "lowbit":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import bench_lowbit

        path = args.out / f"lowbit_{bench_lowbit.card()}.json"
        res = bench_lowbit.run(path=path)
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(bench_lowbit.table(res))
        print("wrote", path)
        return
    if args.only == "conv_e2e":
        res = {"env": env(), "variants_cuda_bf16": []}
        if torch.cuda.is_available():
            card = torch.cuda.get_device_name(0).split()[1].lower()
            res["variants_cuda_bf16"] = variants_table("cuda", card, "bfloat16", CONV_E2E_MODELS)
        else:
            card = "cpu"
        path = args.out / f"conv_e2e_{card}.json"
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print("wrote", path)
        return
    if args.only == "attention_e2e":
        res = {"env": env(), "variants_cuda_bf16": []}
        if torch.cuda.is_available():
            res["variants_cuda_bf16"] = variants_table(
                "cuda", "h200", "bfloat16", ATTENTION_E2E_MODELS
            )
        path = args.out / "attention_e2e_h200.json"
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print("wrote", path)
        return
    if args.only in KERNEL_PARTS:  # the part's GPU tests, then its benchmark scripts
        tests, scripts = KERNEL_PARTS[args.only]
        if tests and not args.skip_tests:
            res = run_tests(args.out, args.workers, tests)
            print("tests:", res, flush=True)
        for script, *extra in scripts:
            cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(args.out)]
            penv = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])
                ),
            }
            subprocess.run([*cmd, *extra], check=False, env=penv)
        return
    if args.only == "precision":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import bench_precision_gpu

        res: dict = {"env": env()}
        if not args.skip_tests:
            res["tests"] = run_tests(args.out, args.workers, PRECISION_TESTS)
            print("tests:", res["tests"], flush=True)
        res.update(bench_precision_gpu.run("cuda", tuple(args.parts.split(","))))
        path = args.out / "precision_h200.json"
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(json.dumps(res, indent=1, default=str)[:6000])
        print("wrote", path)
        return
    result: dict = {"env": env()}
    if not args.skip_tests:
        result["tests"] = run_tests(args.out, args.workers, args.tests)
        print("tests:", result["tests"], flush=True)
    if torch.cuda.is_available():
        try:
            result["ceilings"] = ceilings()
        except Exception as e:
            result["ceilings"] = {"error": f"{type(e).__name__}: {e}"}
        print("ceilings:", result["ceilings"], flush=True)
        torch.cuda.empty_cache()
        if not args.no_capture_cost:
            result["capture_cost_cuda_bf16"] = capture_cost("cuda", "bfloat16")
        if not args.no_variants:
            result["variants_cuda_bf16"] = variants_table("cuda", "h200", "bfloat16")
        if not args.no_optimize:
            result["optimize_cuda"] = optimize_models("cuda", "h200")
    if not args.no_cpu and not args.no_optimize:
        result["optimize_cpu"] = optimize_models("cpu", "cpu")
    if args.int8:
        result["int8_linear"] = int8_tables(args.out)
    path = args.out / args.name
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
