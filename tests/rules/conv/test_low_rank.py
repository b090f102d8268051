"""conv.low_rank: a conv whose weight is nearly of low rank becomes two thin convs in fx
and export captures, at odd settings (stride, padding, dilation, non-square kernel); the
candidate passes the lossy budget against the model at other batch and image sizes; the
Found states errors and savings; a full-rank conv and a grouped one are refused with the
reason; the plan round-trips through JSON."""

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

RULE = "conv.low_rank"


def _low_rank_conv(c: int, o: int, k: tuple[int, int], rank: int, **kw) -> nn.Conv2d:
    conv = nn.Conv2d(c, o, k, **kw)
    with torch.no_grad():
        a, b = torch.randn(o, rank), torch.randn(rank, c * k[0] * k[1])
        w = (a @ b).reshape(o, c, *k)
        conv.weight.copy_(w / w.norm() + 0.002 * torch.randn_like(w) / w[0].numel() ** 0.5)
    return conv


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize(
    "settings",
    [
        dict(k=(3, 3), stride=2, padding=0, dilation=1),
        dict(k=(3, 5), stride=(1, 2), padding=(2, 1), dilation=2),
    ],
)
def test_fires_and_passes_the_lossy_budget_at_other_sizes(method, settings, one_torch_thread):
    torch.manual_seed(0)
    settings = dict(settings)
    k = settings.pop("k")
    net = Net(_low_rank_conv(12, 24, k, 3, **settings)).eval()
    x = torch.randn(2, 12, 13, 11)
    cap, plan, applied = planned(net, x, RULE, method)
    assert fired(plan, RULE) == 1, reasons(plan, RULE)
    record = plan.decisions[0].site.data
    assert record["rank"] == 3 and record["method"] in ("channel", "spatial")
    assert record["output_error"] < 0.05 and record["macs_after"] < record["macs_before"]
    assert convs(applied.gm) == 3
    assert_lossy_ok(net, applied.gm, [(1, 12, 13, 11), (5, 12, 9, 16)])
    assert_round_trip(cap, plan, applied, x)


def test_refuses_a_full_rank_conv_and_a_grouped_one(one_torch_thread):
    torch.manual_seed(0)
    net = Net(nn.Conv2d(8, 8, 3, padding=1)).eval()
    _, plan, _ = planned(net, torch.randn(1, 8, 7, 9), RULE)
    assert fired(plan, RULE) == 0
    assert "saves nothing" in reasons(plan, RULE) and "needs rank" in reasons(plan, RULE)
    net = Net(nn.Conv2d(8, 8, 3, groups=2, padding=1)).eval()
    _, plan, _ = planned(net, torch.randn(1, 8, 7, 9), RULE)
    assert "groups=2" in reasons(plan, RULE)


def test_the_error_is_measured_on_the_calibration_samples_when_there_are_some(one_torch_thread):
    from opswap.graph.calibrate import Calibration, attach
    from opswap.graph.capture import capture
    from opswap.planner import make_plan

    torch.manual_seed(0)
    net = Net(_low_rank_conv(6, 12, (3, 3), 2, padding=1)).eval()
    x = torch.randn(2, 6, 9, 8)
    cap = capture(net, (x,))
    plain = make_plan(cap, rules=[RULE], exactness="lossy", keep_slower=True)
    assert plain.decisions[0].site.data["error_on"] == "random inputs"
    # inputs far from white noise: one constant image per sample
    samples = [(torch.ones(3, 6, 9, 8) * torch.randn(3, 6, 1, 1),) for _ in range(2)]
    attach(cap.gm, Calibration(samples, source="batches from the test"))
    plan = make_plan(cap, rules=[RULE], exactness="lossy", keep_slower=True)
    data = plan.decisions[0].site.data
    assert data["error_on"] == "batches from the test"
    assert data["output_error"] != plain.decisions[0].site.data["output_error"]
