"""graph.guards: a program's guard expressions compiled into one check, and only when
they are size arithmetic; the capture's guards (a branch on a size traced one way) kept
and applied by everything opswap makes: the in-memory result and the saved model.pt2
refuse the sizes they exclude in one sentence, a runtime's file keeps a guarded axis
static, and a guard that only restates the model's own limit leaves the axis dynamic."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import opswap
from opswap.api import capture
from opswap.errors import InputError
from opswap.graph.dynamic import guard, variants
from opswap.graph.guards import SizeGuard, compile_guards, refusal


def test_guards_compile_into_one_check_that_names_the_broken_one():
    holds, each = compile_guards(
        [
            "L['x'].size()[1] > 16",
            "L['y'].size()[0] == L['x'].size()[0]",
            "(L['x'].size()[1] - 1) % 2 == 0",
        ],
        ["x", "y"],
    )
    assert holds(torch.zeros(3, 17), torch.zeros(3))
    assert not holds(torch.zeros(3, 18), torch.zeros(3))
    assert not holds(torch.zeros(3, 17), torch.zeros(4))
    text = refusal("m.pt2", (torch.zeros(3, 17), torch.zeros(4)), ["x", "y"], each)
    assert text == (
        "m.pt2: input y has size 4 in dim 0 and input x has size 3 in dim 0, but the "
        "saved program accepts only y.size()[0] == x.size()[0]."
    )


def test_fixed_sizes_the_caller_checks_are_left_out():
    holds, each = compile_guards(["L['x'].size()[1] == 8"], ["x"], frozenset({"x.size()[1] == 8"}))
    assert holds is None and each == []


@pytest.mark.parametrize(
    "code",
    [
        "__import__('os').system('true') == 0",
        "L['x'].size()[0] == open('/etc/passwd') ",
        "L['x'].numpy().size == 1",
        "L['x'].size()[0] == 'a'",
        "L['z'].size()[0] == 1",
        "torch.ops.aten.abs(L['x']) == 1",
        "[c for c in L['x'].size()] == []",
    ],
)
def test_anything_but_size_arithmetic_is_not_compiled(code):
    assert compile_guards([code], ["x"]) is None


class Branch(nn.Module):
    """relu past length 16, tanh up to it (torch.export records `seq >= 17`); a buffer that
    counts calls, and an in-place add."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, mask):  # x [B, T, 8], mask [B, T]
        self.calls += 1
        h = self.fc(x) * mask.unsqueeze(-1)
        h += 1.0
        return h.relu() if x.shape[1] > 16 else h.tanh()


class Limit(nn.Module):
    """A position table cropped to the length: the model refuses lengths past 24, which
    the program's guard (`seq <= 24`) only restates."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("pos", torch.randn(24, 8))

    def forward(self, x):
        return self.fc(x + self.pos[: x.shape[1]])


def _branch_inputs(b=3, t=20):
    mask = torch.ones(b, t)
    mask[0, -3:] = 0
    return torch.randn(b, t, 8), mask


def test_a_branch_on_the_length_is_kept_as_a_guard_and_refused_in_one_sentence():
    torch.manual_seed(0)
    m = Branch()
    cap = capture(m, _branch_inputs())
    assert cap.method == "export"
    assert [a.name for a in cap.dynamic.axes][:1] == ["batch"]
    seq = next(a for a in cap.dynamic.axes if (0, 1) in a.dims)
    assert any(g.branch and (0, 1) in g.dims for g in cap.dynamic.guards), cap.dynamic.guards
    # every size verification uses is inside the guards, the large end included
    sizes = [xs[0].shape[1] for _, xs in variants(cap.example_inputs, cap.dynamic)]
    assert min(sizes) >= 17 and max(sizes) == seq.largest == 80
    fn = guard(cap.gm, cap.example_inputs, cap.dynamic)
    x, mask = _branch_inputs(2, 40)
    with torch.no_grad():
        assert torch.allclose(fn(x, mask), m(x, mask))
    with pytest.raises(InputError, match=r"size 8 in dim 1, .* dim 1 of x >= 17") as e:
        fn(*_branch_inputs(2, 8))
    assert "\n" not in str(e.value)
    # a file that cannot refuse a size keeps the guarded axis static, and says why
    files = cap.dynamic.for_files("model.onnx")
    assert seq not in files.axes and files.axis("batch") is not None
    assert "static" in files.notes[-1] and ">= 17" in files.notes[-1]


def test_the_saved_program_and_every_runtime_file_refuse_what_the_guard_excludes(tmp_path):
    torch.manual_seed(0)
    m = Branch().eval()
    inputs = _branch_inputs()
    r = opswap.optimize(m, inputs, compare="none", bench=False)
    r.save(tmp_path / "run")
    loaded = opswap.load_optimized(tmp_path / "run")
    short, long = _branch_inputs(2, 8), _branch_inputs(2, 33)
    for fn in (r.candidate, loaded):
        with torch.no_grad():
            assert torch.allclose(fn(*long), m(*long), atol=1e-6)
        with pytest.raises(InputError):
            fn(*short)
    pytest.importorskip("onnxruntime")
    exp = opswap.api.export(m, inputs, r.plan, to="onnx", out=tmp_path / "onnx")
    assert exp.verification.passed and "static" in (exp.note or "")
    import onnxruntime as ort

    sess = ort.InferenceSession(str(exp.path), providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), short, strict=True)}
    with pytest.raises(Exception, match="(?i)dimension|shape|invalid"):
        sess.run(None, feed)


def test_a_guard_that_restates_the_models_own_limit_keeps_the_axis_dynamic():
    torch.manual_seed(0)
    m = Limit().eval()
    cap = capture(m, (torch.randn(2, 10, 8),), method="export")
    seq = next(a for a in cap.dynamic.axes if (0, 1) in a.dims)
    assert seq.largest == 24  # the model's own limit, found by bisection below 4 x 10
    limits = [g for g in cap.dynamic.guards if (0, 1) in g.dims]
    assert limits and all(g.branch is False for g in limits), cap.dynamic.guards
    assert cap.dynamic.for_files() is cap.dynamic


def test_a_guard_on_strides_is_read_at_sizes_no_tensor_was_made_for():
    from opswap.graph.guards import Sizes, checker

    holds = checker([SizeGuard("x0.stride()[0] == x0.size()[1] * x0.size()[2]")], 1)
    assert holds is not None
    assert holds[0](Sizes([2, 5, 7])) and holds[0](torch.zeros(3, 4, 6))
    assert Sizes([2, 5, 7]).stride() == torch.zeros(2, 5, 7).stride()
