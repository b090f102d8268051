"""backends.pt2: the saved program reloaded lean, with its guards' meaning kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

from opswap.backends.pt2 import export_artifact, load
from opswap.errors import InputError
from opswap.graph import guards
from opswap.graph.capture import capture
from opswap.graph.dynamic import variants
from opswap.models.checkpoint import program_module, read_program


class _Branchy(nn.Module):
    """Takes one branch for long inputs and another for short ones."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)

    def forward(self, ids):
        h = self.emb(ids)
        return h.relu() if ids.shape[1] > 16 else h.tanh()


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 6)

    def forward(self, ids, attention_mask):
        return self.emb(ids) * attention_mask.unsqueeze(-1)


class _Cat(nn.Module):
    def forward(self, x, y):
        return torch.cat([x, y], dim=1).tanh()


class _TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.topk(self.lin(x), 3)


def _save(model, inputs, shapes, path):
    program = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
    torch.export.save(program, str(path))
    return path


def _torchs(path):
    """The program as torch's own loader builds it, guard function and all."""
    return program_module(read_program(str(path)))


def _ids(*shape, seed=0):
    return torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def branchy(tmp_path_factory):
    torch.manual_seed(0)
    model = _Branchy().eval()
    path = _save(
        model,
        (_ids(2, 32),),
        ({0: Dim.AUTO, 1: Dim.AUTO},),
        tmp_path_factory.mktemp("branchy") / "model.pt2",
    )
    return model, path


def test_a_guard_on_a_size_refuses_the_other_branch(branchy):
    model, path = branchy
    lean = load(path)
    with pytest.raises(
        InputError, match=r"input ids has size 8 in dim 1.*ids\.size\(\)\[1\] >= 17"
    ):
        lean(_ids(2, 8))
    with pytest.raises(Exception, match="Guard failed"):  # torch's own loader agrees
        _torchs(path)(_ids(2, 8))
    with pytest.raises(InputError, match="size 16 in dim 1"):
        lean(_ids(3, 16))


