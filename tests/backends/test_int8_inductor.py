"""backends.int8_inductor: opswap's static int8 sites lowered to Inductor's own int8 path
under torch.compile. The compiled model computes what the ops compute (at batch sizes and
image sizes other than the example's, so across recompiles), runs onednn's int8 kernels
that Inductor emits (not a float convolution on dequantised weights), leaves the graph it
was given as it was, and is what the race times and `load_optimized` compiles."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import opswap.rules.precision._timing as timing
from opswap.backends import int8_inductor
from opswap.graph.calibrate import Calibration, attach
from opswap.graph.capture import capture
from opswap.kernels import int8_static
from opswap.planner import apply_plan, make_plan
from opswap.targets.base import Target
from opswap.verify.samples import make_samples

pytestmark = pytest.mark.skipif(
    not int8_static.onednn_available(), reason="onednn's int8 kernels need an x86 CPU torch"
)

PAYS = Target(
    name="int8-pays",
    description="test profile: int8 at 4x the float32 rate",
    kind="cpu",
    peak_flops={"float32": 2.5e11, "int8": 1.0e12},
    mem_bandwidth=2.5e10,
    memory_bytes=2**34,
    dtypes=("float32", "int8"),
    dispatch_s=2e-6,
    view_dispatch_s=1e-6,
)
RULES = ["fusion.*", "precision.int8_static_*"]


class Net(nn.Module):
    """Conv+BN+ReLU, a conv pair (uint8 handed between them) in a residual block whose add
    and ReLU are in place, a running-count buffer that forward updates (stateful), then
    tokens through two Linears with a GELU between (3-D input, a handoff with the GELU in
    its epilogue)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(16, 64, 3, padding=1)
        self.b1 = nn.BatchNorm2d(64)
        self.c2 = nn.Conv2d(64, 64, 3, padding=1)
        self.c3 = nn.Conv2d(64, 64, 1)
        self.up = nn.Linear(64, 192)
        self.down = nn.Linear(192, 64)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        y = torch.relu(self.b1(self.c1(x)))
        z = self.c3(torch.relu(self.c2(y)))
        z += y
        z.relu_()
        t = z.flatten(2).transpose(1, 2)  # [batch, tokens, channels]
        return self.down(nn.functional.gelu(self.up(t)))


def _net() -> Net:
    torch.manual_seed(0)
    m = Net().eval()
    with torch.no_grad():
        m.b1.running_mean.uniform_(-0.5, 0.5)
        m.b1.running_var.uniform_(0.5, 2.0)
    return m


def _exported_plan(x: torch.Tensor):
    """The planned int8 graph as model.pt2 holds it: exported with a dynamic batch and
    size, reloaded as a module (the op calls on constants)."""
    model = _net()
    cap = capture(model, (x,))
    attach(cap.gm, Calibration(make_samples((x,), 6, seed=1)))
    plan = make_plan(cap, rules=RULES, exactness="approx", target=PAYS)
    gm = apply_plan(cap, plan).gm
    dims = {0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO, 3: torch.export.Dim.AUTO}
    ep = torch.export.export(gm, (x,), dynamic_shapes=(dims,))
    return model, plan, ep.module()


def _sites(gm) -> int:
    return sum("int8_static" in str(n.target) for n in gm.graph.nodes)


