"""Operator replacement for a model that trains.

    prepared = opswap.train.prepare(model, (x, y), loss_fn)
    opt = torch.optim.AdamW(model.parameters())       # the model's own parameters
    for x, y in data:
        loss = prepared(x, y)
        loss.backward(); opt.step(); opt.zero_grad()

`prepare` captures the model and the loss together, as one module (so that a model that
ends in an lm_head read only by a cross-entropy gets opswap's fused
`opswap::linear_cross_entropy` in place of the two, the logits never written), plans only
the rules marked valid in training (`Rule.training`: an exact backward, the model's
Parameters kept as the parameters the graph reads, train-mode behaviour kept), and
checks the outputs, the loss and every parameter's gradient against eager float32 on
several batches (train.verify_grads). A rule whose gradients differ is refused, with the
reason, and the rest planned again without it.

The prepared module holds the user's own Parameter objects and BatchNorm buffers (not
copies): an optimizer built on `model.parameters()` trains it, the model's state_dict is
the trained one, and the model itself, called in eval mode, evaluates what was trained.
Dropout stays, BatchNorm uses batch statistics and updates the running ones, as the model
did in train mode. The graph is captured in train mode and is for training only: a
functional dropout's `training=self.training` is fixed when traced, so evaluate with the
model, not with `prepared.eval()`. The global random state is left as it was found, so
the first dropout mask is the one eager training would draw.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from opswap.errors import OpswapError
from opswap.train.verify_grads import GradCheck, verify_grads

__all__ = ["PrepareError", "PrepareReport", "Prepared", "prepare", "training_rules"]

#: the pseudo-rule name of the loss-head fusion `prepare` makes itself
LOSS_HEAD = "train.linear_cross_entropy"


class PrepareError(OpswapError, ValueError):
    """`prepare` was given something it cannot train."""


@dataclass
class PrepareReport:
    """What `prepare` replaced, what it left and why, and the gradient check."""

    replaced: list[tuple[str, str]] = field(default_factory=list)  # (rule, description)
    left: list[tuple[str, str, str]] = field(default_factory=list)  # (rule, where, why)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (rule, why)
    check: GradCheck | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "replaced": [{"rule": r, "description": d} for r, d in self.replaced],
            "left": [{"rule": r, "where": w, "reason": y} for r, w, y in self.left],
            "refused": [{"rule": r, "reason": y} for r, y in self.refused],
            "gradients": self.check.to_json() if self.check is not None else None,
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} site(s):"]
        lines += [f"  {r}: {d}" for r, d in self.replaced]
        if self.refused:
            lines.append("refused:")
            lines += [f"  {r}: {y}" for r, y in self.refused]
        if self.left:
            lines.append(f"left {len(self.left)} near miss(es):")
            lines += [f"  {r} at {w}: {y}" for r, w, y in self.left[:20]]
        if self.check is not None:
            lines.append(str(self.check))
        lines += self.notes
        return "\n".join(lines)


class Prepared(nn.Module):
    """The model (and its loss) as opswap rewrote them for training. Called with what
    `example_batch` held: `prepared(*inputs, target)` returns the loss when a loss_fn
    was given, `prepared(*inputs)` the model's outputs otherwise. Its parameters are the
    model's own Parameter objects."""

    def __init__(
        self,
        graph: fx.GraphModule,
        report: PrepareReport,
        with_loss: bool,
        model_keys: Sequence[Sequence[str]] = (),
        precision: str = "float32",
        device_type: str = "cpu",
    ):
        super().__init__()
        self.graph = graph
        self.report = report
        self.with_loss = with_loss
        #: the user's model's state_dict keys, grouped by the tensor they name (tied weights
        #: share a group); opswap.train.distributed.full_state_dict uses them
        self.model_keys = tuple(tuple(g) for g in model_keys)
        #: float32, bf16, fp16 or fp8 (opswap.train.precision); the forward autocasts
        #: on `device_type` for bf16 and fp16
        self.precision = precision
        self.device_type = device_type
        #: fp16's loss scaler (torch.amp.GradScaler); None in the other precisions
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device_type) if precision == "fp16" else None
        )

    def forward(self, *batch: Any) -> Any:
        if self.precision in ("float32", "fp8"):
            return self.graph(*batch)
        from opswap.train.precision import mixed

        with mixed(self.precision, self.device_type):
            out = self.graph(*batch)
        if self.with_loss:  # the loss in float32, whatever dtype loss_fn left it in
            from torch.utils import _pytree as pytree

            return pytree.tree_map(
                lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                out,
            )
        return out

    def step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> bool:
        """Backward of `loss`, the optimizer's step and zeroed gradients; with fp16, through
        `scaler`: the loss scaled before the backward, the gradients unscaled before the
        step, and the step skipped when one is inf or NaN (the scale then shrinks).
        Returns whether the step was taken."""
        if self.scaler is None:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return True
        before = self.scaler.get_scale()
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)  # skipped when an unscaled gradient is inf or NaN
        self.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return not self.scaler.get_scale() < before  # update() shrinks it after a skip