def test_sizes_the_guards_allow_match_the_users_module(branchy):
    model, path = branchy
    lean, full = load(path), _torchs(path)
    with torch.no_grad():
        for i, shape in enumerate([(1, 17), (3, 20), (2, 32), (5, 33), (1, 1000 // 9)]):
            x = _ids(*shape, seed=i)
            torch.testing.assert_close(lean(x), model(x))
            torch.testing.assert_close(lean(x), full(x))


def test_batch_one_runs_where_verification_ran_it(tmp_path):
    """torch puts a lower bound of 2 on a dynamic dim only for its 0/1 specialisation and
    its own guard function does not check it; the lean loader must not either."""
    torch.manual_seed(1)
    model = _Masked().eval()
    inputs = (_ids(4, 9), torch.ones(4, 9))
    cap = capture(model, inputs)
    art = export_artifact(model, inputs, cap.dynamic, tmp_path)
    assert art.ok, art.error
    assert "batch" in [a.name for a in cap.dynamic.axes]
    with torch.no_grad():
        for label, args in variants(inputs, cap.dynamic):
            args = (args[0], torch.rand(args[1].shape))
            torch.testing.assert_close(art.module(*args), model(*args), msg=label)


def test_a_relation_between_inputs_is_checked(tmp_path):
    model = _Cat()
    path = _save(
        model,
        (torch.randn(3, 4), torch.randn(3, 5)),
        ({0: Dim.AUTO, 1: Dim.AUTO}, {0: Dim.AUTO, 1: Dim.AUTO}),
        tmp_path / "cat.pt2",
    )
    lean = load(path)
    x, y = torch.randn(6, 2), torch.randn(6, 7)
    torch.testing.assert_close(lean(x, y), model(x, y))
    with pytest.raises(
        InputError,
        match=r"input x has size 6 in dim 0.*input y has size 5 in dim 0"
        r"|input y has size 5 in dim 0.*input x has size 6 in dim 0",
    ):
        lean(x, torch.randn(5, 7))


def test_a_range_with_an_upper_bound_is_checked(tmp_path):
    model = _Branchy().eval()
    n = Dim("n", min=17, max=40)
    lean = load(_save(model, (_ids(2, 32),), ({1: n},), tmp_path / "bounded.pt2"))
    torch.testing.assert_close(lean(_ids(2, 40)), model(_ids(2, 40)))
    with pytest.raises(InputError, match=r"input ids has size 41 in dim 1.*<= 40"):
        lean(_ids(2, 41))


def test_a_static_size_is_still_checked(tmp_path):
    model = _Branchy().eval()
    lean = load(_save(model, (_ids(2, 32),), None, tmp_path / "static.pt2"))
    with pytest.raises(InputError, match=r"input ids must have size 2 in dim 0"):
        lean(_ids(3, 32))


def test_the_lean_module_drops_torchs_guard_function(branchy):
    _, path = branchy
    nodes = [n for n in load(path).graph.nodes if n.op == "call_module"]
    assert not [n for n in nodes if str(n.target) == "_guards_fn"]


def test_without_compilable_guards_torchs_own_guard_function_stays(branchy, monkeypatch):
    model, path = branchy
    monkeypatch.setattr(guards, "guards_code", lambda program, module: None)
    lean = load(path)
    assert [n for n in lean.graph.nodes if str(n.target) == "_guards_fn"]
    torch.testing.assert_close(lean(_ids(3, 20)), model(_ids(3, 20)))
    # its failure, and a call of another rank or dtype, read as one sentence of opswap's
    with pytest.raises(
        InputError, match=r"^model\.pt2: the inputs break the condition ids\.size\(\)\[1\] >= 17"
    ):
        lean(_ids(2, 8))
    with pytest.raises(InputError, match=r"input ids must be a 2-D torch.int64 tensor, got a 1-D"):
        lean(_ids(20))
    with pytest.raises(
        InputError, match=r"input ids must be a 2-D torch.int64 tensor, got a 2-D torch.int32"
    ):
        lean(_ids(2, 20).int())


class _Pair(nn.Module):
    """Takes a tuple and a dict of tensors, as models with structured inputs do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, pair, extra):
        a, b = pair
        h = self.lin(a) + b * extra["scale"]
        return h.relu() if a.shape[1] > 4 else h.tanh()


def _pair(b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, 6, generator=g), torch.randn(b, t, 6, generator=g)), {
        "scale": torch.rand(b, 1, 1, generator=g)
    }


@pytest.mark.parametrize("compilable", [True, False])
def test_tuple_and_dict_inputs_are_checked_leaf_by_leaf_in_one_sentence(
    tmp_path, monkeypatch, compilable
):
    # a bad call of a loaded program with structured inputs raised IndexError (rank),
    # RuntimeError from inside an op (dtype) or `AssertionError: Guard failed` (size)
    model = _Pair().eval()
    t, b = Dim("t", min=5, max=64), Dim("b")
    shapes = (({0: b, 1: t}, {0: b, 1: t}), {"scale": {0: b}})
    path = _save(model, _pair(2, 9), shapes, tmp_path / "pair.pt2")
    if not compilable:
        monkeypatch.setattr(guards, "guards_code", lambda program, module: None)
    lean = load(path)
    torch.testing.assert_close(lean(*_pair(3, 12, seed=1)), model(*_pair(3, 12, seed=1)))
    (x, y), extra = _pair(3, 12, seed=2)
    bad = {
        "rank": (
            ((x[0], y), extra),
            r"input pair\[0\] must be a 3-D torch.float32 tensor, got a 2-D",
        ),
        "dtype": (
            ((x, y), {"scale": extra["scale"].double()}),
            r"input extra\['scale'\] must be a 3-D torch.float32 tensor, got a 3-D torch.float64",
        ),
        "fixed": (((x[..., :5], y), extra), r"input pair\[0\] must have size 6 in dim 2"),
        "range": (
            ((x[:, :3], y[:, :3]), extra),
            r"pair\[0\].*3 in dim 1.*>= 5|pair\[0\]\.size\(\)\[1\] >= 5",
        ),
        "relation": (
            ((x, y[:, :7]), extra),
            r"pair\[1\]\.size\(\)\[1\] == pair\[0\]\.size\(\)\[1\]",
        ),
        "structure": (
            ((x, y, y), extra),
            r"takes its inputs as pair \(a tuple of 2\), extra \(a dict of scale\).*got a tuple of 3",
        ),
    }
    for args, match in bad.values():
        with pytest.raises(InputError, match=match):
            lean(*args)


def test_recorded_names_are_accepted_as_keywords(tmp_path):
    torch.manual_seed(2)
    model = _Masked().eval()
    shapes = ({0: Dim.AUTO, 1: Dim.AUTO}, {0: Dim.AUTO, 1: Dim.AUTO})
    lean = load(_save(model, (_ids(2, 9), torch.ones(2, 9)), shapes, tmp_path / "kw.pt2"))
    ids, mask = _ids(3, 5, seed=3), (torch.rand(3, 5) > 0.3).float()
    want = model(ids, attention_mask=mask)
    torch.testing.assert_close(lean(ids, attention_mask=mask), want)
    torch.testing.assert_close(lean(ids=ids, attention_mask=mask), want)
    torch.testing.assert_close(lean(attention_mask=mask, ids=ids), want)
    with pytest.raises(InputError, match="attention_mask"):
        lean(ids)
    with pytest.raises(InputError, match="mask"):
        lean(ids, mask=mask)
    with pytest.raises(InputError, match="ids"):
        lean(ids, mask, ids=ids)


def test_a_file_that_cannot_be_saved_leaves_nothing_behind(tmp_path):
    art = export_artifact(_TopK(), (torch.randn(2, 8),), None, tmp_path)
    assert not art.ok and art.path is None
    assert "torch.export" in art.error
    assert list(tmp_path.iterdir()) == []


class _Heads(nn.Module):
    """Returns a dict holding a list and a tuple, as detection and HF-style models do."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.bn = nn.BatchNorm2d(5)
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        pooled = h.mean((2, 3))
        return {"logits": self.fc(pooled), "maps": [h, h.amax(1)], "pair": (pooled, x.shape[0])}


def test_a_rewritten_graph_saves_plain_dicts_and_lists(tmp_path):
    """Non-strict export of an fx.GraphModule records FX's immutable_dict/immutable_list;
    the saved program must give back the user's own container types."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    import opswap
    from opswap.planner import make_plan

    torch.manual_seed(0)
    model = _Heads().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 9, 11)
    cap = capture(model, (x,))
    gm = opswap.apply(model, (x,), make_plan(cap, target="cpu", rules="fusion.conv_bn"))
    assert any(n.op == "call_module" for n in gm.graph.nodes)
    art = export_artifact(gm, (x,), cap.dynamic, tmp_path)
    assert art.ok, art.error
    xb = torch.randn(3, 3, 7, 8)  # another batch and image size
    with torch.no_grad():
        want, got = model(xb), load(art.path)(xb)
    assert type(got) is dict and type(got["maps"]) is list and type(got["pair"]) is tuple
    assert not isinstance(got, immutable_dict) and not isinstance(got["maps"], immutable_list)
    assert got["pair"][1] == 3
    torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["maps"][1], want["maps"][1], atol=1e-5, rtol=1e-5)


def test_the_opswap_variant_of_a_dict_model_is_verified():
    import opswap

    torch.manual_seed(0)
    model = _Heads().eval()
    result = opswap.optimize(
        model, (torch.randn(2, 3, 9, 11),), rules="fusion.conv_bn", compare="none", samples=1
    )
    variants = {v["name"]: v for v in result.to_json()["variants"]}
    assert variants["opswap"]["verified"], variants["opswap"]
    assert variants["opswap"]["note"].startswith("reloaded from model.pt2")
