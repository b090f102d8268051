"""Chapter 11: convolution. The same convolution computed by another algorithm.

A convolution can be run directly (what cuDNN and oneDNN mostly do), as an explicit
im2col + GEMM, through Winograd's minimal filtering, or through the FFT. They do the
same arithmetic with different counts of multiplications, different memory traffic and
different rounding; which one is fastest depends on the layer's shape, the dtype and the
machine, so the rule here (`conv.algorithm`) races them per site on the target. The
algorithms themselves are kernels (opswap.kernels.conv_*) registered in
opswap.kernels.conv_algorithms.
"""
