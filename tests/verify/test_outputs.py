import copy
import json
import math

import pytest
import torch
from torch import nn

from opswap.errors import VerificationError
from opswap.graph.dynamic import detect, variants
from opswap.verify.outputs import verify


class Net(nn.Module):
    def __init__(self, out="tensor"):
        super().__init__()
        self.fc1 = nn.Linear(13, 32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 7)
        self.out = out

    def forward(self, x):
        h = self.fc2(self.drop(torch.relu(self.fc1(x))))
        if self.out == "tuple":
            return h, h.argmax(-1)
        if self.out == "dict":
            return {"logits": h, "hidden": [h.sum(-1), h.mean()]}
        return h


def _x():
    return (torch.randn(5, 13),)


@pytest.mark.parametrize("out", ["tensor", "tuple", "dict"])
def test_identical_models_pass(out):
    m = Net(out)
    v = verify(m, copy.deepcopy(m), _x())
    assert v.passed and v.reasons == []
    assert v.sqnr_db == math.inf and v.cosine == 1.0 and v.max_abs == 0.0
    assert v.samples == 3


def test_output_names_and_json():
    m = Net("dict")
    v = verify(m, copy.deepcopy(m), _x(), samples=2)
    names = [o.name for o in v.outputs]
    assert names == ["output['logits']", "output['hidden'][0]", "output['hidden'][1]"]
    data = json.loads(json.dumps(v.to_json()))
    for key in (
        "max_abs",
        "max_rel",
        "cosine",
        "sqnr_db",
        "rel_l2",
        "passed",
        "reasons",
        "outputs",
        "tolerance",
    ):
        assert key in data
    assert data["passed"] is True


def test_perturbed_candidate_fails_exact_passes_lossy():
    m = Net("tuple")
    c = copy.deepcopy(m)
    with torch.no_grad():
        c.fc2.weight.mul_(1.01)
    v = verify(m, c, _x())
    assert not v.passed
    assert any(r.startswith("output[0]: rel_l2") for r in v.reasons)
    assert v.rel_l2 > 1e-3
    assert verify(m, c, _x(), tolerance="lossy").outputs[0].passed


def test_half_precision_candidate():
    m = Net().eval()
    half = copy.deepcopy(m).half().eval()  # a lambda is not put in eval for us
    v_exact = verify(m, lambda x: half(x.half()).float(), _x())
    v_approx = verify(m, lambda x: half(x.half()).float(), _x(), tolerance="approx")
    assert not v_exact.passed and v_approx.passed
    assert 30 < v_approx.sqnr_db < 90


def test_structure_mismatch_is_a_failure_with_reason():
    m = Net("tuple")
    v = verify(m, lambda x: m(x)[0], _x())
    assert not v.passed
    assert "the candidate returns" in v.reasons[0] and "reference returns" in v.reasons[0]
    assert math.isnan(v.cosine)
    v = verify(Net("dict"), lambda x: {"logits": x, "other": [x, x]}, _x())
    assert not v.passed and "returns" in v.reasons[0]


def test_shape_mismatch_and_candidate_crash():
    m = Net()
    v = verify(m, lambda x: m(x)[:, :6], _x())
    assert not v.passed and "shape (5, 6)" in v.reasons[0]

    def broken(x):
        raise RuntimeError("kernel not supported")

    v = verify(m, broken, _x())
    assert not v.passed and "raised RuntimeError" in v.reasons[0]


def test_reference_crash_is_an_error():
    def broken(x):
        raise ValueError("nope")

    with pytest.raises(VerificationError, match="reference model raised ValueError"):
        verify(broken, Net(), _x())


def test_training_mode_is_compared_from_the_same_random_state():
    m = Net().train()
    c = copy.deepcopy(m)
    v = verify(m, c, _x())  # dropout draws the same masks in both: the same function
    assert v.passed
    assert m.training and m.drop.training and c.training  # modes are not touched
    assert not verify(m, copy.deepcopy(m).eval(), _x()).passed  # dropout on vs off


def test_fresh_samples_catch_input_dependent_bug():
    m = Net()
    ex = (torch.randn(5, 13) * 0.1,)

    def clamps(x):  # wrong only for inputs larger than the example's
        return m(x.clamp(-1.0, 1.0))

    assert verify(m, clamps, ex, samples=1).passed
    wide = (torch.randn(5, 13) * 0.6,)
    assert not verify(m, clamps, wide, samples=4, seed=3).passed


def test_inputs_are_not_shared_between_models():
    m = Net()

    def mutating(x):
        out = m(x)
        x.mul_(2)  # an in-place bug in the candidate must not change the reference's input
        return out

    assert verify(m, mutating, _x()).passed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_half_candidate():
    m = Net().cuda().eval()
    half = copy.deepcopy(m).half()
    x = (torch.randn(5, 13, device="cuda"),)
    v = verify(m, lambda t: half(t.half()).float(), x, tolerance="approx")
    assert v.passed and not verify(m, lambda t: half(t.half()).float(), x).passed


def test_comparison_runs_with_tf32_off_and_restores_it():
    from opswap.verify.outputs import full_precision, verify

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
            return x * 2

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        verify(Probe(), Probe(), (torch.randn(3, 5),), samples=2)
        assert seen and all(s == (False, False) for s in seen)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with full_precision():
            assert not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class _Saturating(nn.Module):
    """Matches `2 * x` only on [0, 1], as a model calibrated for that range does."""

    def forward(self, x):
        return 2 * x.clamp(0.0, 1.0)


class _Double(nn.Module):
    def forward(self, x):
        return 2 * x


def test_given_data_is_judged_on_and_random_draws_stay_in_its_range():
    g = torch.Generator().manual_seed(3)
    data = [(torch.rand(4, 6, generator=g),) for _ in range(3)]
    far = (torch.randn(4, 6, generator=g) * 5,)
    dyn = detect(lambda xs: _Double()(*xs), far, "auto")
    # on random inputs like a far-out example, the saturation shows
    assert not verify(_Double(), _Saturating(), far, samples=3).passed
    v = verify(
        _Double(),
        _Saturating(),
        data[0],
        samples=3,
        given=data,
        variants=variants(data[0], dyn),  # other batch sizes, held in range too
        dynamic=dyn,
    )
    assert v.passed and v.max_abs == 0.0
    assert v.samples == 3 + 2 + len(variants(data[0], dyn))  # the data, 2 draws, the sizes
    shifted = [(x + 0.5,) for (x,) in data]  # data that reaches past 1: it fails there
    assert not verify(_Double(), _Saturating(), shifted[0], samples=1, given=shifted).passed
