"""Custom kernels registered as torch ops (`torch.ops.opswap.*`), one per file beside its
reference implementation. Importing this package registers them, which is what loading
a saved `model.pt2` that uses them needs (`opswap.load_optimized` does it)."""

from opswap.kernels import (
    activation,  # noqa: F401  (registers opswap::bias_act and bias_act_backward)
    bias_gelu_cuda,  # noqa: F401  (registers opswap::bias_gelu_cuda; builds on first CUDA use)
    conv_relu,  # noqa: F401  (registers opswap::conv_relu)
    decode_attention,  # noqa: F401  (registers opswap::decode_attention)
    flash_attention,  # noqa: F401  (registers opswap::flash_attention)
    fp8_linear,  # noqa: F401  (registers opswap::fp8_linear)
    group_norm,  # noqa: F401  (registers opswap::group_norm and group_norm_backward)
    int8_fbgemm,  # noqa: F401  (registers opswap::int8_linear_fbgemm)
    int8_linear,  # noqa: F401  (registers opswap::int8_linear)
    int8_static,  # noqa: F401  (registers opswap::int8_static_linear and _conv2d)
    layer_norm,  # noqa: F401  (registers opswap::layer_norm)
    reduction,  # noqa: F401  (registers opswap::row_reduce and row_dot)
    rms_norm,  # noqa: F401  (registers opswap::rms_norm and add_rms_norm)
    rope,  # noqa: F401  (registers opswap::rope)
    softmax,  # noqa: F401  (registers opswap::softmax, log_softmax and masked_softmax)
    swiglu,  # noqa: F401  (registers opswap::glu and glu_packed)
    weight_only,  # noqa: F401  (registers opswap::wo_linear)
)

__all__ = [
    "activation",
    "bias_gelu_cuda",
    "conv_relu",
    "decode_attention",
    "flash_attention",
    "fp8_linear",
    "group_norm",
    "int8_fbgemm",
    "int8_linear",
    "int8_static",
    "layer_norm",
    "reduction",
    "rms_norm",
    "rope",
    "softmax",
    "swiglu",
    "weight_only",
]
