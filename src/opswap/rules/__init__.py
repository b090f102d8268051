"""Replacement rules: the Rule interface, the registry, and the rule families.

    import opswap
    for rule in opswap.rules.all_rules():
        print(rule.name, rule.exactness, rule.targets)

A new rule subclasses `Rule` (anchors, `check` answering `Found` or `Refused`, `rewrite`) and
is added with `@register`: see docs/writing-a-rule.md.
"""

from opswap.rules.base import Estimate, Found, Miss, Refused, Rule, Site
from opswap.rules.registry import all_rules, get, register, select

__all__ = [
    "Estimate",
    "Found",
    "Miss",
    "Refused",
    "Rule",
    "Site",
    "all_rules",
    "get",
    "register",
    "select",
]
