"""The training-step race: eager, torch.compile, opswap (train.prepare) and opswap under
torch.compile, each a full step: forward, loss, backward and the optimizer's step.

Every variant trains its own copy of the model from the same weights. First each takes
`check_steps` steps on the same batches from the same random state, and its loss after
them is compared with eager's (a variant whose loss drifts is reported unverified, not
dropped: the table says by how much). Then the steps are timed interleaved with
bench.timing.benchmark, and the peak memory of one step is measured with
bench.memory.peak_memory: CUDA's allocator peak (`max_memory_allocated` above the level
before the step) on a GPU, the profiler's record of CPU allocations on the CPU.

The optimizer is torch's AdamW, `fused=True` on CUDA and `foreach=True` elsewhere, for
eager and compile; the opswap variants take opswap.train.optim.AdamW (one pass per
tensor on CUDA; torch's foreach steps in torch's order on the CPU).

`precision` (float32, bf16, fp16, fp8; opswap.train.precision) applies to every variant:
eager and compile run under the same autocast, or with the same Linears made
Float8Linear, and opswap's prepares with it; fp16 steps through a GradScaler per variant.
The losses are compared with eager's in that precision, at `loss_rtol` (by default 1e-3
in float32, 1e-2 fp16, 5e-2 bf16, 1e-1 fp8: opswap keeps softmax and the norms in
float32 where eager's CPU autocast does not, so the two round differently).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from opswap.graph.copies import private_copy

__all__ = ["StepTiming", "TrainRace", "VARIANTS", "race_training"]

VARIANTS = ("eager", "compile", "opswap", "opswap+compile")
_LOSS_RTOL = {"float32": 1e-3, "fp16": 1e-2, "bf16": 5e-2, "fp8": 1e-1}
_Made = tuple[Callable[..., torch.Tensor], torch.optim.Optimizer, "torch.amp.GradScaler | None"]


@dataclass
class StepTiming:
    name: str
    median_s: float | None
    peak_bytes: int | None
    loss: float | None  # after the check steps
    loss_error: float | None  # relative to eager's loss after as many steps
    verified: bool
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class TrainRace:
    rows: list[StepTiming]
    device: str
    memory_method: str
    check_steps: int
    notes: list[str] = field(default_factory=list)
    #: the opswap variant's train.prepare report (PrepareReport.to_json), when it ran
    prepare: dict[str, Any] | None = None
    #: what every variant trained in (opswap.train.precision.PRECISIONS)
    precision: str = "float32"

    def row(self, name: str) -> StepTiming:
        return next(r for r in self.rows if r.name == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "memory_method": self.memory_method,
            "check_steps": self.check_steps,
            "variants": [r.to_json() for r in self.rows],
            "notes": list(self.notes),
            "prepare": self.prepare,
            "precision": self.precision,
        }

    def table(self) -> str:
        eager = self.row("eager").median_s if any(r.name == "eager" for r in self.rows) else None
        lines = [
            "| variant | ms / step | vs eager | peak MB | loss after check | rel. diff | verified |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            ms = f"{r.median_s * 1e3:.2f}" if r.median_s is not None else "-"
            vs = f"{eager / r.median_s:.2f}x" if eager and r.median_s else "-"
            mb = f"{r.peak_bytes / 2**20:.1f}" if r.peak_bytes is not None else "-"
            loss = f"{r.loss:.5f}" if r.loss is not None else "-"
            err = f"{r.loss_error:.1e}" if r.loss_error is not None else "-"
            ok = "yes" if r.verified else f"no{': ' + r.note if r.note else ''}"
            lines.append(f"| {r.name} | {ms} | {vs} | {mb} | {loss} | {err} | {ok} |")
        return "\n".join(lines)


def _to(batch: Sequence[Any], device: str) -> tuple[Any, ...]:
    return tuple(
        pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, list(batch))
    )


def _target_of(device: str) -> str:
    """The hardware profile (opswap.targets) of `device`: the GPU's own where it has one
    (h100, h200, a100), h100 for another GPU, cpu for the CPU."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    return next((t for t in ("h200", "h100", "a100") if t in name), "h100")


def _optimizer(params: Any, opswap: bool, device: str, lr: float) -> torch.optim.Optimizer:
    if opswap:
        from opswap.train.optim import AdamW

        return AdamW(params, lr=lr)
    if device.startswith("cuda"):
        return torch.optim.AdamW(params, lr=lr, fused=True)
    return torch.optim.AdamW(params, lr=lr, foreach=True)