def test_lowered_and_compiled_computes_what_the_ops_compute_across_recompiles():
    x = torch.randn(2, 16, 12, 12)
    model, plan, program = _exported_plan(x)
    rules = [d.rule for d in plan.decisions]
    # c2 and c3 (c1, with 16 input channels, is predicted slower in int8), both Linears,
    # and uint8 handed on from one of each pair
    assert rules.count("precision.int8_static_conv") == 2, rules
    assert rules.count("precision.int8_static_linear") == 2, rules
    assert rules.count("precision.int8_static_handoff") >= 1, rules
    before = _sites(program)
    state = {k: v.clone() for k, v in program.state_dict().items()}
    lowered, n = int8_inductor.lower(program)
    assert n == before == 4
    assert _sites(lowered) == 0
    # the graph given is left as it was
    assert _sites(program) == before
    assert all(torch.equal(v, program.state_dict()[k]) for k, v in state.items())
    fn = int8_inductor.compile_module(program)
    assert isinstance(fn, int8_inductor.FrozenCompiled) and fn.sites == 4 and fn.cpp_wrapper
    for shape in [(2, 16, 12, 12), (3, 16, 12, 12), (1, 16, 14, 10)]:
        xb = torch.randn(*shape)
        with torch.inference_mode():
            want, got, ref = program(xb), fn(xb), model(xb)
        assert got.shape == want.shape == ref.shape
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 1e-2 * scale, shape
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert float(cos) > 0.99999, shape
        # and both stay near the user's float32 module
        assert float((got - ref).norm() / ref.norm()) < 0.05, shape
    # called with autograd on, it still freezes (no_grad inside) and answers alike
    got = fn(x)
    assert not got.requires_grad
    with torch.inference_mode():
        assert float((got - program(x)).abs().max()) <= 1e-2 * float(got.abs().max())


def test_inductor_emits_onednn_int8_kernels_not_a_float_convolution():
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(2, 16, 12, 12)
    _, _, program = _exported_plan(x)
    # the kernels named in the Python wrapper (the default C++ wrapper calls the same ops
    # through their C shims)
    fn = int8_inductor.compile_module(program, cpp_wrapper=False)
    with torch.inference_mode():
        _, codes = run_and_get_code(fn, x)
    called = set(re.findall(r"onednn\.(\w+)", "\n".join(codes)))
    assert {"qconv_pointwise", "qlinear_pointwise"} <= called, called
    # the weights were prepacked once, as constants: no prepack left in the call path
    assert not any("prepack" in c for c in called), called


def test_graphs_without_int8_sites_compile_as_they_are():
    plain = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    assert int8_inductor.lower(plain) == (plain, 0)
    assert not isinstance(int8_inductor.compile_module(plain), int8_inductor.FrozenCompiled)
    mod = nn.Linear(4, 4)  # not a graph at all
    assert int8_inductor.lower(mod) == (mod, 0)


def test_the_race_times_and_load_optimized_compiles_the_lowered_model(tmp_path, monkeypatch):
    import opswap
    from opswap.config import OptimizeConfig
    from opswap.pipeline import optimize

    # this machine's timing says int8 pays (whether it does is a benchmark's business)
    monkeypatch.setattr(timing, "timed_pair", lambda key, timer, make: (2e-3, 1e-3))
    model = _net()
    x = torch.randn(2, 16, 12, 12)
    data = [(torch.randn(2, 16, 12, 12),) for _ in range(4)]

    def run(**kw):
        config = OptimizeConfig(
            rules=RULES, samples=2, exactness="approx", layers=False, measure_rules=False, **kw
        )
        return optimize(model, (x,), config, calibration_data=data)

    # the race compiles opswap's file through the lowering, verifies it against the
    # model at other batch sizes and times it (which variant wins is this machine's call)
    raced = {v.name: v for v in run(compare="compile").variants}
    assert raced["opswap+compile"].verified, raced["opswap+compile"].note
    assert raced["opswap+compile"].ms is not None
    # opswap's file, saved without a race, loads compiled as the race compiled it
    r = run(bench=False)
    assert r.verification.passed
    r.save(tmp_path)
    loaded = opswap.load_optimized(tmp_path, compile=True)
    assert isinstance(loaded, int8_inductor.FrozenCompiled)
    with torch.inference_mode():
        xb = torch.randn(3, 16, 12, 12)
        plain = opswap.load_optimized(tmp_path, compile=False)
        got, want = loaded(xb), plain(xb)
        assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
        assert float((got - model(xb)).norm() / model(xb).norm()) < 0.05


