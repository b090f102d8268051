"""Chapter 11: convolution. The same convolution computed another way, or replaced by
cheaper ones that compute nearly the same map.

A convolution can be run directly (what cuDNN and oneDNN mostly do), as an explicit
im2col + GEMM, through Winograd's minimal filtering, or through the FFT. They do the
same arithmetic with different counts of multiplications, different memory traffic and
different rounding; which one is fastest depends on the layer's shape, the dtype and the
machine, so `conv.algorithm` races them per site on the target. The algorithms
themselves are kernels (opswap.kernels.conv_*) registered in
opswap.kernels.conv_algorithms.

The lossy rules here (`conv.low_rank`, `conv.cp`, `conv.depthwise_separable`,
`conv.stacked_3x3`) fit a chain of cheaper convolutions to the trained weight (low-rank
SVD splits, CP, depthwise + pointwise, a large kernel as stacked 3x3s), with
opswap.train.distill_conv to distil and fine-tune them.
"""
