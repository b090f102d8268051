"""Chapter 4: fusion. Ops that write a tensor only for the next op to read it back.

Each rule here (one per module) removes an intermediate tensor's round trip
through memory, either by folding a constant transform into a neighbour's weights
at rewrite time (BatchNorm into conv / linear: the BN disappears), or by replacing
a chain of small ops with one kernel that keeps the intermediate in registers
(Conv + ReLU, MatMul + Add, the hand-written LayerNorm, log(softmax)), or by
reading a shared input once instead of k times (parallel Linears). All are exact:
the result differs from the original only by float rounding.

Where one rule must see another's result, it says so (`after`): conv_relu runs
after conv_bn, so the BatchNorms are folded first and conv_relu sees Conv -> ReLU;
parallel_linear runs after matmul_add and linear_bn, so an `x @ W + b` that became
a linear, or a Linear whose BatchNorm was folded, can still merge with its siblings.
"""
