"""opswap::conv_winograd, F(2x2,3x3) and F(4x4,3x3): the transform matrices against a
direct correlation in float64, the op against F.conv2d at odd shapes, paddings, groups and
layouts in float64, float32 and bfloat16, the Triton products (under TRITON_INTERPRET=1 in
one child Python; on the GPU where there is one) against float64 next to PyTorch's own
error, the refusals, the registry's entries and their counts of multiplications, the
filter cache, the fake kernel, torch.export and the ONNX lowering."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _rows_check as rc  # noqa: E402

from opswap.kernels import _winograd as T  # noqa: E402
from opswap.kernels import conv_algorithms as ca  # noqa: E402
from opswap.kernels import conv_winograd as W  # noqa: E402
from opswap.kernels._conv_error import error_against_float64  # noqa: E402

OP = torch.ops.opswap.conv_winograd.default

# (N, C, O, H, W, padding, groups, bias): batch 1 and 3, one and five channels, a 1x1 image
# padded to 3x3, non-square and odd sizes not a multiple of either tile, paddings 0, 1, 2
SHAPES = [
    (1, 1, 1, 1, 1, (1, 1), 1, False),
    (3, 5, 4, 7, 9, (1, 1), 1, True),
    (1, 5, 3, 9, 7, (0, 0), 1, False),
    (3, 4, 6, 7, 9, (2, 1), 2, True),
    (1, 6, 4, 5, 11, (0, 2), 2, True),
]


def _inputs(shape, dtype=torch.float64, seed=0):
    n, c, o, h, w, _, g, has_bias = shape
    gen = torch.Generator().manual_seed(seed + n * 100 + c * 10 + h)
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    wt = torch.randn(o, c // g, 3, 3, generator=gen, dtype=torch.float64) / math.sqrt(9 * c // g)
    b = torch.randn(o, generator=gen, dtype=torch.float64) if has_bias else None
    return x.to(dtype), wt.to(dtype), None if b is None else b.to(dtype)


def _truth(x, wt, b, padding, groups):
    b64 = None if b is None else b.double()
    return F.conv2d(x.double(), wt.double(), b64, 1, padding, 1, groups)


def _rel(y, truth):
    return float((y.detach().double() - truth).norm() / truth.norm())


@pytest.mark.parametrize("m", W.TILES)
def test_the_matrices_compute_a_tile_of_the_correlation(m):
    bt, g, at = T.matrices(m)
    a = m + 2
    gen = torch.Generator().manual_seed(m)
    for _ in range(5):
        d = torch.randn(a, a, generator=gen, dtype=torch.float64)
        f = torch.randn(3, 3, generator=gen, dtype=torch.float64)
        y = at @ ((g @ f @ g.T) * (bt @ d @ bt.T)) @ at.T
        direct = F.conv2d(d[None, None], f[None, None])[0, 0]
        assert y.shape == (m, m)
        assert float((y - direct).abs().max()) <= 1e-10


@pytest.mark.parametrize("m", W.TILES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_op_matches_a_float64_conv(shape, m):
    padding, groups = shape[5], shape[6]
    x, wt, b = _inputs(shape)
    truth = _truth(x, wt, b, padding, groups)
    y = OP(x, wt, b, list(padding), groups, m)
    assert y.shape == truth.shape and y.dtype == torch.float64
    assert float((y - truth).abs().max()) <= 1e-10 * max(1.0, float(truth.abs().max()))
    # float32: the reordered sums of the transforms; F(4,3)'s larger coefficients cost
    # a few more roundings (bench_winograd measures it against PyTorch's conv)
    x32, w32, b32 = _inputs(shape, torch.float32)
    y32 = OP(x32, w32, b32, list(padding), groups, m)
    torch_err = _rel(F.conv2d(x32, w32, b32, 1, padding, 1, groups), truth)
    assert y32.dtype == torch.float32
    assert _rel(y32, truth) <= max(10 * torch_err, 2e-6 if m == 2 else 1e-5)


@pytest.mark.parametrize("m", W.TILES)
def test_the_gemm_transforms_equal_the_additions(m):
    # CUDA's transforms (two GEMMs) against the CPU's (additions), groups and layouts too
    for shape in SHAPES[1:]:
        padding, groups = shape[5], shape[6]
        x, wt, _ = _inputs(shape)
        v = T.input_transform(x, padding, m, groups)
        torch.testing.assert_close(T.input_transform_gemm(x, padding, m, groups), v)
        prod = torch.bmm(v, T.filter_transform(wt, m, groups))
        n, _, o, h, w = shape[:5]
        out = (n, o, h + 2 * padding[0] - 2, w + 2 * padding[1] - 2)
        for fmt in (torch.contiguous_format, torch.channels_last):
            y = T.output_transform(prod, out, m, groups, fmt)
            torch.testing.assert_close(T.output_transform_gemm(prod, out, m, groups, fmt), y)


@pytest.mark.parametrize("m", W.TILES)
def test_half_inputs_on_the_cpu_err_as_pytorch_does(m):
    # the CPU path computes in float32: the error is the output's rounding, as PyTorch's
    shape = (2, 8, 5, 13, 10, (1, 1), 1, True)
    for dtype in (torch.bfloat16, torch.float16):
        x, wt, b = _inputs(shape, dtype, seed=3)
        truth = _truth(x, wt, b, (1, 1), 1)
        y = OP(x, wt, b, [1, 1], 1, m)
        torch_err = _rel(F.conv2d(x.float(), wt.float(), b.float(), 1, 1).to(dtype), truth)
        assert y.dtype == dtype
        assert _rel(y, truth) <= 2 * torch_err, (dtype, _rel(y, truth), torch_err)


def test_channels_last_in_channels_last_out():
    shape = (2, 5, 6, 9, 7, (1, 1), 1, True)
    x, wt, b = _inputs(shape, torch.float32)
    xc = x.contiguous(memory_format=torch.channels_last)
    for m in W.TILES:
        y = OP(xc, wt, b, [1, 1], 1, m)
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert _rel(y, _truth(x, wt, b, (1, 1), 1)) <= 1e-5
        assert OP(x, wt, b, [1, 1], 1, m).is_contiguous()


def test_the_filter_transform_is_cached_and_sees_an_in_place_update():
    shape = (1, 4, 4, 6, 6, (1, 1), 1, False)
    x, wt, _ = _inputs(shape, torch.float32)
    OP(x, wt, None, [1, 1], 1, 2)
    u = W._U_CACHE[wt][1]
    OP(x, wt, None, [1, 1], 1, 2)
    assert W._U_CACHE[wt][1] is u  # a second call reuses the transform
    with torch.no_grad():
        wt.mul_(-2.0)
    y = OP(x, wt, None, [1, 1], 1, 2)
    assert W._U_CACHE[wt][1] is not u
    assert _rel(y, _truth(x, wt, None, (1, 1), 1)) <= 1e-5
    y4 = OP(x, wt, None, [1, 1], 1, 4)  # another tile size: its own transform
    assert _rel(y4, _truth(x, wt, None, (1, 1), 1)) <= 1e-5


def _site(x_shape, w_shape, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, **kw):
    return ca.ConvSite(
        x_shape,
        w_shape,
        stride,
        padding,
        dilation,
        groups,
        kw.get("dtype", torch.float32),
        kw.get("device", "cpu"),
    )


@pytest.mark.parametrize(
    ("site", "why"),
    [
        (_site((1, 8, 9, 9), (8, 8, 3, 3), stride=(2, 2)), "stride 2x2: Winograd F"),
        (_site((1, 8, 9, 9), (8, 8, 5, 5)), "kernel 5x5: Winograd F(.*) needs a 3x3 kernel"),
        (_site((1, 8, 9, 9), (8, 8, 3, 3), dilation=(2, 2)), "dilation 2x2: .* dilation 1"),
        (_site((1, 8, 9), (8, 8, 3), (1,), (1,), (1,)), "conv1d: .* 2-D convolutions"),
        (_site((1, 8, 9, 9), (8, 1, 3, 3), groups=8), "depthwise: .* element-wise"),
        (_site((1, 8, 9, 9), (8, 8, 3, 3), dtype=torch.float64), "dtype torch.float64"),
        (_site((1, 8, 1, 1), (8, 8, 3, 3), padding=(0, 0)), "smaller than the 3x3 kernel"),
    ],
)
def test_sites_it_cannot_take_are_refused_in_one_sentence(site, why):
    import re

    for name in ("winograd_f2x2_3x3", "winograd_f4x4_3x3"):
        reason = ca.get(name).refuses(site)
        assert reason is not None and re.search(why, reason), reason
        assert "\n" not in reason


def test_bad_calls_of_the_op_are_refused_in_one_sentence():
    x, wt = torch.randn(1, 4, 6, 6), torch.randn(4, 4, 3, 3)
    cases = [
        ((x, wt, None, [1, 1], 1, 3), "tile size m=3 is not one of"),
        ((x, torch.randn(4, 4, 5, 5), None, [1, 1], 1, 2), "kernel 5x5"),
        ((x, wt, None, [1, -1], 1, 2), "padding"),
        ((x, torch.randn(4, 3, 3, 3), None, [1, 1], 1, 2), "groups=1 does not fit"),
        ((x[:, :, :1, :1], wt, None, [0, 0], 1, 2), "smaller than the 3x3 kernel"),
        ((x[0], wt, None, [1, 1], 1, 2), "2-D convolutions"),
        ((x.int(), wt, None, [1, 1], 1, 2), "not a floating type"),
    ]
    for args, why in cases:
        with pytest.raises(W.WinogradError, match=why):
            OP(*args)


def test_both_tile_sizes_are_registered_with_their_savings():
    names = {a.name: a for a in ca.algorithms()}
    for m, saving in ((2, 2.25), (4, 4.0)):
        alg = names[f"winograd_f{m}x{m}_3x3"]
        assert alg.exactness == "approx" and alg.op is OP and alg.chapter == 11
        # output 8x12 (a multiple of both tiles): exactly the products' saving
        site = _site((3, 6, 8, 12), (10, 6, 3, 3))
        assert alg.refuses(site) is None
        assert site.direct_multiplications() / alg.multiplications(site) == saving
        # 7x9: edge tiles are partly wasted, so the saving is less
        odd = _site((3, 6, 7, 9), (10, 6, 3, 3))
        assert 1 < odd.direct_multiplications() / alg.multiplications(odd) < saving
        # F(2,3)'s transforms hold only 0 and +-1; F(4,3)'s scale by 2, 4, 5, 8
        assert (W.transform_multiplications(site, m) > 0) == (m == 4)
        # the registry's call: the op with the site's settings after (x, weight, bias)
        gsite = _site((2, 4, 7, 5), (6, 2, 3, 3), padding=(2, 0), groups=2)
        x, wt, b = torch.randn(2, 4, 7, 5), torch.randn(6, 2, 3, 3), torch.randn(6)
        want = F.conv2d(x, wt, b, 1, (2, 0), 1, 2)
        assert _rel(alg(x, wt, b, gsite), want.double()) <= 1e-5


def test_error_against_float64_measures_the_algorithm_and_pytorch():
    site = _site((4, 16, 10, 11), (8, 16, 3, 3))
    for name in ("winograd_f2x2_3x3", "winograd_f4x4_3x3"):
        err, torch_err = error_against_float64(ca.get(name), site, samples=2)
        assert 0 < torch_err < 1e-6 and 0 < err < 1e-5
    bsite = _site((1, 16, 10, 11), (8, 16, 3, 3), dtype=torch.bfloat16)
    err, torch_err = error_against_float64(ca.get("winograd_f4x4_3x3"), bsite)
    assert 1e-4 < torch_err < 1e-2 and err <= 2 * torch_err  # float32 inside, on the CPU
    with pytest.raises(ca.ConvAlgorithmError, match="cannot run this site: stride 2x2"):
        error_against_float64(
            ca.get("winograd_f2x2_3x3"), _site((1, 4, 8, 8), (4, 4, 3, 3), (2, 2))
        )


def test_fake_kernel_and_export_keep_the_op():
    x, wt, b = torch.randn(2, 3, 7, 5), torch.randn(4, 3, 3, 3), torch.randn(4)
    torch.library.opcheck(OP, (x, wt, b, [1, 2], 1, 4), test_utils=("test_faketensor",))

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(wt.clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return OP(x, self.w, None, [1, 1], 1, 2).relu()

    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(M(), (x,), dynamic_shapes=({0: batch},))
    assert OP in {n.target for n in ep.graph.nodes}
    x5 = torch.randn(5, 3, 7, 5)
    assert _rel(ep.module()(x5), F.conv2d(x5, wt, None, 1, 1).relu().double()) <= 1e-5


def test_the_onnx_lowering_is_one_conv(tmp_path):
    import onnx

    from opswap.backends.ort import ort_artifact

    x, wt, b = torch.randn(2, 4, 9, 7), torch.randn(6, 2, 3, 3), torch.randn(6)

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return OP(x, wt, b, [2, 1], 2, 4)

    art = ort_artifact(M().eval(), (x,), None, tmp_path)
    assert art.module is not None, art.error
    ops = [n.op_type for n in onnx.load(str(art.path)).graph.node]
    assert ops.count("Conv") == 1 and not any("opswap" in o for o in ops), ops
    want = F.conv2d(x, wt, b, 1, (2, 1), 1, 2)
    torch.testing.assert_close(art.module(x), want, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- Triton

# (shape, dtype, m): the Triton products in float32 (TF32 off: the interpreter computes
# exactly; a GPU follows torch.backends.cudnn.allow_tf32), bfloat16 and float16
TRITON_CASES = [
    ((3, 5, 6, 7, 9, (1, 1), 1, True), torch.float32, 2),
    ((3, 5, 6, 7, 9, (1, 1), 1, True), torch.float32, 4),
    ((1, 6, 4, 5, 11, (0, 2), 2, False), torch.float32, 4),
    ((2, 16, 20, 9, 9, (1, 1), 1, True), torch.bfloat16, 2),
    ((2, 16, 20, 9, 9, (1, 1), 1, True), torch.bfloat16, 4),
    ((2, 16, 20, 9, 9, (1, 1), 1, True), torch.float16, 2),
    ((2, 16, 20, 9, 9, (1, 1), 1, True), torch.float16, 4),
]


def _tkey(case):
    return str([list(case[0][:5]), str(case[1]), case[2]])


def _triton_case(shape, dtype, m):
    torch.backends.cudnn.allow_tf32 = False
    padding, groups = shape[5], shape[6]
    x, wt, b = (t if t is None else t.to(rc.DEVICE) for t in _inputs(shape, dtype, seed=7))
    truth = _truth(x, wt, b, padding, groups)
    y = OP(x, wt, b, list(padding), groups, m)
    b32 = None if b is None else b.float()
    yt = F.conv2d(x.float(), wt.float(), b32, 1, padding, 1, groups).to(dtype)
    if rc.DEVICE == "cuda":  # PyTorch's own conv in the dtype (cuDNN)
        yt = F.conv2d(x, wt, b, 1, padding, 1, groups)
    return {
        "triton": W.runs_triton(x),
        "shape": list(y.shape),
        "dtype": str(y.dtype),
        "err": _rel(y, truth),
        "torch_err": _rel(yt, truth),
    }


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return rc.run_child(__file__)


@pytest.mark.parametrize("case", TRITON_CASES, ids=_tkey)
def test_triton_products_match_float64(interpreted, case):
    shape, dtype, m = case
    r = interpreted[_tkey(case)]
    assert r["triton"], "the Triton path did not run"
    padding = shape[5]
    assert r["shape"] == [
        shape[0],
        shape[2],
        shape[3] + 2 * padding[0] - 2,
        shape[4] + 2 * padding[1] - 2,
    ]
    assert r["dtype"] == str(dtype)
    if dtype == torch.float32:
        assert r["err"] <= (2e-6 if m == 2 else 1e-5), r
    else:
        # V and U rounded to the half dtype for the tensor cores: F(2,3) loses about a bit
        # against PyTorch, F(4,3) about three (bench_winograd measures the digits)
        assert r["err"] <= (4 if m == 2 else 16) * max(r["torch_err"], 2.0**-11), r


if __name__ == "__main__":  # the interpreter's half of `interpreted`
    print(json.dumps({_tkey(c): _triton_case(*c) for c in TRITON_CASES}))
