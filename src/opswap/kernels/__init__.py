"""Custom kernels registered as torch ops (`torch.ops.opswap.*`), one per file beside its
reference implementation. Importing this package registers them, which is what loading
a saved `model.pt2` that uses them needs (`opswap.load_optimized` does it)."""

from opswap.kernels import (
    conv_relu,  # noqa: F401  (registers opswap::conv_relu)
    int8_linear,  # noqa: F401  (registers opswap::int8_linear)
    int8_static,  # noqa: F401  (registers opswap::int8_static_linear and _conv2d)
)

__all__ = ["conv_relu", "int8_linear", "int8_static"]
