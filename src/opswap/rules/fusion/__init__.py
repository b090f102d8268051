"""Chapter 4: fusion. Ops that write a tensor only for the next op to read it back.

Each rule here (one per module) removes an intermediate tensor's round trip through
memory: by folding a constant transform into a neighbour's weights at rewrite time, by
replacing a chain of small ops with one kernel that keeps the intermediate in registers,
or by reading a shared input once instead of k times. All are exact: the result differs
from the original only by float rounding. The rules themselves are listed by the
registry (`opswap rules`) and in docs/chapters/04-fusion.md; where one must see
another's result, it declares so (`after`).
"""
