"""Structured pruning (chapter 7): remove whole channels, features and attention heads, so
that the model that comes back is physically smaller (its convs and Linears have fewer
rows and columns) and faster on any runtime, not only where sparse kernels exist.

    pruned = prune(model, example_inputs, ratio=0.5)                  # L1 magnitude
    pruned = prune(model, example_inputs, 0.5, importance="taylor",
                   loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), batches=data)
    pruned.model, pruned.params_after / pruned.params_before, pruned.groups

The dependency graph (train/_prune_graph.py) says which channels must go together: a
conv's output channels with its BatchNorm and every reader's input channels, both branches
of a residual add, the offset of each part of a concat, a flatten's H*W inputs per
channel, the Q/K/V/output projections of an attention module by whole heads (its head
count follows), an MLP's up and gate projections with its down projection. Each group
keeps `1 - ratio` of its channels (rounded to a multiple of `round_to` if asked), those
that score highest: the L1 or L2 norm of every weight slice the channel owns, or Taylor's
first-order estimate of the loss change, |w * dL/dw| summed over a few calibration
batches of the user's loss. Groups that reach the model's output (the classes), its
inputs, or an op the walk does not follow are left whole and say why (`Group.blocked`).

The user's model is never changed: the pruned model is a copy of it, of the same classes,
with smaller tensors and the size attributes (`out_features`, `num_features`, the head
count, ...) rewritten to match. Pruning changes the function; fine-tune after it
(opswap.train.finetune_sparse).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from opswap.errors import RuleError
from opswap.train._prune_graph import HEAD_ATTRS, Dependencies
from opswap.train._prune_spaces import Segment

Importance = Literal["l1", "l2", "taylor"]
IMPORTANCES = ("l1", "l2", "taylor")


@dataclass(frozen=True)
class Group:
    """One set of channels pruned together: where it starts, its size (channels), how many
    it keeps, the unit it is pruned by (the head dim for heads), the tensors it slices, and
    why it was left whole (None when it was pruned)."""

    name: str
    size: int
    kept: int
    unit: int
    tensors: tuple[str, ...]
    blocked: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Pruned:
    """The pruned copy and what it weighs: parameters and multiply-accumulates at the
    example's shapes, before and after."""

    model: nn.Module
    groups: list[Group]
    ratio: float
    importance: str
    params_before: int
    params_after: int
    macs_before: int
    macs_after: int

    def to_json(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "importance": self.importance,
            "params_before": self.params_before,
            "params_after": self.params_after,
            "macs_before": self.macs_before,
            "macs_after": self.macs_after,
            "groups": [g.to_json() for g in self.groups],
        }


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: nn.Module, example_inputs: tuple[Any, ...]) -> int:
    """Multiply-accumulates of one call at `example_inputs` (FLOPs / 2, as PyTorch's flop
    counter counts matmuls and convolutions)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*example_inputs)
    return int(counter.get_total_flops() // 2)


def _check_args(ratio: float, importance: str, round_to: int) -> None:
    if not 0.0 <= ratio < 1.0:
        raise RuleError(f"the pruning ratio must be in [0, 1), got {ratio}.")
    if importance not in IMPORTANCES:
        raise RuleError(f"importance must be one of {', '.join(IMPORTANCES)}, got {importance!r}.")
    if round_to < 1:
        raise RuleError(f"round_to must be a positive channel count, got {round_to}.")


def _tensor(model: nn.Module, path: str) -> torch.Tensor:
    mod_path, _, name = path.rpartition(".")
    t = getattr(model.get_submodule(mod_path), name)
    assert isinstance(t, torch.Tensor)
    return t


def _rows(deps: Dependencies, segs: tuple[Segment, ...]) -> list[tuple[int, int, int]]:
    """(root space, offset, inner) of each segment along a tensor dim."""
    out, offset = [], 0
    for s in segs:
        root = deps.find(s.space)
        out.append((root, offset, s.inner))
        offset += deps.spaces[root].size * s.inner
    return out


def _layout_ok(deps: Dependencies, model: nn.Module) -> None:
    """Block spaces whose members' layouts do not add up to the tensors' sizes."""
    for (path, dim), segs in deps.members.items():
        rows = _rows(deps, segs)
        total = sum(deps.spaces[r].size * inner for r, _, inner in rows)
        if _tensor(model, path).shape[dim] != total:
            for r, _, _ in rows:
                deps.spaces[r].blocked.append(f"{path}'s size does not match the channels it holds")


def _scores(
    deps: Dependencies, model: nn.Module, importance: str, grads: dict[str, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Per root space, one score per channel, from every parameter slice it owns."""
    params = dict(model.named_parameters())
    scores = {r: torch.zeros(deps.spaces[r].size, dtype=torch.float64) for r in deps.roots()}
    for (path, dim), segs in deps.members.items():
        if path not in params:
            continue  # buffers (running statistics) say nothing about importance
        w = params[path].detach().double().cpu()  # scores are kept on the CPU
        if importance == "taylor":
            if path not in grads:
                continue
            w = (w * grads[path].double().cpu()).abs()
        per_row = w.movedim(dim, 0).reshape(w.shape[dim], -1)
        per_row = per_row.pow(2).sum(1) if importance == "l2" else per_row.abs().sum(1)
        for root, offset, inner in _rows(deps, segs):
            n = deps.spaces[root].size
            scores[root] += per_row[offset : offset + n * inner].view(n, inner).sum(1)
    if importance == "l2":
        scores = {r: s.sqrt() for r, s in scores.items()}
    return scores