class _Attn(nn.Module):
    """Self-attention through SDPA with a float mask, a boolean mask or none, and a causal
    call that stays float32."""

    def __init__(self, heads: int, mask: str):
        super().__init__()
        self.heads, self.mask = heads, mask

    def forward(self, x, keep):
        b, t, d = x.shape
        q = x.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k, v = q * 0.5, q.flip(-1)
        keep = keep[:, None, None, :]
        if self.mask == "float":
            m = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, float("-inf"))
        else:
            m = keep if self.mask == "bool" else None
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        z = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (y + z).transpose(1, 2).reshape(b, t, d)


@pytest.mark.parametrize("mask", ["float", "bool", "none"])
def test_attention_bf16_rewrites_sdpa_near_float32_and_leaves_causal_calls(mask):
    torch.manual_seed(0)
    x, keep = torch.randn(2, 10, 48), torch.ones(2, 10, dtype=torch.bool)
    keep[1, 6:] = False  # padded keys in the second sequence
    model = _Attn(heads=4, mask=mask).eval()
    auto = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    dims = (auto, auto)
    gm = torch.export.export(model, (x, keep), dynamic_shapes=dims).module()
    assert int8_inductor.attention_bf16(gm) == 1  # the causal call is left to SDPA
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    assert sum(n.target == sdpa for n in gm.graph.nodes) == 1
    for shape in [(2, 10, 48), (3, 7, 48)]:
        xb, kb = torch.randn(*shape), torch.rand(shape[0], shape[1]) > 0.3
        kb[:, 0] = True
        with torch.no_grad():
            want, got = model(xb, kb), gm(xb, kb)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert float((got - want).norm() / want.norm()) < 1e-2, shape  # bfloat16's rounding
        assert not torch.equal(got, want)  # and it did compute in bfloat16


def test_attention_bf16_gives_zeros_for_fully_masked_rows_as_sdpa_does():
    q = torch.randn(1, 2, 5, 8)
    m = torch.zeros(1, 1, 5, 5)
    m[..., 2, :] = float("-inf")  # query 2 sees no key

    class F(nn.Module):
        def forward(self, q, m):
            return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=m)

    gm = torch.export.export(F(), (q, m)).module()
    assert int8_inductor.attention_bf16(gm) == 1
    with torch.no_grad():
        want, got = F()(q, m), gm(q, m)
    assert torch.equal(got[..., 2, :], torch.zeros_like(got[..., 2, :]))
    assert not got.isnan().any()
    assert float((got - want).abs().max()) < 0.05


class _Block(nn.Module):
    """int8 Linears around an attention: qkv projection, SDPA with a padding mask, output
    projection."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = (
            y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for y in self.qkv(x).split(d, -1)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None])
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def test_compile_module_runs_the_int8_graph_with_bf16_attention():
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = _Block().eval()
    x, mask = torch.randn(2, 96, 64), torch.zeros(2, 96)
    mask[1, 70:] = float("-inf")
    cap = capture(model, (x, mask))
    attach(cap.gm, Calibration(make_samples((x, mask), 4, seed=1)))
    plan = make_plan(cap, rules=RULES, exactness="approx", target=PAYS)
    gm = apply_plan(cap, plan).gm
    program = torch.export.export(gm, (x, mask)).module()
    fn = int8_inductor.compile_module(program, bf16_attention=True, cpp_wrapper=False)
    assert isinstance(fn, int8_inductor.FrozenCompiled) and fn.sites >= 1  # qkv at least
    with torch.inference_mode():
        got, codes = run_and_get_code(fn, x, mask)
        want, ref = program(x, mask), model(x, mask)
    code = "\n".join(codes)
    assert "scaled_dot_product" not in code and "qlinear" in code
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert float((got - ref).norm() / ref.norm()) < 5e-2
