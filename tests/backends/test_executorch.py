"""backends.executorch: a model and opswap's result lowered to ExecuTorch (XNNPACK), raced,
saved as the timed model.pte, reloaded, and refused in one sentence outside its bounds."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import opswap
from opswap import artifact
from opswap.backends.executorch import executorch_artifact, upper_bound
from opswap.errors import InputError


class _Net(nn.Module):
    """Conv + BN (eval, stateful) + in-place ReLU, a counter buffer the forward reads."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 5)
        self.register_buffer("shift", torch.tensor(0.25))

    def forward(self, x):
        h = self.bn(self.conv(x))
        h = torch.relu_(h)
        return self.fc(h.mean((2, 3))) + self.shift


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = _Net().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    model.bn.running_mean.uniform_(-0.3, 0.3)
    return model


def test_export_executorch_races_both_files_and_saves_the_timed_pte(tmp_path):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 12, 12)
    result = opswap.optimize(model, (x,), compare="none", export="executorch", name="net")
    rows = {v.name: v for v in result.variants}
    assert {"executorch", "opswap+executorch"} <= set(rows)
    assert rows["executorch"].verified and rows["opswap+executorch"].verified, (
        rows["executorch"].note,
        rows["opswap+executorch"].note,
    )
    assert "model.pte in ExecuTorch" in rows["opswap+executorch"].note
    assert result.best in ("executorch", "opswap+executorch")
    assert "batch 1" in result.verified_as["shapes"]
    timed = result.saved_artifact
    assert timed is not None and timed.path.suffix == ".pte"
    paths = result.save(tmp_path)
    assert paths["model"] == tmp_path / "model.pte"
    assert not (tmp_path / "model.pt2").exists() and not (tmp_path / "model.onnx").exists()
    assert (tmp_path / "model.pte").read_bytes() == timed.path.read_bytes()
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["deploy"]["artifact"] == "model.pte" and "XNNPACK" in data["deploy"]["run_under"]
    loaded = artifact.load(tmp_path)  # in ExecuTorch's runtime
    xb = torch.randn(5, 3, 9, 9)  # another batch and another spatial size
    with torch.no_grad():
        want = model(xb)
    torch.testing.assert_close(loaded(xb), want, atol=1e-5, rtol=1e-4)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_opswap_ops_and_nhwc_weights_are_lowered_and_sizes_past_the_bound_are_refused():
    from opswap.api import capture
    from opswap.backends.pt2 import export

    model = _model()
    x = torch.randn(3, 3, 10, 10)
    cap = capture(model, (x,))
    # opswap's fused conv + ReLU op, put in by hand: the .pte must hold only ATen/XNNPACK ops
    gm = cap.gm
    from opswap.kernels import conv_relu  # noqa: F401  (registers opswap::conv_relu)

    class _Fused(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            c = self.net.conv
            h = torch.ops.opswap.conv_relu(x, c.weight, c.bias, [1, 1], [1, 1], [1, 1], 1)
            return self.net.fc(h.mean((2, 3)))

    fused = _Fused(model).eval()
    # as layout.channels_last leaves it: an NHWC weight, which XNNPACK's passes refuse
    w = model.conv.weight
    w.data = w.data.contiguous(memory_format=torch.channels_last)
    ex = export(fused, (x,), cap.dynamic)
    assert any("conv_relu" in str(n.target) for n in ex[0].graph.nodes)
    art = executorch_artifact(None, (x,), cap.dynamic, exported=ex)
    assert art.error is None, art.error
    with torch.no_grad():
        torch.testing.assert_close(art.module(x), fused(x), atol=1e-5, rtol=1e-4)
    batch = next(a for a in cap.dynamic.axes if a.name == "batch")
    assert upper_bound(batch) == 12 and "batch up to 12" in art.note
    with pytest.raises(InputError, match="accepts batch up to 12"):
        art.module(torch.randn(13, 3, 10, 10))
    assert gm is cap.gm  # the capture's graph is not replaced by the lowering


# --- attention written out for XNNPACK --------------------------------------------------


def _attention_cases():
    """(kwargs, q, k, v) on odd sizes: no mask, causal with fewer and more queries than
    keys, float masks with rows all -inf, bool masks with rows all False, a 2-D mask."""
    g = torch.Generator().manual_seed(3)

    def qkv(n, m):
        return [torch.randn(2, 3, s, 5, generator=g, dtype=torch.float64) for s in (n, m, m)]

    fmask = torch.randn(2, 1, 7, 9, generator=g, dtype=torch.float64)
    fmask[0, 0, 2] = -torch.inf
    fmask[1, 0, 4, 1:] = -torch.inf
    bmask = torch.rand(2, 1, 7, 9, generator=g) > 0.6
    bmask[1, 0, 0] = False
    return [
        ({}, *qkv(7, 9)),
        ({"is_causal": True}, *qkv(7, 9)),
        ({"is_causal": True}, *qkv(11, 4)),
        ({"attn_mask": fmask}, *qkv(7, 9)),
        ({"attn_mask": bmask, "scale": 0.7}, *qkv(7, 9)),
        ({"attn_mask": bmask[1, 0]}, *qkv(7, 9)),
    ]


@pytest.mark.parametrize("case", range(6))
def test_attention_written_out_computes_what_the_op_computes_with_emptied_rows(case):
    import torch.nn.functional as F

    from opswap.backends.executorch import _attention_written_out

    kw, q, k, v = _attention_cases()[case]
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    got = _attention_written_out(q, k, v, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


class _Attend(nn.Module):
    """Projections, then scaled_dot_product_attention with a bool padding mask made from
    the input (a row of padding queries sees no key), in place ops around it."""

    def __init__(self, mask: bool, causal: bool = False):
        super().__init__()
        self.qkv, self.out = nn.Linear(12, 36), nn.Linear(12, 12)
        self.mask, self.causal = mask, causal

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 3, 4).permute(2, 0, 3, 1, 4)
        m = (keep[:, None, :, None] & keep[:, None, None, :]) if self.mask else None
        h = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=m, is_causal=self.causal
        )
        h = h.transpose(1, 2).reshape(b, n, 12)
        return self.out(h).relu_()