class _WithLoss(nn.Module):
    """The model and its loss as one module: `forward(x0, ..., target)` -> loss. The
    attribute names make the model's parameters `model.<name>` in the capture. The
    forward takes its inputs by name, one argument each (`_with_loss`), because FX
    cannot trace a `*batch` it would have to unpack."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        if isinstance(loss_fn, nn.Module):
            self.loss = loss_fn
        else:
            self.loss_fn = loss_fn

    def _loss(self, out: Any, target: Any) -> torch.Tensor:
        fn = self.loss if "loss" in self._modules else self.loss_fn
        return fn(out, target)


def _with_loss(model: nn.Module, loss_fn: Callable[..., torch.Tensor], n: int) -> _WithLoss:
    """A _WithLoss whose forward takes `n` model inputs and the target."""
    names = ", ".join(f"x{i}" for i in range(n))
    space: dict[str, Any] = {}
    exec(  # a forward with n named parameters, for FX's symbolic tracing
        f"def forward(self, {names}, target):\n    return self._loss(self.model({names}), target)\n",
        space,
    )
    cls = type(f"WithLoss{n}", (_WithLoss,), {"forward": space["forward"]})
    return cls(model, loss_fn)


def training_rules(patterns: Sequence[str] | None = None) -> list[str]:
    """The names of the rules valid in training (`Rule.training`), among `patterns`
    (globs; None: all)."""
    from opswap.rules import registry

    return [
        r.name
        for r in registry.all_rules()
        if r.training and (not patterns or any(fnmatch.fnmatch(r.name, p) for p in patterns))
    ]


@contextlib.contextmanager
def _sharing(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """While the body runs, a deep copy of any of `tensors` is the tensor itself: the
    capture and the planner copy the model, and their copies then hold the user's own
    Parameters. Safe because rules never write into a parameter (rules/base.py's
    contract, checked by graph.copies.preserved_state)."""
    keep = {id(t): t for t in tensors}
    param_copy = nn.Parameter.__deepcopy__
    tensor_copy = torch.Tensor.__deepcopy__

    def shared_param(self: nn.Parameter, memo: dict[int, Any]) -> Any:
        return self if id(self) in keep else param_copy(self, memo)

    def shared_tensor(self: torch.Tensor, memo: dict[int, Any]) -> Any:
        return self if id(self) in keep else tensor_copy(self, memo)

    nn.Parameter.__deepcopy__ = shared_param  # type: ignore[method-assign,assignment]
    torch.Tensor.__deepcopy__ = shared_tensor  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Parameter.__deepcopy__ = param_copy  # type: ignore[method-assign]
        torch.Tensor.__deepcopy__ = tensor_copy  # type: ignore[method-assign]


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """The global random state (CPU and CUDA) as it was before the body: capture and
    verification run the model, and the user's own first step must draw what eager would."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _as_batch(example_batch: Any, with_loss: bool) -> tuple[Any, ...]:
    batch = tuple(example_batch) if isinstance(example_batch, (tuple, list)) else (example_batch,)
    if with_loss and len(batch) < 2:
        raise PrepareError(
            "example_batch must be (inputs..., target) when a loss_fn is given: the last "
            "element is what loss_fn(model(*inputs), target) compares the outputs with."
        )
    if not batch:
        raise PrepareError("example_batch is empty: pass the model's inputs (and the target).")
    return batch