def _variant(
    name: str,
    model: nn.Module,
    batch: tuple[Any, ...],
    loss_fn: Callable[..., torch.Tensor],
    device: str,
    lr: float,
    prepare_kw: dict[str, Any],
    prepared: list[Any],
    precision: str = "float32",
) -> _Made:
    """The loss function of one variant (its own copy of the model) and its optimizer.
    The first opswap variant prepares its copy and leaves it in `prepared`; the second
    takes a copy of that (graph and parameters together) rather than preparing again."""
    if name in ("opswap", "opswap+compile"):
        from opswap.train.prepare import Prepared, prepare

        if prepared:
            mine: Prepared = private_copy(prepared[0])
        else:
            mine = prepare(private_copy(model).to(device), batch, loss_fn, **prepare_kw)
            prepared.append(mine)
        step_fn: Callable[..., torch.Tensor] = mine
        if name == "opswap+compile":
            step_fn = torch.compile(mine)
        return step_fn, _optimizer(mine.parameters(), True, device, lr), _scaler(precision, device)
    from opswap.train.precision import float8_linears, mixed

    own = private_copy(model).to(device)
    if precision == "fp8":
        float8_linears(own, prepare_kw.get("fp8_recipe", "tensorwise"))
    dev = torch.device(device).type
    run: Callable[..., Any] = torch.compile(own) if name == "compile" else own

    def eager_loss(*b: Any) -> torch.Tensor:
        with mixed(precision, dev):
            return loss_fn(run(*b[:-1]), b[-1]).float()

    return eager_loss, _optimizer(own.parameters(), False, device, lr), _scaler(precision, device)


def _scaler(precision: str, device: str) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(torch.device(device).type) if precision == "fp16" else None


def _stepper(made: _Made, batch: tuple[Any, ...]) -> Callable[[], torch.Tensor]:
    return lambda: _step(made, batch)


def _step(made: _Made, batch: tuple[Any, ...]) -> torch.Tensor:
    fn, opt, scaler = made
    loss = fn(*batch)
    if scaler is None:
        loss.backward()
        opt.step()
    else:  # fp16: scaled backward, the step skipped on an inf or NaN gradient
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def race_training(
    model: nn.Module,
    example_batch: Sequence[Any],
    loss_fn: Callable[..., torch.Tensor],
    *,
    batches: Sequence[Sequence[Any]] | None = None,
    variants: Sequence[str] = VARIANTS,
    device: str = "cpu",
    lr: float = 1e-3,
    check_steps: int = 3,
    min_time_s: float = 0.5,
    loss_rtol: float | None = None,
    seed: int = 0,
    prepare_kw: dict[str, Any] | None = None,
    extra: dict[str, Callable[..., torch.Tensor]] | None = None,
    precision: str = "float32",
) -> TrainRace:
    """Race full training steps of `model` under `variants` (names from VARIANTS) on
    `device`; `batches` (default: the example, `check_steps` times) are the check
    steps' batches, `(inputs..., target)` each. The user's model is only copied.

    `extra` adds peers built by the caller, by name: a module already on `device` whose
    `forward(*inputs, target)` returns the loss (a Liger-Kernel-patched model called with
    labels), trained in place with torch's AdamW and checked against eager like the rest
    (in float32: `precision` does not reach inside it)."""
    from opswap.bench.memory import peak_memory
    from opswap.bench.timing import benchmark

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "eager" not in variants:
        raise ValueError(
            f"variants must include eager and be among {', '.join(VARIANTS)}; got {list(variants)}"
        )
    if precision not in _LOSS_RTOL:
        raise ValueError(f"precision must be one of {', '.join(_LOSS_RTOL)}; not {precision!r}")
    rtol = _LOSS_RTOL[precision] if loss_rtol is None else loss_rtol
    batch = _to(example_batch, device)
    todo = [_to(b, device) for b in batches] if batches else [batch] * check_steps
    kw = {"target": _target_of(device), "precision": precision, **(prepare_kw or {})}
    made: dict[str, _Made] = {}
    rows: dict[str, StepTiming] = {}
    prepared: list[Any] = []
    for name in variants:
        try:
            made[name] = _variant(
                name, model, batch, loss_fn, device, lr, kw, prepared, kw["precision"]
            )
        except Exception as e:  # a variant that cannot be built is a row that says why
            rows[name] = StepTiming(
                name, None, None, None, None, False, f"{type(e).__name__}: {e}"[:200]
            )
    losses: dict[str, float] = {}
    for name, one in made.items():
        torch.manual_seed(seed)
        try:
            for b in todo:
                last = _step(one, b)
            losses[name] = float(last)
        except Exception as e:
            rows[name] = StepTiming(
                name, None, None, None, None, False, f"{type(e).__name__}: {e}"[:200]
            )
    for name, module in (extra or {}).items():
        if not isinstance(module, nn.Module):
            raise ValueError(f"extra[{name!r}] must be an nn.Module returning the loss")
        torch.manual_seed(seed)
        opt = _optimizer(module.parameters(), False, device, lr)
        made[name] = (module, opt, None)
        try:
            for b in todo:
                last = _step(made[name], b)
            losses[name] = float(last)
        except Exception as e:
            rows[name] = StepTiming(
                name, None, None, None, None, False, f"{type(e).__name__}: {e}"[:200]
            )
    for name in list(made):
        if name in rows:
            del made[name]
    want = losses.get("eager")
    timed = benchmark(
        {name: _stepper(one, batch) for name, one in made.items()},
        min_time_s=min_time_s,
        warmup=2,
        repeats=5,
        target_sample_s=0.0,
        max_inner=1,
        device=device,
    )
    method = ""
    for name, one in made.items():
        mem = peak_memory(_stepper(one, batch), device=device)
        method = mem.method
        got = losses[name]
        err = abs(got - want) / max(abs(want), 1e-12) if want is not None else None
        ok = err is not None and err <= rtol
        rows[name] = StepTiming(
            name,
            timed[name].median,
            mem.peak_bytes,
            got,
            err,
            ok,
            "" if ok else f"loss differs from eager's by {err:.1e} after {len(todo)} steps",
        )
    notes = []
    if device == "cpu" and torch.get_num_threads() > 1 and any("compile" in v for v in made):
        notes.append(
            f"On the CPU with {torch.get_num_threads()} threads, Inductor's OpenMP pool and "
            "ATen's contend: eager steps measured up to 5x slower once a compiled step had "
            "run (a 2-core machine); torch.set_num_threads(1) gives fairer CPU figures."
        )
    return TrainRace(
        [rows[v] for v in [*variants, *(extra or {})] if v in rows],
        device,
        method,
        len(todo),
        notes,
        prepare=prepared[0].report.to_json() if prepared else None,
        precision=kw["precision"],
    )