def _taylor_grads(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    batches: Iterable[Any],
) -> dict[str, torch.Tensor]:
    if loss_fn is None:
        raise RuleError("Taylor importance needs loss_fn(model, batch) -> loss and batches.")
    model.zero_grad(set_to_none=True)
    seen = 0
    with torch.enable_grad():
        for batch in batches:
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise RuleError("loss_fn must return a one-element loss tensor.")
            loss.backward()
            seen += 1
    if seen == 0:
        raise RuleError("Taylor importance got no calibration batches; pass a few.")
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _keep_count(size: int, unit: int, ratio: float, round_to: int) -> int:
    units = size // unit
    keep = max(1, round(units * (1.0 - ratio)))
    if unit == 1 and round_to > 1 and size >= round_to:
        keep = min(size, max(round_to, round(keep / round_to) * round_to))
    return keep * unit


def _keep_index(score: torch.Tensor, unit: int, keep: int) -> torch.Tensor:
    per_unit = score.view(-1, unit).sum(1)
    top = torch.topk(per_unit, keep // unit, largest=True, sorted=False).indices.sort().values
    return (top[:, None] * unit + torch.arange(unit)[None, :]).flatten()


def _set_tensor(model: nn.Module, path: str, value: torch.Tensor) -> None:
    mod_path, _, name = path.rpartition(".")
    mod = model.get_submodule(mod_path)
    old = getattr(mod, name)
    if isinstance(old, nn.Parameter):
        mod._parameters[name] = nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)
    else:
        mod._buffers[name] = value.contiguous()


def _fix_sizes(model: nn.Module, depthwise: set[str]) -> None:
    """Rewrite each module's size attributes from its (sliced) tensors."""
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod.out_features, mod.in_features = mod.weight.shape
        elif isinstance(mod, nn.modules.conv._ConvNd):
            if path in depthwise:
                mod.groups = mod.weight.shape[0]
            mod.out_channels = mod.weight.shape[0]
            mod.in_channels = mod.weight.shape[1] * mod.groups
        elif isinstance(
            mod, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
        ):
            ref = mod.weight if mod.weight is not None else mod.running_mean
            if ref is not None:
                mod.num_features = ref.shape[0]
        elif isinstance(mod, nn.LayerNorm) and mod.weight is not None:
            mod.normalized_shape = (mod.weight.shape[0],)
        elif isinstance(mod, nn.Embedding):
            mod.embedding_dim = mod.weight.shape[1]


def dependency_groups(
    model: nn.Module, example_inputs: tuple[Any, ...], keep: Iterable[str] = ()
) -> list[Group]:
    """The groups structured pruning would prune in `model`, unpruned (kept = size)."""
    deps = Dependencies(model, example_inputs)
    _block_kept(deps, tuple(keep))
    _layout_ok(deps, model)
    return _groups(deps, {})


def _block_kept(deps: Dependencies, keep: tuple[str, ...]) -> None:
    """Leave whole the output channels of the modules named in `keep` (and of those inside
    them): the groups that hold their output dim (an Embedding's width, any other's rows)."""
    layers = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding, nn.LayerNorm,
              nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)  # fmt: skip
    for (path, dim), segs in deps.members.items():
        owner_path = path.rpartition(".")[0]
        if not any(owner_path == k or owner_path.startswith(k + ".") for k in keep):
            continue
        owner = deps.model.get_submodule(owner_path)
        out_dim = 1 if isinstance(owner, nn.Embedding) else 0
        if isinstance(owner, layers) and dim != out_dim:
            continue
        for root, _, _ in _rows(deps, segs):
            deps.spaces[root].blocked.append(f"{owner_path} is kept whole (keep=)")


def _groups(deps: Dependencies, kept: dict[int, int]) -> list[Group]:
    tensors: dict[int, list[str]] = {}
    for (path, dim), segs in deps.members.items():
        for root, _, _ in _rows(deps, segs):
            tensors.setdefault(root, []).append(f"{path}[dim {dim}]")
    out = []
    for r in deps.roots():
        sp = deps.spaces[r]
        if r not in tensors and not sp.heads:
            continue
        out.append(
            Group(
                sp.origin,
                sp.size,
                kept.get(r, sp.size),
                sp.unit,
                tuple(dict.fromkeys(tensors.get(r, []))),
                sp.blocked[0] if sp.blocked else None,
            )
        )
    return out


