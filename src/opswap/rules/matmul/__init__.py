"""Chapter 12: matrix multiply. A Linear / matmul / addmm site, with the activation and the
residual add that follow it, as opswap's own tiled Triton GEMM (`opswap::gemm`, the
epilogue fused), kept only where it measured faster than cuBLAS at the site's shape; and
float32 GEMMs on TF32 tensor cores where the approx tolerance allows.
"""
