"""Chapter 15: reductions. A reduction fed by an elementwise producer (the square of
x.pow(2).sum(-1), the mean of squares inside a norm) computed in one pass: the kernel
squares as it reads, so the producer's tensor is never written or read back.
"""
