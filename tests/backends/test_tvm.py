"""backends.tvm: a model and opswap's result built by Apache TVM (Relax) for this CPU, run
by Relax's VM at other sizes than the example's, raced with `--compare tvm`, saved as the
timed model.so, and refused in one sentence where it cannot run.

Skipped where apache-tvm is not installed (pip install 'opswap[tvm]')."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("tvm", reason="apache-tvm is not installed (pip install 'opswap[tvm]')")

import opswap  # noqa: E402
from opswap import api, planner  # noqa: E402
from opswap.backends.pt2 import export  # noqa: E402
from opswap.backends.tvm import TvmModule, tvm_artifact  # noqa: E402
from opswap.errors import ExportError, InputError  # noqa: E402
from opswap.graph.dynamic import variants  # noqa: E402
from opswap.targets import get_target  # noqa: E402


class _Net(nn.Module):
    """Conv + BN (eval) + ReLU, pooled, a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _net() -> nn.Module:
    torch.manual_seed(0)
    model = _Net().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    model.bn.running_mean.uniform_(-0.3, 0.3)
    return model


class _Block(nn.Module):
    """A pre-norm transformer block over token ids: embeddings with a position table (cut
    to the sequence length), SDPA attention, a GELU MLP; returns a dict."""

    def __init__(self, vocab=40, dim=16, heads=2, max_len=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.register_buffer("positions", torch.arange(max_len), persistent=False)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.heads = heads

    def forward(self, ids):
        b, s = ids.shape
        h = self.tok(ids) + self.pos(self.positions[:s])
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        h = h + self.out(a.transpose(1, 2).reshape(b, s, -1))
        h = h + self.mlp(self.norm2(h))
        return {"hidden": h, "pooled": h.mean(1)}


def _runs_like(model, module, captured, atol=1e-4):
    shapes = [("example", captured.example_inputs)] + variants(
        captured.example_inputs, captured.dynamic
    )
    for _, xs in shapes:
        with torch.no_grad():
            want = model(*xs)
        got = module(*xs)
        assert type(got) is type(want)
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    return [s for s, _ in shapes]


def test_cnn_with_conv_bn_and_conv_relu_fired_runs_in_tvm_at_other_sizes(tmp_path):
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = api.capture(model, (torch.randn(2, 3, 10, 10),))
    rules = ["fusion.conv_bn", "fusion.conv_relu"]
    plan = planner.make_plan(captured, target=get_target("cpu"), rules=rules)
    applied = planner.apply_plan(captured, plan)
    assert set(rules) <= {s.rule for s in applied.applied}
    exported = export(applied.gm, captured.example_inputs, captured.dynamic)
    ops = {str(n.target) for n in exported[0].graph.nodes if n.op == "call_function"}
    assert any(o.startswith("opswap.") for o in ops), ops  # traced into ATen ops for TVM
    art = tvm_artifact(None, captured.example_inputs, captured.dynamic, tmp_path, exported=exported)
    assert isinstance(art.module, TvmModule), art.error
    assert art.path == tmp_path / "model.so" and "not tuned" in art.note
    labels = _runs_like(model, art.module, captured)
    assert "batch 1" in labels and len(labels) >= 3
    xb = torch.randn(5, 3, 13, 13)  # another batch and another image size
    with torch.no_grad():
        torch.testing.assert_close(art.module(xb), model(xb), atol=1e-4, rtol=1e-4)
    other = copy.deepcopy(art.module)  # a loaded library is not copied: it loads anew
    assert other.vm is not art.module.vm
    torch.testing.assert_close(other(xb), art.module(xb))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_transformer_block_keeps_batch_and_length_dynamic_up_to_its_table(tmp_path):
    torch.manual_seed(0)
    model = _Block().eval()
    captured = api.capture(model, (torch.randint(0, 40, (2, 12)),))
    assert {a.name for a in captured.dynamic.axes} == {"batch", "seq"}
    art = tvm_artifact(model, captured.example_inputs, captured.dynamic, tmp_path)
    assert art.module is not None, art.error
    assert art.kept is not None and len(art.kept.axes) == 2, art.note  # nothing made static
    labels = _runs_like(model, art.module, captured)
    assert any(s.startswith("seq") for s in labels)
    ids = torch.randint(0, 40, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(art.module(ids), model(ids), atol=1e-4, rtol=1e-4)
    with pytest.raises(InputError, match=r"accepts seq up to 32 .*input ids has 33"):
        art.module(torch.randint(0, 40, (1, 33)))  # past the position table
    with pytest.raises(InputError, match="takes input ids with 2 dims, got 1"):
        art.module(torch.randint(0, 40, (5,)))
    with pytest.raises(InputError, match="takes 1 input tensor"):
        art.module(ids, ids)


def test_a_size_tvm_cannot_keep_dynamic_is_built_static_and_refused_in_one_sentence(
    monkeypatch, tmp_path
):
    from opswap.backends import tvm as backend

    real = backend._build

    def static_only(program, *args):
        names = set(program.graph_signature.user_inputs)
        for node in program.graph.nodes:
            shape = getattr(node.meta.get("val"), "shape", ())
            if node.name in names and not all(isinstance(n, int) for n in shape):
                raise RuntimeError("cannot lower a symbolic extent")
        return real(program, *args)

    monkeypatch.setattr(backend, "_build", static_only)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    captured = api.capture(model, (torch.randn(4, 8),))
    art = tvm_artifact(model, captured.example_inputs, captured.dynamic, tmp_path)
    assert art.module is not None, art.error
    assert "accepts the example's shapes only" in art.note
    assert "cannot lower a symbolic extent" in art.note
    assert art.kept is not None and not art.kept.axes  # verification claims the example only
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(art.module(x), model(x), atol=1e-5, rtol=1e-4)
    with pytest.raises(InputError, match="takes input input with size 4 in dim 0 only; it has 3"):
        art.module(torch.randn(3, 8))


def test_compare_tvm_races_both_builds_and_a_winner_saves_its_library(tmp_path):
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 10, 10)
    result = opswap.optimize(
        model, (x,), rules=["fusion.conv_bn"], compare="tvm", name="net", samples=1
    )
    rows = {v.name: v for v in result.variants}
    assert {"tvm", "opswap+tvm"} <= set(rows) and "ort" not in rows
    for name in ("tvm", "opswap+tvm"):
        assert rows[name].verified and rows[name].ms is not None, rows[name].note
        assert rows[name].note.startswith("model.so in TVM (CPU")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # what a TVM winner saves: the very library that was timed, and how to run it
    timed = result.artifacts["tvm_candidate"]
    won = dataclasses.replace(
        result, best="opswap+tvm", verified_as={"variant": "opswap+tvm", "shapes": []}
    )
    paths = won.save(tmp_path)
    assert paths["model"] == tmp_path / "model.so" and not (tmp_path / "model.pt2").exists()
    assert (tmp_path / "model.so").read_bytes() == timed.path.read_bytes()
    deploy = json.loads((tmp_path / "result.json").read_text())["deploy"]
    assert deploy["artifact"] == "model.so" and deploy["run_under"].startswith("tvm")
    loaded = opswap.load_optimized(tmp_path)
    assert isinstance(loaded, TvmModule)
    xb = torch.randn(5, 3, 13, 13)
    with torch.no_grad():
        torch.testing.assert_close(loaded(xb), model(xb), atol=1e-4, rtol=1e-4)


def test_without_tvm_the_variants_say_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tvm", None)  # import tvm fails
    model = nn.Linear(4, 2).eval()
    art = tvm_artifact(model, (torch.randn(3, 4),), None)
    assert art.module is None
    assert (
        art.error == "Running in TVM needs apache-tvm; install it with pip install 'opswap[tvm]'."
    )
    with pytest.raises(ExportError, match=r"opswap\[tvm\]"):
        TvmModule("model.so")


def test_compare_takes_tvm_as_a_baseline():
    from opswap.bench.variants import parse_compare

    assert parse_compare("tvm") == ["tvm"]
    assert parse_compare("ort,tvm") == ["ort", "tvm"]


def test_tuning_builds_at_the_example_shapes_and_says_so(monkeypatch, tmp_path):
    from opswap.backends import tvm as backend

    tuned = []  # MetaSchedule itself takes minutes here (docs/chapters/21): stood in for
    monkeypatch.setattr(backend, "_tuned", lambda mod, target, n, d: tuned.append(n) or mod)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    captured = api.capture(model, (torch.randn(4, 8),))
    assert captured.dynamic.axes  # batch: MetaSchedule tunes static kernels
    art = tvm_artifact(model, captured.example_inputs, captured.dynamic, tmp_path, tune_trials=8)
    assert art.module is not None and tuned == [8], art.error
    assert "MetaSchedule-tuned (8 trials)" in art.note
    assert "accepts the example's shapes only (MetaSchedule tunes kernels of static" in art.note
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(art.module(x), model(x), atol=1e-5, rtol=1e-4)
    with pytest.raises(InputError, match="size 4 in dim 0 only"):
        art.module(torch.randn(2, 8))
