"""backends.dynamo.compile_failure and the race's torch.compile variant: a compile that fails
is reported in torch's own words (the error's type, its first line that is not advice, the
line that names the op), not as a bare "torch.compile failed"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opswap.backends.dynamo import compile_failure
from opswap.bench.variants import _compiled


@torch.library.custom_op("opswap_test::nchw_fake_relu", mutates_args=())
def nchw_fake_relu(x: torch.Tensor) -> torch.Tensor:
    return x.relu()  # keeps x's layout


@nchw_fake_relu.register_fake
def _(x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)  # NCHW whatever x is


@torch.library.custom_op("opswap_test::refusing_fake", mutates_args=())
def refusing_fake(x: torch.Tensor) -> torch.Tensor:
    return x.relu()


@refusing_fake.register_fake
def _(x):
    raise RuntimeError(f"size {x.shape[1]} of dim 1 is not supported by opswap_test::refusing_fake")


class _Calls(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x) * 2


def _raised(fn) -> BaseException:
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("it did not raise")


def test_a_wrong_fake_kernel_is_named_with_the_strides_inductor_asserted():
    torch._dynamo.reset()
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    module = _Calls(torch.ops.opswap_test.nchw_fake_relu)
    v = _compiled("opswap+compile", module, (x,), "candidate")
    assert v.fn is None and not v.verified
    (reason,) = v.reasons
    assert reason.startswith("torch.compile failed: AssertionError: expected size 3==3, stride")
    assert "Error in op: torch.ops.opswap_test.nchw_fake_relu.default" in reason
    assert v.note == reason  # what the variants table and result.json show
    assert "opcheck" not in reason and "\n" not in reason
    torch._dynamo.reset()


def test_dynamo_and_backend_errors_are_unwrapped():
    torch._dynamo.reset()
    x = torch.randn(3, 5, 2, 2)
    e = _raised(lambda: torch.compile(_Calls(torch.ops.opswap_test.refusing_fake))(x))
    text = compile_failure(e)
    assert text.startswith(f"{type(e).__name__}: ")
    assert "opswap_test.refusing_fake" in text  # the line that names the op
    assert "size 5 of dim 1 is not supported" in text
    assert "TORCHDYNAMO_VERBOSE" not in text and "from user code" not in text

    def refuse(gm, inputs):
        raise ValueError("the backend cannot take aten.relu at size 5")

    torch._dynamo.reset()
    e = _raised(lambda: torch.compile(_Calls(torch.relu), backend=refuse)(x))
    assert type(e).__name__ == "BackendCompilerFailed"
    assert compile_failure(e) == "ValueError: the backend cannot take aten.relu at size 5"
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "error, want",
    [
        (RuntimeError(""), "RuntimeError"),
        (ValueError("\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n"), "ValueError"),
        (KeyError("x" * 500), "KeyError: '" + "x" * 299),
        (
            RuntimeError(
                "LoweringException: boom\n  target: opswap.conv_relu.default\n  args[0]: x"
            ),
            "RuntimeError: LoweringException: boom (target: opswap.conv_relu.default)",
        ),
    ],
)
def test_messages_without_a_line_to_give(error, want):
    assert compile_failure(error) == want
