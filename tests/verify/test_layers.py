import copy

import pytest
import torch
from torch import nn

from opswap.graph.capture import capture
from opswap.graph.ops import is_compute
from opswap.verify.layers import compare_layers


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 6, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 5)
        with torch.no_grad():  # non-trivial statistics so that folding BN changes c1
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))
        x = torch.relu(self.c2(x)) + x
        x = self.pool(self.c3(x)).flatten(1)
        return self.fc(x)


class HalfConv(nn.Module):
    """A conv computed in float16 (what a precision rule would do to one layer)."""

    def __init__(self, conv):
        super().__init__()
        self.conv = copy.deepcopy(conv).half()

    def forward(self, x):
        return self.conv(x.half()).float()


@pytest.fixture(scope="module")
def model_and_input():
    return CNN().eval(), (torch.randn(2, 3, 13, 11),)


@pytest.fixture(scope="module")
def captures(model_and_input):
    m, x = model_and_input
    return {method: capture(m, x, method=method) for method in ("fx", "export")}


def _perturb(gm, name="c2.weight", factor=1.001):
    with torch.no_grad():
        gm.get_parameter(name).mul_(factor)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_perturbed_conv_is_first_divergence(model_and_input, captures, method):
    x = model_and_input[1]
    cap = captures[method]
    assert cap.method == method
    cand = copy.deepcopy(cap.gm)
    _perturb(cand)
    report = compare_layers(cap.gm, cand, x)
    div = report.first_divergence()
    assert div is not None and div.kind == "tolerance"
    assert div.row.module == "c2" and div.row.op == "conv"
    if method == "fx":
        assert div.row.name == "c2"
    assert all(r.metrics.exact for r in report.rows[: div.index] if r.metrics is not None)
    assert "rel_l2" in div.reason and "c2" in str(div)
    assert "<--" in report.table(mark=div)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_unchanged_copy_has_no_divergence(model_and_input, captures, method):
    x = model_and_input[1]
    cap = captures[method]
    report = compare_layers(cap.gm, copy.deepcopy(cap.gm), x)
    assert report.first_divergence() is None
    compared = [r for r in report.rows if r.metrics is not None]
    assert len(compared) >= 8 and all(r.metrics.exact for r in compared)
    # rows follow the reference's topological order
    order = [n.name for n in cap.gm.graph.nodes if is_compute(n)]
    assert [r.name for r in report.rows] == [n for n in order if n in {r.name for r in report.rows}]
    assert report.only_in_reference == [] and report.only_in_candidate == []


def test_jump_found_when_every_row_is_within_tolerance(model_and_input, captures):
    x = model_and_input[1]
    cap = captures["fx"]
    cand = copy.deepcopy(cap.gm)
    cand.c2 = HalfConv(cand.c2)
    report = compare_layers(cap.gm, cand, x)
    div = report.first_divergence("approx")  # fp16 is within approx ...
    assert div is not None and div.kind == "jump" and div.row.name == "c2"  # ... but it starts here
    assert "first error above rounding" in div.reason
    assert report.first_divergence("exact").kind == "tolerance"


def _fold_bn(gm):
    gm = copy.deepcopy(gm)
    c1, bn = gm.c1, gm.bn
    with torch.no_grad():
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        c1.weight.mul_(scale[:, None, None, None])
        c1.bias.copy_((c1.bias - bn.running_mean) * scale + bn.bias)
    node = next(n for n in gm.graph.nodes if n.name == "bn")
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)
    gm.recompile()
    gm.delete_all_unused_submodules()
    return gm


def test_folded_node_paired_through_its_consumer(model_and_input, captures):
    x = model_and_input[1]
    cap = captures["fx"]
    cand = _fold_bn(cap.gm)
    # Without knowing what was rewritten, the fused c1 (conv+bn) is compared with the
    # reference's bare conv output: a false alarm ...
    naive = compare_layers(cap.gm, cand, x)
    assert naive.first_divergence().row.name == "c1"
    assert naive.only_in_reference == []  # bn found its counterpart through relu
    # ... which naming the rewritten nodes removes: bn is measured where relu reads it.
    report = compare_layers(cap.gm, cand, x, rewritten=["c1", "bn"])
    assert report.first_divergence() is None
    rows = {r.name: r for r in report.rows}
    assert rows["bn"].paired_by == "consumer" and rows["bn"].candidate == "c1"
    assert rows["bn"].metrics.rel_l2 < 1e-5
    assert rows["c1"].metrics is None and "rewritten" in rows["c1"].note


def test_nodes_in_one_graph_only(model_and_input, captures):
    x = model_and_input[1]
    cap = captures["fx"]
    cand = copy.deepcopy(cap.gm)
    relu = next(n for n in cand.graph.nodes if n.name == "relu")
    with cand.graph.inserting_after(relu):
        extra = cand.graph.call_function(torch.mul, (relu, 1.0))
    relu.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
    pool = next(n for n in cand.graph.nodes if n.name == "pool")
    pool.target = "pool2"
    cand.add_submodule("pool2", cand.pool)
    cand.recompile()
    report = compare_layers(cap.gm, cand, x)
    assert extra.name in report.only_in_candidate
    assert report.first_divergence() is None
    row = next(r for r in report.rows if r.name == "pool")
    assert row.paired_by == "name"  # the name survives a retargeting


def test_export_module_pairing_when_names_change(model_and_input, captures):
    x = model_and_input[1]
    cap = captures["export"]
    cand = copy.deepcopy(cap.gm)
    _perturb(cand, "c3.weight", 1.01)
    conv = next(
        n
        for n in cand.graph.nodes
        if n.meta.get("nn_module_stack") and list(n.meta["nn_module_stack"].values())[-1][0] == "c3"
    )
    conv.name = "renamed_conv"  # a rewrite that replaced the node under a new name
    cand.recompile()
    report = compare_layers(cap.gm, cand, x)
    div = report.first_divergence()
    assert div.row.module == "c3" and div.row.candidate == "renamed_conv"
    assert div.row.paired_by in ("consumer", "module")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layers(model_and_input):
    m, x = model_and_input
    cap = capture(copy.deepcopy(m).cuda(), (x[0].cuda(),), method="fx")
    cand = copy.deepcopy(cap.gm)
    cand.c2 = HalfConv(cand.c2)
    div = compare_layers(cap.gm, cand, cap.example_inputs).first_divergence("approx")
    assert div is not None and div.row.name == "c2"


def test_applied_candidate_supplies_its_sites(model_and_input, captures):
    from opswap.rules.apply import Applied
    from opswap.rules.base import Site

    x = model_and_input[1]
    cap = captures["fx"]
    folded = _fold_bn(cap.gm)
    applied = Applied(
        type(cap)(folded, "fx", x), [Site("test.fold", "c1", ("c1", "bn"), "fold bn into c1")]
    )
    report = compare_layers(cap, applied, x)
    assert report.first_divergence() is None
    assert {r.name: r for r in report.rows}["bn"].paired_by == "consumer"
