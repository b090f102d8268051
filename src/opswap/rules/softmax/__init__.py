"""Chapter 16: softmax. Softmax and log-softmax over the last dim as one Triton kernel
(the online softmax for rows longer than a block), with an attention score's scale and
additive or boolean mask folded into the same pass; the safe softmax written by hand
(exp(x - max) / sum) matched on what it computes, and the unsafe one (no max
subtraction) only as an approximation, by a rule of its own.
"""