def _gpu_target(target: str) -> bool:
    from opswap.targets import get_target

    try:
        return get_target(target).kind == "cuda"
    except Exception as e:  # an unknown name: one sentence, naming the known ones
        raise PrepareError(str(e)) from None


def _float32_copy(module: nn.Module) -> nn.Module:
    """The eager float32 reference the gradients are checked against: a private copy."""
    from opswap.graph.copies import private_copy

    ref = private_copy(module)
    low = (torch.bfloat16, torch.float16)
    if any(p.dtype in low for p in ref.parameters()):
        ref = ref.float()
    return ref


def _param_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=True)}


def _new_parameters(gm: nn.Module, allowed: dict[int, str]) -> list[str]:
    """Names of the parameters `gm` holds that are not among `allowed` (by identity)."""
    return [n for n, p in gm.named_parameters() if id(p) not in allowed]


def _rebind_buffers(gm: nn.Module, user: nn.Module, prefix: str) -> int:
    """Make the graph's buffers the user's own where a buffer of the same name, shape and
    dtype exists (BatchNorm's running statistics then update in the user's model)."""
    theirs = dict(user.named_buffers())
    done = 0
    for mod_name, mod in gm.named_modules():
        for name, buf in list(mod._buffers.items()):
            full = f"{mod_name}.{name}" if mod_name else name
            key = full[len(prefix) :] if prefix and full.startswith(prefix) else full
            other = theirs.get(key)
            if (
                buf is not None
                and other is not None
                and other.shape == buf.shape
                and other.dtype == buf.dtype
            ):
                mod._buffers[name] = other
                done += 1
    return done


