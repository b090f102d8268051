"""train.verify_grads: outputs, loss and every parameter's gradient against eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from opswap.train.verify_grads import sample_batches, tolerance, verify_grads


class _Net(nn.Module):
    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(13, 7)
        self.norm = nn.LayerNorm(7)
        self.bn = nn.BatchNorm1d(7)
        self.drop = nn.Dropout(0.3)
        self.wrong = wrong

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x))
        h = _Doubled.apply(h) if self.wrong else h
        h = self.bn(h)
        h = h.relu_()  # an in-place op
        return self.drop(h)


class _Doubled(torch.autograd.Function):
    """Identity forward, backward twice the gradient: a broken kernel."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return 2 * g


def _pair(wrong: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = _Net()
    cand = _Net(wrong)
    cand.load_state_dict(ref.state_dict())
    return ref, cand


def test_an_identical_model_passes_with_dropout_and_batchnorm_in_train_mode() -> None:
    ref, cand = _pair(False)
    batches = [(torch.randn(n, 13),) for n in (5, 1 + 2, 9)]
    check = verify_grads(ref, cand, batches[0], batches=batches)
    assert check.passed, check.reason
    assert len(check.params) == 6 and len(check.batches) == 3
    assert check.worst is not None and check.worst.error <= check.tolerance
    # the running statistics are put back after each run
    torch.testing.assert_close(cand.bn.running_mean, torch.zeros(7))


def test_a_wrong_backward_is_caught_and_named() -> None:
    ref, cand = _pair(True)
    check = verify_grads(ref, cand, (torch.randn(6, 13),), batches=[(torch.randn(6, 13),)])
    assert not check.passed
    assert "gradient of lin." in check.reason  # the layers before the broken op
    assert "FAILED" in str(check)


def test_a_changed_output_is_caught() -> None:
    ref, cand = _pair(False)
    with torch.no_grad():
        cand.bn.bias.add_(0.1)
    check = verify_grads(ref, cand, (torch.randn(4, 13),), batches=[(torch.randn(4, 13),)])
    assert not check.passed and "output differs" in check.reason


def test_tolerances_follow_exactness_and_dtype() -> None:
    assert tolerance("exact") < tolerance("approx") < tolerance("lossy")
    assert (
        tolerance("exact", torch.bfloat16) > tolerance("exact", torch.float16) > tolerance("exact")
    )
    with pytest.raises(ValueError, match="exactness"):
        verify_grads(_Net(), _Net(), (torch.randn(2, 13),), exactness="close")


def test_sample_batches_redraw_floats_and_keep_integers() -> None:
    x, ids = torch.randn(3, 5), torch.randint(0, 9, (3, 5))
    out = sample_batches((x, ids), None, 3)
    assert [label for label, _ in out][0] == "example" and len(out) == 3
    assert torch.equal(out[0][1][0], x)
    assert not torch.equal(out[1][1][0], x) and torch.equal(out[1][1][1], ids)


def test_a_bf16_candidate_is_judged_by_eager_bf16s_own_error() -> None:
    ref, cand = _pair(False)
    cand = cand.to(torch.bfloat16)
    batches = [(torch.randn(6, 13, dtype=torch.bfloat16),) for _ in range(2)]
    check = verify_grads(ref, cand, batches[0], batches=batches)
    assert check.passed, check.reason
    assert check.worst is not None and check.worst.allowed >= check.tolerance
    _, broken = _pair(True)
    check = verify_grads(ref, broken.to(torch.bfloat16), batches[0], batches=batches)
    assert not check.passed and "gradient of" in check.reason
