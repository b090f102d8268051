"""KeywordCall: a model whose forward needs keywords, taken positionally by opswap."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.fx as fx
from torch import nn

from opswap.errors import OpswapError
from opswap.graph import capture
from opswap.graph.copies import count_hooks, private_copy
from opswap.graph.keywords import KeywordCall, keyword_call, positional, split_inputs


class Masked(nn.Module):
    """Needs keywords: mask and scale are keyword-only."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 5)
        self.calls = 0

    def forward(self, x, *, mask=None, scale=1.0):
        self.calls += 1
        y = self.proj(x) * scale
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return y


def _inputs(batch=3, seq=7):
    return torch.randn(batch, seq, 6), torch.rand(batch, seq, 5) > 0.5


def _model():
    torch.manual_seed(0)
    return Masked().eval()


def test_wrap_records_the_order_and_binds_constants():
    model = _model()
    x, mask = _inputs()
    wrapper, inputs = keyword_call(model, {"x": x, "mask": mask, "scale": 0.5})
    assert isinstance(wrapper, KeywordCall) and wrapper.model is model
    assert wrapper.order == ["x", "mask"] and wrapper.bound == {"scale": 0.5}
    assert inputs[0] is x and inputs[1] is mask
    assert wrapper.describe() == (
        "takes its inputs positionally in this order: x, mask (scale=0.5 bound as a constant)"
    )
    with torch.no_grad():
        assert torch.equal(wrapper(x, mask), model(x, mask=mask, scale=0.5))


def test_args_and_kwargs_pair():
    model = _model()
    x, mask = _inputs()
    wrapper, inputs = keyword_call(model, ((x,), {"mask": mask}))
    assert wrapper.order == ["x", "mask"] and not wrapper.bound and len(inputs) == 2
    assert split_inputs((x, mask)) is None  # a plain tuple stays positional
    same, given = keyword_call(model, (x,))
    assert same is model and given == (x,)
    same, given = keyword_call(model, ((x,), {}))
    assert same is model and given == (x,)


def test_fx_sees_named_inputs_and_baked_constants():
    model = _model()
    wrapper, _ = keyword_call(model, {"x": _inputs()[0], "mask": _inputs()[1], "scale": 3.0})
    gm = fx.symbolic_trace(wrapper)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "mask"]
    assert "3.0" in gm.code


def test_capture_of_the_wrapper_runs_at_other_batch_sizes():
    model = _model()
    x, mask = _inputs()
    wrapper, inputs = keyword_call(model, {"x": x, "mask": mask, "scale": 2.0})
    captured = capture(wrapper, inputs)
    assert [a.name for a in captured.dynamic.axes][:1] == ["batch"]
    x5, m5 = _inputs(batch=5)
    with torch.no_grad():
        torch.testing.assert_close(captured.gm(x5, m5), model(x5, mask=m5, scale=2.0))


def test_the_users_model_is_neither_run_nor_changed():
    model = Masked().train()  # training mode must survive too: no .eval() on the user's model
    x, mask = _inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapper, inputs = keyword_call(model, {"x": x, "mask": mask})
    assert wrapper.training  # follows the model
    capture(private_copy(wrapper), inputs)
    assert model.calls == 0 and model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_hooks_are_copied_like_an_unwrapped_model():
    model = _model()
    seen = []
    model.proj.register_forward_hook(lambda *a: seen.append(1))
    x, mask = _inputs()
    wrapper, inputs = keyword_call(model, {"x": x, "mask": mask})
    assert count_hooks(wrapper) == 1
    quiet = private_copy(wrapper)
    kept = private_copy(wrapper, keep_hooks=True)
    assert type(quiet) is type(wrapper) and quiet.model is not model
    assert count_hooks(quiet) == 0 and count_hooks(kept) == 1 and count_hooks(model) == 1
    with torch.no_grad():
        quiet(*inputs)
        assert seen == []
        kept(*inputs)
        assert seen == [1]


def test_deepcopy_and_pickle_round_trip():
    model = _model()
    x, mask = _inputs()
    wrapper, inputs = keyword_call(model, {"x": x, "mask": mask, "scale": 0.25})
    for twin in (copy.deepcopy(wrapper), pickle.loads(pickle.dumps(wrapper))):
        assert twin.order == wrapper.order and twin.bound == wrapper.bound
        assert twin.model is not model and not twin.training
        with torch.no_grad():
            assert torch.equal(twin(*inputs), wrapper(*inputs))


def test_names_python_cannot_spell_and_positional_constants():
    class Odd(nn.Module):
        def forward(self, x, flag, **kw):
            return x * 2 + kw["class"] - kw["my-key"] if flag else x

    x, c, s = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    wrapper, inputs = keyword_call(Odd(), ((x, True), {"class": c, "my-key": s}))
    assert len(inputs) == 3 and wrapper.bound == {"#1": True}
    assert wrapper.order == ["x", "class", "my-key"]
    assert wrapper.describe().endswith(
        "order: x, class, my-key (argument 1=True bound as a constant)"
    )
    torch.testing.assert_close(wrapper(*inputs), x * 2 + c - s)
    gm = fx.symbolic_trace(wrapper)
    torch.testing.assert_close(gm(*inputs), x * 2 + c - s)


@pytest.mark.parametrize(
    "value, words",
    [
        ([torch.ones(2)], "keyword 'cache' input in the example inputs is a list holding tensors"),
        (object(), "is a object"),
    ],
)
def test_values_that_are_neither_tensors_nor_constants(value, words):
    with pytest.raises(OpswapError, match=words):
        keyword_call(_model(), {"x": torch.ones(2, 6), "cache": value})


def test_inputs_without_a_tensor_are_refused():
    with pytest.raises(OpswapError, match="hold no tensor"):
        keyword_call(_model(), {"scale": 2.0})


def test_positional_wraps_only_modules_that_take_keywords():
    model = _model()
    x, mask = _inputs()
    wrapper, inputs = keyword_call(model, {"x": x, "mask": mask, "scale": 2.0})
    gm = capture(wrapper, inputs).gm
    assert positional(gm, wrapper) is gm  # opswap's graphs take the inputs positionally
    other = positional(_model(), wrapper)
    assert isinstance(other, KeywordCall) and other.bound == {"scale": 2.0}
    with torch.no_grad():
        assert torch.equal(other(*inputs), model(x, mask=mask, scale=2.0))
    assert positional(model, nn.Identity()) is model  # positional inputs: nothing to do


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, flag, scale):
        y = self.fc(x) * scale
        return y.relu() if flag else y.tanh()


def test_positional_constants_are_bound_and_other_values_refused(tmp_path):
    import opswap
    from opswap.errors import InputError

    m = Gate().eval()
    x = torch.randn(4, 8)
    r = opswap.optimize(m, (x, True, 2.0), bench=False)
    assert "argument 1=True, argument 2=2.0 bound as constants" in r.notes[0]
    with pytest.raises(InputError, match="argument 1=True, argument 2=2.0"):
        r.candidate(x, False, 3.0)  # it would answer for True, 2.0
    r.save(tmp_path)
    loaded = opswap.load_optimized(tmp_path)
    y = torch.randn(3, 8)
    with torch.no_grad():
        for fn in (r.candidate, loaded):
            torch.testing.assert_close(fn(y), m(y, True, 2.0))
