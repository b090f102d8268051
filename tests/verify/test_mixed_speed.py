"""Precision debugging is not gated by speed: on a target where the speed model predicts a
bf16 site slower (a small transformer on this CPU), debug_precision still measures every
site the scheme can take, while a plan for speed skips them."""

from __future__ import annotations

from opswap.api import capture
from opswap.models import load
from opswap.planner import make_plan
from opswap.verify.mixed import debug_precision


def test_sites_predicted_slower_are_still_debugged():
    lm = load("zoo:bert")
    cap = capture(lm.module, lm.example_inputs)
    for_speed = make_plan(cap, rules=["precision.bf16"], exactness="approx", target="cpu")
    assert any("predicted slower" in s.reason for s in for_speed.skipped), for_speed.skipped
    out = debug_precision(captured=cap, rules=["precision.bf16"], samples=1, target="cpu")
    assert len(out.layers) > len(for_speed.decisions)
    assert all(s.site for s in out.layers)
