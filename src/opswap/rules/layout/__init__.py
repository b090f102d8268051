"""Chapter 14: reshape and transpose. Rules that remove data movement a model does not need.

Most layout ops are free views (transpose, permute, view): removing one saves an op
dispatch, not memory traffic. Traffic is paid where a view meets an op that needs
contiguous memory (a `.contiguous()`, a reshape that cannot view, a matmul that must
fold batch dims) or where a kernel converts layouts internally (NCHW convolutions on
an NHWC backend). Each rule's `predict` says which of the two it saves, from the cost
model: a removed copy saves reading and writing its tensor (2x its bytes).

Each rule is one module, found by the registry; `_base.py` holds what they share (the
family's base class and the walk along a chain of view-like ops), `_nhwc.py` the
whole-graph memory-format conversion.

All rules here are exact: the rewritten graph computes the same values, up to the
rounding of a kernel that reads the same numbers in another order. Each rule states
where it runs in a plan (`phase`, `after`) itself; a whole-graph layout change runs in
the late phase, after every other rule of every family, since it has to see the final
convolutions.
"""