def prepare(
    model: nn.Module,
    example_batch: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    target: str = "cpu",
    exactness: str = "exact",
    optimizer: torch.optim.Optimizer | None = None,
    rules: Sequence[str] | None = None,
    batches: Sequence[Sequence[Any]] | None = None,
    fuse_loss: bool | None = None,
    precision: str = "float32",
    fp8_recipe: str = "tensorwise",
) -> Prepared:
    """`model` (with `loss_fn`) rewritten with the rules valid in training, gradients
    checked; see the module's docstring.

    `example_batch` is `(inputs..., target)` with a loss_fn (the target last), the
    model's inputs alone without one. `rules` narrows the training rules by glob;
    `batches` are the batches the gradients are checked on (default: the example and
    the capture's other sizes, three in all). `optimizer`, when given, is checked to hold
    the parameters the prepared module trains. `fuse_loss`: whether the head and the
    cross-entropy become opswap::linear_cross_entropy; None (the default) fuses them on a
    GPU target, where the kernel is written to pay, and not on the CPU, where its chunked
    PyTorch path costs more time than it saves memory (chapter 27, Measured).

    `precision` ("float32", "bf16", "fp16", "fp8"; opswap.train.precision says what each
    does): the rules are planned and checked in float32 as always; then bf16 and fp16
    run the forward under autocast with softmax, the norms and the loss kept in float32,
    and fp8 makes the Linears whose sizes are multiples of 16 torchao's Float8Linear
    (`fp8_recipe`: "tensorwise", per-tensor current scaling, or "rowwise"; CUDA of compute
    capability 8.9 or newer only). The whole is checked once more against eager float32,
    at that precision's tolerance (verify_grads.tolerance). With fp16, train through
    `prepared.step(optimizer, loss)`, or `prepared.scaler` yourself."""
    from opswap.graph.capture import capture
    from opswap.rules.base import EXACTNESS_ORDER

    if not isinstance(model, nn.Module):
        raise PrepareError(f"prepare takes an nn.Module, not {type(model).__name__}.")
    from opswap.train._wrapped import wrapped_how

    how = wrapped_how(model)
    if how is not None:
        raise PrepareError(
            f"{type(model).__name__} is already {how}; prepare the model first, then wrap "
            "what prepare returns (opswap.train.distributed.wrap(prepared, mode=...))."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise PrepareError(f"loss_fn must be callable, not {type(loss_fn).__name__}.")
    if exactness not in EXACTNESS_ORDER:
        raise PrepareError(f"exactness must be one of exact, approx, lossy; not {exactness!r}.")
    if not model.training:
        raise PrepareError(
            f"{type(model).__name__} is in eval mode; call model.train() before prepare "
            "(the capture keeps the mode it sees: dropout, BatchNorm's batch statistics)."
        )
    gpu = _gpu_target(target)  # an unknown target fails here, in one sentence
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    from opswap.train.precision import FP8_RECIPES, precision_problem

    why_not = precision_problem(precision, device)
    if why_not is not None:
        raise PrepareError(why_not)
    if precision == "fp8" and fp8_recipe not in FP8_RECIPES:
        raise PrepareError(
            f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}; not {fp8_recipe!r}."
        )
    with_loss = loss_fn is not None
    batch = _as_batch(example_batch, with_loss)
    wrapped: nn.Module = (
        _with_loss(model, loss_fn, len(batch) - 1) if loss_fn is not None else model
    )
    prefix = "model." if with_loss else ""
    names = _param_names(wrapped)
    report = PrepareReport()
    reference = _float32_copy(wrapped)  # a real copy: made before the sharing starts
    with _rng_kept(), _sharing(p for _, p in wrapped.named_parameters()):
        try:
            captured = capture(wrapped, batch, dynamic="auto")
        except OpswapError as e:
            raise PrepareError(f"Could not capture the model for training: {e}") from e
        extra = _new_parameters(captured.gm, names)
        if extra:
            raise PrepareError(
                f"The capture does not read the model's own parameters ({', '.join(extra[:3])}"
                " are computed or copied, as a parametrisation or weight_norm does); "
                "remove the parametrisation before prepare."
            )
        if fuse_loss is None:
            fuse_loss = gpu
            if not fuse_loss and with_loss:
                report.notes.append(
                    f"The head and the cross-entropy are left as they are on target {target}: "
                    "the fused loss's CPU path is slower than eager's (fuse_loss=True forces it)."
                )
        if fuse_loss and with_loss:
            from opswap.train._loss_head import fuse_loss_head

            fused = fuse_loss_head(captured.gm)
            for what in fused.replaced:
                report.replaced.append((LOSS_HEAD, what))
            report.left += [(LOSS_HEAD, w, y) for w, y in fused.left]
            if fused.replaced:
                captured.propagate(captured.gm)
        allowed = training_rules(rules)
        if rules and not allowed:
            report.notes.append(
                f"{', '.join(rules)} select no rule valid in training; "
                "`from opswap.train.prepare import training_rules` lists them."
            )
        gm, check = _plan_checked(
            captured, model, reference, names, batch, batches, allowed, target, exactness, report
        )
        report.check = check
        if precision != "float32":
            _lower(gm, precision, fp8_recipe, report)
        from opswap.graph.dynamic import guard

        # a call outside the shapes captured is refused in one sentence
        guard(gm, captured.example_inputs, captured.dynamic, "the prepared model")
        kept = _rebind_buffers(gm, wrapped, "")
        if kept:
            report.notes.append(
                f"{kept} buffer(s) are the model's own (BatchNorm's running statistics "
                "among them update in the model as the prepared module trains)."
            )
    if optimizer is not None:
        trained = {id(p) for p in gm.parameters() if p.requires_grad}
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [names.get(i, "?") for i in trained - held]
        if missing:
            report.notes.append(
                f"The optimizer does not hold {len(missing)} trained parameter(s) "
                f"({', '.join(n[len(prefix) :] for n in missing[:3])}): they get gradients "
                "but are never updated."
            )
    prepared = Prepared(gm, report, with_loss, _key_groups(model), precision, device.type)
    if precision != "float32":
        with _rng_kept():
            check = verify_grads(
                reference,
                prepared,
                batch,
                captured,
                batches,
                exactness,
                names=names,
                precision=precision,
            )
        if not check.passed:
            raise PrepareError(
                f"{type(model).__name__} does not train in {precision} as it does in float32 "
                f"({check.reason}); prepare it with precision='float32' or a wider one."
            )
        report.notes.append(f"In float32: {report.check}")
        report.check = check
    return prepared


