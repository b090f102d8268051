"""The quantized decoder at the edge: a LLaMA-style decoder (zoo:gpt) with 8-bit dynamic
activations and 4-bit weights (torchao's Int8DynamicActivationIntxWeightConfig, groups of
32, "8da4w") lowered to ExecuTorch with the XNNPACK delegate, against its fp32 export; the
decode step's tokens/s, the .pte sizes and the process's peak memory while each runs.

    from opswap.bench.edge_llm import decoder_race
    decoder_race(hidden=512, layers=4)     # a dict: tokens/s, sizes, peak memory, agreement

What is timed is one token's forward, [1, 1] token ids in, logits out, without a KV cache:
the weight-bound part of a decode step (every Linear reads its whole weight for one
token), which is what 4-bit weights change. The zoo decoder has no cache to carry, so the
attention over past tokens is not in it; the figure says so.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from opswap.bench.edge import _compare, program_memory, torch_pool_held


def _lower(model: torch.nn.Module, inputs: tuple, path: Path) -> Path:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from opswap.backends.runtime_module import quiet

    with quiet():
        ep = torch.export.export(model, inputs)
        edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
        path.write_bytes(edge.to_executorch().buffer)
    return path


def _quantized(model: torch.nn.Module, group: int) -> torch.nn.Module:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    from opswap.backends.runtime_module import quiet

    with quiet():
        quantize_(
            model,
            Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4,  # type: ignore[attr-defined]  # not in the stubs
                weight_granularity=PerGroup(group),
            ),
        )
    return model


def decoder_race(
    hidden: int = 512,
    layers: int = 4,
    heads: int = 8,
    intermediate: int = 1376,
    vocab: int = 8192,
    group: int = 32,
    rounds: int = 30,
    memory: bool = True,
) -> dict[str, Any]:
    """fp32 and 8da4w ExecuTorch programs of zoo:gpt at these sizes, each timed for
    `rounds` one-token forwards interleaved: tokens/s, file sizes, the seconds each took to
    build, with `memory` each program's memory in a process of its own (resident set after
    loading and running it, program_memory), and the 8da4w logits' cosine and top-1
    agreement with the fp32 model's. The fp32 model is freed before the 8da4w one is
    built, so that the two are never in memory together."""
    from opswap.backends.executorch import ExecuTorchModule
    from opswap.models.zoo_transformer import gpt

    def build() -> torch.nn.Module:  # the same weights each call (gpt seeds them)
        return gpt(
            batch=1,
            seq=1,
            vocab=vocab,
            hidden=hidden,
            heads=heads,
            layers=layers,
            intermediate=intermediate,
            max_positions=64,
        )[0].eval()

    model = build()
    ids = (torch.randint(0, vocab, (1, 1)),)
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {
        "model": f"zoo:gpt hidden={hidden} layers={layers} heads={heads} "
        f"intermediate={intermediate} vocab={vocab}",
        "parameters": params,
        "timed": "one token's forward without a KV cache (the weight-bound part of decode)",
        "scheme": f"8-bit dynamic activations, 4-bit weights in groups of {group} (torchao 8da4w)",
        "threads": f"XNNPACK {torch.get_num_threads()}; torch's own pool held at 1 while timing",
    }
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        want = model(*ids)
        t0 = time.perf_counter()
        fp32 = _lower(model, ids, Path(tmp) / "fp32.pte")
        out["fp32_build_s"] = round(time.perf_counter() - t0, 1)
        del model
        gc.collect()
        t0 = time.perf_counter()
        q_model = _quantized(build(), group)
        q4 = _lower(q_model, ids, Path(tmp) / "8da4w.pte")
        out["8da4w_build_s"] = round(time.perf_counter() - t0, 1)
        del q_model
        gc.collect()
        runs = {}
        for name, path in (("fp32", fp32), ("8da4w", q4)):
            out[f"{name}_pte_mb"] = round(path.stat().st_size / 2**20, 2)
            if memory:
                out[f"{name}_memory"] = program_memory(path)
        for name, path in (("fp32", fp32), ("8da4w", q4)):
            runs[name] = ExecuTorchModule(path)
            runs[name](*ids)
        cos, top1, _ = _compare(want, runs["8da4w"](*ids))
        out["8da4w_cosine"], out["8da4w_top1"] = round(cos, 5), top1
        times: dict[str, list[float]] = {k: [] for k in runs}
        with torch_pool_held(1):  # XNNPACK's pool keeps torch's thread count
            for _ in range(rounds):
                for k, fn in runs.items():
                    t0 = time.perf_counter()
                    fn(*ids)
                    times[k].append(time.perf_counter() - t0)
    for k, ts in times.items():
        out[f"{k}_tokens_per_s"] = round(1 / statistics.median(ts), 1)
    out["speedup_8da4w"] = round(out["8da4w_tokens_per_s"] / out["fp32_tokens_per_s"], 2)
    return out
