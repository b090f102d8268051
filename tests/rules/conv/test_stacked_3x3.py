"""conv.stacked_3x3: a 5x5 conv (groups, dilation, asymmetric padding included) whose kernel two 3x3 convs
can compose becomes those two convs, distilled on the calibration-like samples, in fx and
export captures; the candidate passes the lossy budget at other sizes; a 3x3, an even and
a non-square kernel are refused with the reason (a strided one: it does not pay); the plan round-trips through JSON."""

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

from opswap.rules.conv._decompose import compose

RULE = "conv.stacked_3x3"


def _stackable_conv(c: int, o: int, groups: int = 1, **kw) -> nn.Conv2d:
    """A 5x5 conv whose kernel is two random 3x3 convs composed through a middle of 2
    channels a group, which the rule's wider stack can represent and its fit find."""
    conv = nn.Conv2d(c, o, 5, groups=groups, **kw)
    m = 2 * groups
    with torch.no_grad():
        a = torch.randn(m, c // groups, 3, 3) / 3
        b = torch.randn(o, m // groups, 3, 3) / 3
        conv.weight.copy_(compose(a, b, groups))
    return conv


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("settings", [dict(padding=0), dict(groups=2, padding=(4, 3), dilation=2)])
def test_fires_and_passes_the_lossy_budget_at_other_sizes(method, settings, one_torch_thread):
    torch.manual_seed(3)
    net = Net(_stackable_conv(6, 6, **settings)).eval()
    x = torch.randn(2, 6, 32, 29)
    cap, plan, applied = planned(net, x, RULE, method)
    assert fired(plan, RULE) == 1, reasons(plan, RULE)
    record = plan.decisions[0].site.data
    assert record["method"] == "stacked" and record["output_error"] < 0.15
    assert record["macs_after"] < record["macs_before"]
    assert convs(applied.gm) == 3
    assert_lossy_ok(net, applied.gm, [(1, 6, 32, 29), (3, 6, 35, 30)])
    assert_round_trip(cap, plan, applied, x)


def test_refuses_kernels_it_cannot_stack(one_torch_thread):
    torch.manual_seed(0)
    for conv, why in [
        (nn.Conv2d(4, 4, 3), "its kernel is 3x3"),
        (nn.Conv2d(4, 4, 4), "its kernel is 4x4"),
        (nn.Conv2d(4, 4, (5, 7)), "its kernel is 5x7"),
        (nn.Conv2d(4, 4, 5, stride=2), "at full resolution"),
    ]:
        _, plan, _ = planned(Net(conv).eval(), torch.randn(1, 4, 11, 11), RULE)
        assert fired(plan, RULE) == 0 and why in reasons(plan, RULE), reasons(plan, RULE)
