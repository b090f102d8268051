"""Chapter 8: attention. Scaled dot-product attention handed to opswap's own Triton
FlashAttention kernel where it is measured to beat SDPA's backends."""