def _lower(gm: fx.GraphModule, precision: str, recipe: str, report: PrepareReport) -> None:
    """Make `gm` train in `precision` (in place): under autocast, the inputs of softmax,
    the norms and the loss cast to float32; for fp8, the eligible Linears swapped."""
    from opswap.train.precision import float8_graph, keep_float32

    if precision == "fp8":
        swapped = float8_graph(gm, recipe)
        report.notes.append(
            f"fp8 ({recipe}): {len(swapped)} Linear(s) are Float8Linear"
            + (f" ({', '.join(swapped[:4])})" if swapped else "")
            + "; a Linear whose in or out features are not multiples of 16 stays as it is."
        )
        return
    from opswap.train.precision import autocast_dtype

    kept = keep_float32(gm, autocast_dtype(precision))
    report.notes.append(
        f"{precision} autocast: {len(kept)} op(s) kept in float32"
        + (f" ({', '.join(kept[:6])})" if kept else "")
        + "; matmuls and convolutions run in "
        + precision
        + "."
    )


def _key_groups(model: nn.Module) -> list[list[str]]:
    """The model's state_dict keys grouped by the tensor they name (a tied weight's names
    in one group)."""
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(key)
    return list(groups.values())


def _plan_checked(
    captured: Any,
    model: nn.Module,
    reference: nn.Module,
    names: dict[int, str],
    batch: tuple[Any, ...],
    batches: Sequence[Sequence[Any]] | None,
    allowed: list[str],
    target: str,
    exactness: str,
    report: PrepareReport,
) -> tuple[fx.GraphModule, GradCheck]:
    """Plan with `allowed`, apply, check parameters and gradients; a rule that fails is
    planned alone to see whether it is to blame, refused if so, and the rest planned
    again. Returns the graph and its gradient check."""
    excluded: set[str] = set()
    check: GradCheck | None = None
    for _ in range(3):
        gm, applied, misses = _planned(captured, allowed, excluded, target, exactness)
        why = _parameter_problem(gm, names)
        check = (
            None
            if why
            else verify_grads(reference, gm, batch, captured, batches, exactness, names=names)
        )
        if why is None and check is not None and check.passed:
            report.replaced += [(s.rule, s.description) for s in applied]
            report.left += [(m.rule, m.where, m.reason) for m in misses]
            return gm, check
        blamed = _blame(captured, reference, batch, batches, applied, names, target, exactness)
        if not blamed:
            break
        for rule, reason in blamed.items():
            excluded.add(rule)
            report.refused.append((rule, reason))
    # nothing to blame a failure on: the capture itself (or the loss head) is at fault
    plain = captured.gm
    check = verify_grads(reference, plain, batch, captured, batches, exactness, names=names)
    if not check.passed:
        raise PrepareError(
            f"The captured {type(model).__name__} does not reproduce the model's gradients "
            f"({check.reason}); prepare cannot train it."
        )
    report.notes.append("Every replacement was refused; the prepared module is the capture.")
    return plain, check


def _planned(
    captured: Any, allowed: list[str], excluded: set[str], target: str, exactness: str
) -> tuple[fx.GraphModule, list[Any], list[Any]]:
    from opswap.planner import apply_plan, make_plan

    rules = [r for r in allowed if r not in excluded]
    if not rules:
        return captured.gm, [], []
    plan = make_plan(captured, target=target, rules=rules, exactness=exactness)
    applied = apply_plan(captured, plan)
    return applied.gm, list(applied.applied), list(plan.misses)


def _parameter_problem(gm: nn.Module, names: dict[int, str]) -> str | None:
    extra = _new_parameters(gm, names)
    if extra:
        return (
            f"it makes new parameters ({', '.join(extra[:3])}) from the model's own: "
            "training would update those, not the model"
        )
    return None


def _blame(
    captured: Any,
    reference: nn.Module,
    batch: tuple[Any, ...],
    batches: Sequence[Sequence[Any]] | None,
    applied: list[Any],
    names: dict[int, str],
    target: str,
    exactness: str,
) -> dict[str, str]:
    """rule -> why, for each rule of `applied` that fails on its own."""
    out: dict[str, str] = {}
    for rule in dict.fromkeys(s.rule for s in applied):
        gm, _, _ = _planned(captured, [rule], set(), target, exactness)
        why = _parameter_problem(gm, names)
        if why is None:
            check = verify_grads(reference, gm, batch, captured, batches, exactness, names=names)
            why = None if check.passed else f"its gradients differ from eager's ({check.reason})"
        if why is not None:
            out[rule] = why
    return out
