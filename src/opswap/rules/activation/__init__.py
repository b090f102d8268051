"""Chapter 9: activations. The gated activations of LLM MLPs (SwiGLU: silu(gate) * up)
as one Triton kernel that reads gate and up once and writes the product once, also when
gate and up are the two halves of one merged Linear's output.
"""
