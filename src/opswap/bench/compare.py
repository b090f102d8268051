"""One model against another: `bench_models` times a reference and a candidate on the same
inputs (interleaved rounds, bench.timing), with their peak memory, on the device asked for.
The user's models are never touched: a model on another device is timed as a moved copy."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.bench.device import resolve_device
from opswap.bench.stats import ModelBench
from opswap.bench.timing import benchmark
from opswap.errors import OpswapError


def _first_device(model) -> torch.device | None:
    if isinstance(model, nn.Module):
        for t in list(model.parameters()) + list(model.buffers()):
            return t.device
    return None


def _on(model, dev: torch.device, notes: list[str], label: str):
    """`model` on `dev`: itself if already there, else a moved copy (the user's model is
    never touched)."""
    where = _first_device(model)
    if where is None or where == dev:
        return model
    try:
        moved = copy.deepcopy(model).to(dev)
    except Exception as e:
        raise OpswapError(
            f"Could not move the {label} model to {dev} ({type(e).__name__}: "
            f"{str(e).strip()[:200]}); move it yourself before timing."
        ) from e
    notes.append(f"the {label} model was copied from {where} to {dev} for timing")
    return moved


def bench_models(
    reference: Callable,
    candidate: Callable,
    inputs,
    device=None,
    *,
    warmup: int = 5,
    repeats: int = 20,
    min_time_s: float = 0.5,
    max_time_s: float = 8.0,
    rel_width: float | None = 0.1,
    memory: bool = True,
) -> ModelBench:
    """Time `reference(*inputs)` against `candidate(*inputs)` in eval and inference mode,
    until the speed-up's 95% interval is narrower than `rel_width` of it or `max_time_s`
    passed (then the result says it did not settle).

    `device` defaults to where the inputs are. Inputs are moved there; a model that is
    elsewhere is timed as a moved copy. With `memory`, each model's peak memory over one
    call is measured too (after the timing, so it does not disturb it).
    """
    from opswap.bench.memory import peak_memory
    from opswap.graph.copies import preserved_state
    from opswap.graph.inputs import caller, fresh, writes
    from opswap.verify.outputs import eval_mode

    args = (
        inputs
        if isinstance(inputs, tuple)
        else (tuple(inputs) if isinstance(inputs, list) else (inputs,))
    )
    if device is None:
        tensors = [x for x in pytree.tree_leaves(list(args)) if isinstance(x, torch.Tensor)]
        first = tensors[0] if tensors else None
        device = first.device if first is not None else "cpu"
    dev = resolve_device(device)
    # a private copy: on the same device .to() hands back the caller's own tensors
    args = fresh(
        tuple(
            pytree.tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, list(args))
        )
    )
    notes: list[str] = []
    ref, cand = _on(reference, dev, notes, "reference"), _on(candidate, dev, notes, "candidate")
    # (version counters of tensors made outside inference mode count its writes too)
    with torch.inference_mode(), eval_mode(ref), preserved_state(ref):
        copy = bool(writes(lambda xs: ref(*xs), args))  # then every call gets a fresh copy
    if copy:
        notes.append("the model writes into its inputs: each call ran on a fresh copy of them")

    with torch.inference_mode(), eval_mode(ref, cand), preserved_state(ref, cand):
        res = benchmark(
            {"reference": caller(ref, args, copy), "candidate": caller(cand, args, copy)},
            warmup=warmup,
            repeats=repeats,
            min_time_s=min_time_s,
            max_time_s=max_time_s,
            rel_width=rel_width,
            device=dev,
        )
        ref_peak = opt_peak = None
        if memory:
            try:
                ref_peak = peak_memory(caller(ref, args, copy), device=dev).peak_bytes
                opt_peak = peak_memory(caller(cand, args, copy), device=dev).peak_bytes
            except Exception as e:  # memory is a bonus; the timing stands without it
                notes.append(f"peak memory not measured: {type(e).__name__}: {str(e)[:120]}")
    return ModelBench.of(
        res,
        "reference",
        "candidate",
        ref_peak=ref_peak,
        opt_peak=opt_peak,
        notes=notes,
        settled=res.settled,
        rel_width=rel_width,
    )