# --------------------------------------------------------------------------- optimize --train


def random_labels(model: nn.Module, inputs: Sequence[Any], seed: int = 0) -> torch.Tensor:
    """Class labels for a model whose output is logits [..., C]: random integers in [0, C)
    of the output's leading shape (what `opswap optimize --train` trains against when the
    spec brings no labels). Refuses, in one sentence, an output that is not such logits."""
    with torch.no_grad():
        out = private_copy(model).eval()(*inputs)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() < 2:
        what = (
            type(out).__name__
            if not isinstance(out, torch.Tensor)
            else f"{out.dtype} {list(out.shape)}"
        )
        raise ValueError(
            f"--train trains with cross-entropy over the output's last dim, and this model "
            f"returns {what}; use opswap.train.prepare with a loss of your own."
        )
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, out.shape[-1], tuple(out.shape[:-1]), generator=gen).to(out.device)


def cross_entropy_last_dim(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with the classes on the last dim: a classifier's [B, C] or a language
    model's [B, T, V] logits (flattened to rows, as LM training does)."""
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    )


def optimize_training(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    target: str = "cpu",
    exactness: str = "exact",
    rules: Sequence[str] | None = None,
    device: str = "cpu",
    variants: Sequence[str] = VARIANTS,
    min_time_s: float = 0.5,
) -> TrainRace:
    """Race the training step of `model` with cross-entropy against random labels of its
    output's shape: eager, torch.compile, and opswap's train.prepare (with and without
    compile); the race's `prepare` holds what opswap replaced and left. The user's module
    is only copied."""
    own = private_copy(model).train()
    inputs = tuple(example_inputs)
    batch = (*inputs, random_labels(own, inputs))
    kw: dict[str, Any] = {
        "target": target,
        "exactness": exactness,
        "rules": list(rules) if rules else None,
    }
    return race_training(
        own,
        batch,
        cross_entropy_last_dim,
        variants=variants,
        device=device,
        min_time_s=min_time_s,
        prepare_kw=kw,
    )
