"""Chapter 8: attention. `scaled_dot_product_attention` calls handed to opswap's own Triton
FlashAttention kernel where the measured crossover table says it beats SDPA's backends
(kernels/flash_attention.py).

Not built yet: the rule that recognises hand-written attention (matmul, scale, mask,
softmax, matmul) and replaces it by SDPA; the static KV cache and decode attention.
"""