def _non_delegated(edge) -> int:
    gm = edge.exported_program().graph_module
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function"
        and "executorch_call_delegate" not in str(n.target)
        and "getitem" not in str(n.target)
    )


@pytest.mark.parametrize("mask,causal", [(True, False), (False, True)])
def test_attention_is_written_out_for_xnnpack_and_the_pte_matches_at_other_sizes(mask, causal):
    from opswap.api import capture
    from opswap.backends.executorch import lower_to_edge
    from opswap.backends.pt2 import export

    torch.manual_seed(0)
    model = _Attend(mask, causal).eval()
    x, keep = torch.randn(2, 6, 12), torch.ones(2, 6, dtype=torch.bool)
    cap = capture(model, (x, keep))
    ex = export(model, cap.example_inputs, cap.dynamic)
    ours = _non_delegated(lower_to_edge(ex[0], ex[2]))
    theirs = _non_delegated(lower_to_edge(ex[0], ex[2], lowerings=False))
    assert ours < theirs, (ours, theirs)  # the scores' passes are XNNPACK's now
    art = executorch_artifact(None, cap.example_inputs, cap.dynamic, exported=ex)
    assert art.error is None, art.error
    names = [a.name for a in cap.dynamic.axes]
    assert "batch" in names
    # other batch sizes, and other lengths where the capture keeps them dynamic (the mask
    # built from two inputs makes it keep the masked model's length static)
    sizes = [(2, 6), (3, 6), (7, 6)] + ([(3, 5), (2, 9)] if "seq" in names else [])
    assert ("seq" in names) == causal
    for b, n in sizes:
        xb, kb = torch.randn(b, n, 12), torch.rand(b, n) > 0.3
        kb[0, : n // 2] = False  # padding queries: their mask rows are empty
        got = art.module(xb, kb)
        with torch.no_grad():
            want = model(xb, kb)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_attention_for_xnnpack_leaves_dropout_and_grouped_heads_to_executorch():
    from opswap.backends import executorch as et
    from opswap.backends.executorch import _SDPA, attention_for_xnnpack

    class _N:
        def __init__(self, args, kwargs, val=None):
            self.target, self.args, self.kwargs = _SDPA, args, kwargs
            self.meta = {"val": val} if val is not None else {}

    assert attention_for_xnnpack(_N(("q", "k", "v"), {})) is et._attention_written_out
    # the op's output laid out [batch, queries, heads, dim]: the written-out one is too
    inner = torch.empty(2, 5, 4, 8).transpose(1, 2)
    assert attention_for_xnnpack(_N(("q", "k", "v"), {}, inner)) is (
        et._attention_written_out_heads_inner
    )
    plain = torch.empty(2, 4, 5, 8)
    assert attention_for_xnnpack(_N(("q", "k", "v"), {}, plain)) is et._attention_written_out
    q, k, v = (inner.clone().normal_() for _ in range(3))
    got = et._attention_written_out_heads_inner(q, k, v)
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert got.transpose(1, 2).is_contiguous()
    assert attention_for_xnnpack(_N(("q", "k", "v", None, 0.1), {})) is None
    assert attention_for_xnnpack(_N(("q", "k", "v"), {"enable_gqa": True})) is None
    assert attention_for_xnnpack(_N(("q", "k", "v", "m", 0.0, True), {})) is None


def test_export_executorch_leaves_the_attention_rule_out_with_a_note():
    """zoo:bert's written-out attention is what the sdpa rule fuses; with --export
    executorch the rule is left out of the plan (XNNPACK runs the matmuls and softmax
    faster than the one op) and the run says so; without it, the rule plans there."""
    from opswap.config import OptimizeConfig
    from opswap.models import load
    from opswap.stages import capture_stage

    lm = load("zoo:bert")
    rules = ["attention.sdpa"]
    plain = capture_stage(
        lm.module, lm.example_inputs, OptimizeConfig(rules=rules), "bert", lambda s: None
    )
    assert any(d.rule == "attention.sdpa" for d in plain.replan().decisions)
    for export in ("executorch", "pte"):
        config = OptimizeConfig(rules=rules, export=export)
        run = capture_stage(lm.module, lm.example_inputs, config, "bert", lambda s: None)
        assert not run.replan().decisions
        assert any("attention.sdpa left out" in n and ".pte" in n for n in run.notes)


@pytest.mark.parametrize(
    "rules",
    [
        ["attention.sdpa"],  # the op laid its output out as [batch, queries, heads, dim]
        ["fusion.parallel_linear"],  # one projection split in three
        None,  # the whole exact CPU plan
    ],
)
def test_zoo_bert_plans_lowered_with_opswaps_lowerings_run_at_every_batch(rules):
    """Two holes the race's verification found in `opswap optimize zoo:bert --compare
    executorch`: the written-out attention returned a contiguous output where the program
    viewed the op's transposed one (the file could not be lowered), and the split of
    parallel_linear's projection left a .pte that refused every batch but the example's."""
    from opswap import api, planner
    from opswap.graph.dynamic import variants
    from opswap.targets import get_target

    loaded = opswap.load("zoo:bert")
    model = loaded.module.eval()
    captured = api.capture(model, loaded.example_inputs)
    kw = {} if rules is None else {"rules": [*rules, "layout.drop_dropout"]}
    plan = planner.make_plan(captured, target=get_target("cpu"), **kw)
    applied = planner.apply_plan(captured, plan)
    taken = {s.rule for s in applied.applied}
    assert set(rules or ["attention.sdpa", "fusion.parallel_linear"]) <= taken
    art = executorch_artifact(applied.gm, captured.example_inputs, captured.dynamic)
    assert art.module is not None, art.error
    shapes = variants(captured.example_inputs, captured.dynamic)
    assert {"batch 1", "batch 3"} <= {s for s, _ in shapes}
    for _, xs in [("example", captured.example_inputs), *shapes]:
        with torch.no_grad():
            want = model(*xs)
        got = art.module(*xs)
        want = want if isinstance(want, torch.Tensor) else want[0]
        got = got if isinstance(got, torch.Tensor) else got[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
