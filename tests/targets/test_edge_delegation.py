"""Edge profiles and the delegation analysis, on tiny zoo models and hand-made graphs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.errors import TargetError
from opswap.models.zoo import load_zoo
from opswap.targets.edge import PROFILES, delegation, get_profile, time_ops


def _program(module: nn.Module, *inputs: torch.Tensor) -> torch.export.ExportedProgram:
    return torch.export.export(module.eval(), inputs).run_decompositions()


def test_every_profile_names_its_source_and_takes_a_matmul_or_conv():
    for p in PROFILES.values():
        assert p.source and p.dtypes
        assert p.takes("convolution") or p.takes("linear")
    assert get_profile("XNNPACK") is PROFILES["xnnpack"]
    with pytest.raises(TargetError, match="known edge profiles are"):
        get_profile("hexagon9000")


def test_resnet_is_wholly_taken_by_xnnpack_and_times_every_op():
    m = load_zoo("resnet", "zoo:resnet", {"batch": 1, "image_size": 24, "width": 8})
    ep = _program(m.module, *m.example_inputs)
    d = delegation(ep, "xnnpack", time_ops(ep, tuple(m.example_inputs), repeat=1))
    assert d.basis == "profile" and d.compute_share == 1.0 and d.outside == []
    assert d.time_share == pytest.approx(1.0) and d.timing.startswith("eager CPU")


class _Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erf(x - x.mean(-1, keepdim=True))


def test_ops_left_outside_are_named_with_their_reason():
    ep = _program(_Norm(), torch.randn(3, 5, 7))
    d = delegation(ep, "xnnpack")
    why = {r.op: r.reason for r in d.outside}
    assert set(why) == {"mean", "erf"}
    assert "rank-3" in why["mean"] and "no erf" in why["erf"]
    assert 0 < d.compute_share < 1 and d.time_share is None
    assert "| erf |" in d.markdown()
    # a 4-D mean over the last dim alone: still not XNNPACK's; Vulkan takes it; QNN's HTP
    # takes no float32 at all
    ep4 = _program(_Norm(), torch.randn(2, 3, 4, 5))
    assert "mean" in {r.op for r in delegation(ep4, "xnnpack").outside}
    assert "mean" not in {r.op for r in delegation(ep4, "vulkan").outside}
    qnn = {r.op: r.reason for r in delegation(ep4, "qnn-htp").outside}
    assert "float32" in qnn["sub"] and "int8" in qnn["sub"]


def test_a_lowered_program_counts_the_delegates_ops():
    pytest.importorskip("executorch.exir")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    ep = _program(_Norm(), torch.randn(2, 6, 9))
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    d = delegation(edge, "xnnpack")
    assert d.basis == "lowered"
    assert {r.op for r in d.outside if r.compute} == {"mean", "erf"}
    assert any(r.delegated and r.op == "sub" for r in d.rows)


def test_bad_program_is_refused_in_one_sentence():
    with pytest.raises(TargetError, match="it was given int"):
        delegation(3, "xnnpack")
