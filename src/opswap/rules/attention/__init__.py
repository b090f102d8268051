"""Chapter 8: attention. Hand-written attention (matmul, scale, mask, softmax, matmul)
recognised on what it computes and replaced by `scaled_dot_product_attention`
(attention.sdpa); SDPA calls handed to opswap's own Triton FlashAttention kernel where the
measured crossover table says it beats SDPA's backends (attention.flash,
kernels/flash_attention.py).

Not built yet: the static KV cache and decode attention.
"""
