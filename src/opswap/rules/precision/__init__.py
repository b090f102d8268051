"""Chapter 6: low precision. Ops that do their arithmetic in fewer bits than the model was
given in, where the device computes faster in them and the error stays inside the budget.

These rules are `approx`: they change rounding beyond float32's, by a bounded amount a
test measures, so a plan takes them only with `--exactness approx` (or looser), verifies
the result against the approx tolerance (or the user's `--budget`), and bisection rolls
back the sites that break it. They run after the fusions (`after = ("fusion.*",)`), so
that the layers they quantise are the ones left once BatchNorms are folded and parallel
Linears merged.
"""
