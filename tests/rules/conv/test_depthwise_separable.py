"""conv.depthwise_separable: a conv whose kernel is separable per input channel becomes a
depthwise conv (the stride, padding, dilation) and a pointwise one (the bias) in fx and
export captures; the candidate passes the lossy budget at other sizes; a dense random
conv, a depthwise conv and a 1x1 are refused with the reason; the plan round-trips."""

from __future__ import annotations

import pytest
import torch
from tests.rules.conv._helpers import (
    Net,
    assert_lossy_ok,
    assert_round_trip,
    convs,
    fired,
    planned,
    reasons,
)
from torch import nn

RULE = "conv.depthwise_separable"


def _separable_conv(c: int, o: int, k: int, **kw) -> nn.Conv2d:
    conv = nn.Conv2d(c, o, k, **kw)
    with torch.no_grad():
        p, d = torch.randn(o, c, 1, 1), torch.randn(1, c, k, k)
        conv.weight.copy_(p * d + 0.001 * torch.randn(o, c, k, k))
    return conv


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_and_passes_the_lossy_budget_at_other_sizes(method, one_torch_thread):
    torch.manual_seed(2)
    net = Net(_separable_conv(8, 20, 5, stride=(2, 1), padding=2, dilation=2)).eval()
    x = torch.randn(2, 8, 14, 11)
    cap, plan, applied = planned(net, x, RULE, method)
    assert fired(plan, RULE) == 1, reasons(plan, RULE)
    record = plan.decisions[0].site.data
    assert record["method"] == "depthwise" and record["rank"] == 1
    assert record["output_error"] < 0.02 and record["macs_after"] < 0.3 * record["macs_before"]
    assert convs(applied.gm) == 3
    assert_lossy_ok(net, applied.gm, [(1, 8, 14, 11), (4, 8, 10, 19)])
    assert_round_trip(cap, plan, applied, x)


def test_refuses_a_dense_conv_a_depthwise_one_and_a_1x1(one_torch_thread):
    torch.manual_seed(0)
    for conv, why in [
        (nn.Conv2d(8, 16, 3, padding=1), "saves nothing"),
        (nn.Conv2d(8, 8, 3, groups=8), "depthwise conv already"),
        (nn.Conv2d(8, 8, 1), "pointwise already"),
    ]:
        _, plan, _ = planned(Net(conv).eval(), torch.randn(1, 8, 9, 7), RULE)
        assert fired(plan, RULE) == 0 and why in reasons(plan, RULE), reasons(plan, RULE)
