"""Rules of a user's own: an example plugin package for opswap (see docs/writing-a-rule.md).

Each module holds one rule; pyproject.toml names each in the `opswap.rules`
entry-point group, so an installed copy of this package adds them to `opswap rules`.
"""