def prune(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    ratio: float = 0.5,
    *,
    importance: Importance = "l1",
    round_to: int = 1,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    batches: Iterable[Any] = (),
    keep: Iterable[str] = (),
) -> Pruned:
    """A copy of `model` with `ratio` of the channels of every prunable group removed
    (those of least `importance`), and what it saves; `keep` names modules whose channels
    stay whole. The copy runs on `example_inputs` and returns outputs of the same shape."""
    _check_args(ratio, importance, round_to)
    if not isinstance(model, nn.Module):
        raise RuleError(f"prune takes an nn.Module, got {type(model).__name__}.")
    inputs = (
        tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    )
    work = copy.deepcopy(model)
    was_training = work.training
    work.eval()
    deps = Dependencies(work, inputs)
    _block_kept(deps, tuple(keep))
    _layout_ok(deps, work)
    grads = _taylor_grads(work, loss_fn, batches) if importance == "taylor" else {}
    scores = _scores(deps, work, importance, grads)

    keep_idx: dict[int, torch.Tensor] = {}
    for r in deps.roots():
        sp = deps.spaces[r]
        if sp.blocked or sp.size < 2:
            continue
        n = _keep_count(sp.size, sp.unit, ratio, round_to)
        if n < sp.size:
            keep_idx[r] = _keep_index(scores[r], sp.unit, n)

    original = copy.deepcopy(model).eval()  # the user's module itself is never called
    with torch.no_grad():
        ref = original(*inputs)
    pruned = _apply(work, deps, keep_idx, was_training)
    why = _runs(pruned, inputs, ref)
    heads = [r for r in keep_idx if deps.spaces[r].heads]
    if why is not None and heads:  # a forward that writes the width as heads x head dim
        for r in heads:
            del keep_idx[r]
            deps.spaces[r].blocked.append(f"the forward fails with heads removed ({why})")
        pruned = _apply(work, deps, keep_idx, was_training)
        why = _runs(pruned, inputs, ref)
    if why is not None:
        raise RuleError(
            f"the pruned {type(model).__name__} fails to run ({why}); its forward may write "
            "a channel count as a number: name that module in keep=."
        )
    kept = {r: len(i) for r, i in keep_idx.items()}
    return Pruned(
        pruned,
        _groups(deps, kept),
        ratio,
        importance,
        count_params(model),
        count_params(pruned),
        count_macs(original, inputs),
        count_macs(copy.deepcopy(pruned).eval(), inputs),
    )


def _apply(
    work: nn.Module, deps: Dependencies, keep_idx: dict[int, torch.Tensor], training: bool
) -> nn.Module:
    """A copy of `work` with every member sliced to the kept channels of its groups."""
    out = copy.deepcopy(work)
    depthwise = {
        p for p, m in out.named_modules()
        if isinstance(m, nn.modules.conv._ConvNd) and m.groups > 1 and m.groups == m.in_channels == m.out_channels
    }  # fmt: skip
    with torch.no_grad():
        for (path, dim), segs in deps.members.items():
            rows = _rows(deps, segs)
            if not any(r in keep_idx for r, _, _ in rows):
                continue
            parts = []
            for root, offset, inner in rows:
                idx = keep_idx.get(root, torch.arange(deps.spaces[root].size))
                parts.append((offset + idx[:, None] * inner + torch.arange(inner)).flatten())
            t = _tensor(out, path)
            _set_tensor(out, path, t.index_select(dim, torch.cat(parts).to(t.device)))
    _fix_sizes(out, depthwise)
    for r, idx in keep_idx.items():
        sp = deps.spaces[r]
        for mod_path, attr in sp.heads:
            mod = out.get_submodule(mod_path)
            setattr(mod, attr, len(idx) // sp.unit)
            if isinstance(getattr(mod, "all_head_size", None), int):
                setattr(mod, "all_head_size", len(idx))  # noqa: B010 - Hugging Face's name
    return out.train(training)


def _runs(pruned: nn.Module, inputs: tuple[Any, ...], ref: Any) -> str | None:
    """None if `pruned` runs on `inputs` and returns what `ref` is shaped as, else why not."""
    mode = pruned.training
    pruned.eval()
    try:
        with torch.no_grad():
            out = pruned(*inputs)
    except Exception as exc:  # noqa: BLE001 - the user's forward, in one sentence
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        pruned.train(mode)
    if isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor) and ref.shape != out.shape:
        return f"it returns {tuple(out.shape)}, not {tuple(ref.shape)}"
    return None


__all__ = [
    "HEAD_ATTRS",
    "Group",
    "Pruned",
    "count_macs",
    "count_params",
    "dependency_groups",
    "prune",
]
