"""Replacement rules: the Rule interface, the registry, and the rule families.

    import opswap
    for rule in opswap.rules.all_rules():
        print(rule.name, rule.exactness, rule.targets)

A new rule subclasses `Rule` and is added with `@register` (see rules/base.py).
"""

from opswap.rules.base import Estimate, Miss, Rule, Site
from opswap.rules.registry import all_rules, get, register, select

__all__ = ["Estimate", "Miss", "Rule", "Site", "all_rules", "get", "register", "select"]
