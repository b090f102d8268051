"""sparsity.semi_structured: the 2:4 mask keeps exactly the two largest of every four
inputs; on the CPU, and for float32 or badly shaped layers, the rule refuses and says why;
a site is kept only at 1.05x dense or better by the target's timer. On a GPU (the GPU
suite), the compressed layer equals the masked dense layer, through the whole plan."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opswap.rules._weights import weighted
from opswap.rules.base import Found
from opswap.rules.sparsity import semi_structured as ss
from opswap.rules.sparsity._masks import is_2_4, mask_2_4
from opswap.targets import get_target

from ._helpers import count, plan_rule, timed_target, why

RULE = "sparsity.semi_structured"
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


@pytest.mark.parametrize("shape", [(5, 12), (3, 7, 36), (1, 4)])
def test_the_mask_is_2_4_and_keeps_the_two_largest(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    w = torch.randn(*shape)
    m = mask_2_4(w)
    groups, keep = w.reshape(-1, 4).abs(), m.reshape(-1, 4)
    assert torch.all(keep.sum(1) == 2) and is_2_4(w * m)
    assert torch.all(
        groups[keep].view(-1, 2).min(1).values >= groups[~keep].view(-1, 2).max(1).values
    )
    assert not is_2_4(torch.ones(2, 8)) and not is_2_4(torch.ones(2, 6))
    with pytest.raises(ValueError, match="multiple of 4"):
        mask_2_4(torch.randn(3, 10))


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.up = nn.Linear(128, 256).to(dtype)
        self.down = nn.Linear(256, 128, bias=False).to(dtype)
        self.odd = nn.Linear(128, 40).to(dtype)  # 40 rows: not a multiple of 32 (CUTLASS) or 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        h = x + self.down(h)
        return self.odd(h)


def test_on_the_cpu_it_refuses_with_the_reason() -> None:
    model, x = Net().eval(), torch.randn(2, 9, 128, dtype=torch.bfloat16)
    _, plan, _ = plan_rule(model, (x,), RULE, target="h100")
    assert count(plan, RULE) == 0
    assert "is on the cpu: to_sparse_semi_structured runs only on CUDA GPUs" in why(plan, RULE)
    _, plan, _ = plan_rule(Net(torch.float32).eval(), (x.float(),), RULE, target="cpu")
    assert count(plan, RULE) == 0  # a CUDA-only rule is not planned for the CPU


def _found(model: nn.Module, rows: int) -> Found:
    gm = fx.symbolic_trace(model)
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "up")
    w = weighted(gm, node)
    assert not isinstance(w, str)
    return Found((node,), "up", dict(w=w, rows=rows, backend="cutlass"))


def test_kept_only_at_1_05x_dense_by_the_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    times = {"t": (1.0, 0.99)}
    monkeypatch.setattr(ss, "time_site", lambda *a: times["t"])
    found, rule = _found(Net(), 257 * 8), ss.SemiStructured()
    h100 = timed_target("h100", 1.0, 1.0)
    est = rule.predict(found.nodes[0].graph.owning_module, found, h100)
    assert est.time_saved_s is not None and est.time_saved_s < 0
    assert "(1.01x), below 1.05x" in est.note and "2056 x 128 -> 256" in est.note
    times["t"] = (1.2, 1.0)
    est = rule.predict(found.nodes[0].graph.owning_module, found, h100)
    assert est.time_saved_s == pytest.approx(0.2) and "(1.20x)" in est.note
    est = rule.predict(found.nodes[0].graph.owning_module, found, get_target("h100"))
    assert est.time_saved_s is not None and est.time_saved_s < 0
    assert "needs a measurement on the target" in est.note


@pytest.mark.skipif(not GPU, reason="2:4 runs on CUDA GPUs of sm80+: run by the GPU suite")
@pytest.mark.parametrize("backend", ["cutlass", "cusparselt"])
def test_the_compressed_layer_equals_the_masked_dense_layer(backend: str) -> None:
    from opswap.rules.sparsity._modules import SemiSparseLinear, semi_structured_reference

    if backend == "cusparselt" and not torch.backends.cusparselt.is_available():
        pytest.skip("cuSPARSELt is not in this torch build")
    torch.manual_seed(0)
    w = torch.randn(192, 320, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(192, device="cuda", dtype=torch.bfloat16)
    layer = SemiSparseLinear(w, b, backend)
    for shape in ((3, 17, 320), (64, 320)):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        want = semi_structured_reference(x.float(), w.float(), b.float())
        torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(not GPU, reason="2:4 runs on CUDA GPUs of sm80+: run by the GPU suite")
def test_the_rule_on_the_gpu_rewrites_what_the_timer_keeps() -> None:
    torch.manual_seed(0)
    model = Net().cuda().eval()
    x = torch.randn(4, 33, 128, device="cuda", dtype=torch.bfloat16)
    h100 = timed_target("h100", 2.0, 1.0)
    _, plan, applied = plan_rule(model, (x,), RULE, target=h100)
    assert count(plan, RULE) == 2 and "multiples of" in why(plan, RULE)
    y = torch.randn(2, 5, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        h = F.gelu(ss_ref(y, model.up))
        want = model.odd(y + ss_ref(h, model.down))
    torch.testing.assert_close(applied.gm(y).float(), want.float(), rtol=3e-2, atol=6e-2)


def ss_ref(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    from opswap.rules.sparsity._modules import semi_structured_reference

    return semi_structured_reference(x, lin.weight, lin.bias)
