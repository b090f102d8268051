"""Chapter 10: normalisation. RMSNorm and LayerNorm as one Triton kernel each, and the
residual add that feeds an RMSNorm folded into the same pass.

A normalisation is memory-bound: it reads a row, reduces it, and writes it back. Written
out (HF's RMSNorm: upcast, square, mean, add eps, rsqrt, multiply, cast, multiply by the
weight) it is eight kernels, most reading and writing a tensor of the input's size, some
in fp32; one kernel reads the row once and writes it once. The rules here match the
normalisation on what it computes (the ops, not the class name), target CUDA, and decide
per shape from the measured crossover table (kernels/crossover.py) or the roofline.
"""
