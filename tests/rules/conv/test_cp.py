"""conv.cp: a conv whose kernel has low CP rank becomes 1x1 -> depthwise kx1 -> depthwise
1xk -> 1x1 in fx and export captures, with stride, padding and dilation split per axis; the
candidate passes the lossy budget at other sizes; a random conv (high CP rank), a 1x1 and
a grouped conv are refused with the reason; the plan round-trips through JSON."""

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

from opswap.rules.conv._decompose import cp_tensor

RULE = "conv.cp"


def _cp_conv(c: int, o: int, k: tuple[int, int], rank: int, **kw) -> nn.Conv2d:
    conv = nn.Conv2d(c, o, k, **kw)
    with torch.no_grad():
        w = cp_tensor([torch.randn(n, rank) for n in (o, c, *k)])
        conv.weight.copy_(w / w.norm())
    return conv


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fires_and_passes_the_lossy_budget_at_other_sizes(method, one_torch_thread):
    torch.manual_seed(1)
    net = Net(_cp_conv(10, 16, (3, 5), 4, stride=2, padding=(0, 2), dilation=(2, 1))).eval()
    x = torch.randn(2, 10, 15, 12)
    cap, plan, applied = planned(net, x, RULE, method)
    assert fired(plan, RULE) == 1, reasons(plan, RULE)
    record = plan.decisions[0].site.data
    assert record["method"] == "cp" and record["rank"] <= 4
    assert record["output_error"] < 0.1 and record["params_after"] < record["params_before"]
    assert convs(applied.gm) == 5  # four in the chain, the head
    assert_lossy_ok(net, applied.gm, [(1, 10, 15, 12), (3, 10, 11, 17)])
    assert_round_trip(cap, plan, applied, x)


def test_refuses_a_random_conv_a_1x1_and_a_grouped_one(one_torch_thread):
    torch.manual_seed(0)
    for conv, why in [
        (nn.Conv2d(6, 6, 3, padding=1), "saves nothing"),
        (nn.Conv2d(6, 6, 1), "no spatial factors"),
        (nn.Conv2d(6, 6, 3, groups=3), "groups=3"),
    ]:
        _, plan, _ = planned(Net(conv).eval(), torch.randn(1, 6, 8, 8), RULE)
        assert fired(plan, RULE) == 0 and why in reasons(plan, RULE), reasons(plan, RULE)
