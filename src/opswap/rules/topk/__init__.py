"""Chapter 17: TopK and sort. A full sort whose result is cut to its first k entries
(sort + slice, argsort + slice + gather) is a top-k: the same k values, found without
ordering the other n - k; opswap's Triton top-k (a bitonic register path for short rows and
small k, radix select for long rows); and the approximate, bucketed top-k.
"""
