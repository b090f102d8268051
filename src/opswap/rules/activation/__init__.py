"""Chapter 9: activations. The gated activations of LLM MLPs (SwiGLU: silu(gate) * up)
as one Triton kernel that reads gate and up once and writes the product once, also when
gate and up are the two halves of one merged Linear's output; GELU's tanh and sigmoid
approximations and SiLU -> Hardswish, each with its measured error bound; and a Linear's
bias and ReLU or tanh-GELU moved into cuBLASLt's GEMM epilogue (aten._addmm_activation).
"""
