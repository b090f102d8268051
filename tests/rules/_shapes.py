"""Rewrites must be right at every shape the capture claims, not only the example's."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from opswap.graph.dynamic import at


def other_shapes(captured) -> list[tuple[str, tuple]]:
    """Inputs at two sizes other than the example's along each claimed axis, with fresh
    floating values: batch and sequence at 1 (2 when the example is 1) and size + 2; any
    other dim (a time or image axis, which a model may need at least so large, or a
    multiple of its step) at size + step and size + 2 steps."""
    out = []
    for axis in captured.dynamic.axes:
        sizes = (
            (1 if axis.size != 1 else 2, axis.size + 2)
            if axis.name in ("batch", "seq")
            else (axis.size + axis.step, axis.size + 2 * axis.step)
        )
        for n in dict.fromkeys(sizes):
            xs = at(captured.example_inputs, axis, n)
            xs = tuple(
                pytree.tree_map(
                    lambda t: (
                        torch.randn_like(t)
                        if isinstance(t, torch.Tensor) and t.is_floating_point()
                        else t
                    ),
                    list(xs),
                )
            )
            out.append((f"{axis.name} {n}", xs))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.numel() else 0.0


def assert_same_at_other_shapes(model, captured, candidate, rel: float = 1e-4) -> int:
    """The candidate gives the model's outputs (shapes and values) at other batch and
    sequence sizes; returns how many shapes were checked."""
    shapes = other_shapes(captured)
    for label, xs in shapes:
        with torch.no_grad():
            want = pytree.tree_leaves(model(*xs))
            got = pytree.tree_leaves(candidate(*xs))
        assert len(want) == len(got), label
        for w, g in zip(want, got, strict=True):
            if isinstance(w, torch.Tensor):
                assert g.shape == w.shape, (label, g.shape, w.shape)
                if w.is_floating_point():
                    assert _rel(g, w) <= rel, (label, _rel(g, w))
                else:
                    assert torch.equal(g, w), label
    return len(shapes)
