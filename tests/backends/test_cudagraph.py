"""backends.cudagraph: a module replayed from a CUDA graph per input signature gives the
module's outputs at every shape, hands out copies (a later call does not change what an
earlier one returned), and runs the module as it is for what a graph cannot take; the race
builds its `opswap+cudagraph` variant on CUDA only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.backends.cudagraph import CudaGraphed
from opswap.bench.variants import build

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _net():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def test_on_the_cpu_it_runs_the_module_and_the_race_builds_no_graph_variant():
    torch.manual_seed(0)
    m = _net()
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(CudaGraphed(m)(x), m(x))
    names = [v.name for v in build(m, m, m, (x,), ["none"], torch.device("cpu"))]
    assert "opswap+cudagraph" not in names


@needs_cuda
def test_replays_match_the_module_at_each_shape_and_return_copies():
    torch.manual_seed(0)
    m = _net().cuda()
    g = CudaGraphed(m)
    with torch.inference_mode():
        for b in (4, 1, 4, 7):
            x = torch.randn(b, 16, device="cuda")
            torch.testing.assert_close(g(x), m(x))
        a = g(torch.ones(4, 16, device="cuda"))
        kept = a.clone()
        g(torch.zeros(4, 16, device="cuda"))
        assert torch.equal(a, kept)  # the second replay did not write into the first output
    assert "3 graph(s)" in repr(g)


@needs_cuda
def test_a_graph_captured_under_inference_mode_replays_outside_it():
    # the race captures under torch.inference_mode and verifies under no_grad: the input
    # buffers the graph owns must take copies either way
    torch.manual_seed(2)
    m = _net().cuda()
    g = CudaGraphed(m)
    x = torch.randn(4, 16, device="cuda")
    with torch.inference_mode():
        first = g(x)
    with torch.no_grad():
        y = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(g(y), m(y))
        torch.testing.assert_close(first, m(x))


@needs_cuda
def test_on_cuda_the_race_has_the_compiled_cuda_graph_peers():
    """opswap+cudagraph is raced against what a user would reach for instead: torch.compile
    with its kernels replayed from CUDA graphs (mode="reduce-overhead"), of the input and
    of opswap's graph, each giving the module's outputs."""
    torch.manual_seed(3)
    m = _net().cuda()
    x = torch.randn(4, 16, device="cuda")
    variants = {v.name: v for v in build(m, m, m, (x,), ["compile"], torch.device("cuda"))}
    for name in ("compile+cudagraph", "opswap+compile+cudagraph"):
        v = variants[name]
        assert v.fn is not None, v.reasons
        with torch.inference_mode():
            torch.testing.assert_close(v.fn(x).clone(), m(x))
