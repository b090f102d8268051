"""Site timings go through the tuning database: a second plan of the same model times
nothing, a near size reuses the nearest record and says so, a new version is a miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from opswap.bench.timing import with_timer
from opswap.graph.capture import capture
from opswap.planner import make_plan
from opswap.targets import get_target
from opswap.targets.base import Target
from opswap.tuning import TunedTimer, timings_made


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.b = nn.Conv2d(6, 5, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _plan(target: Target, size: int = 13, batch: int = 2):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    cap = capture(_Net().eval(), (torch.randn(batch, 3, size, size),), dynamic="none")
    return make_plan(cap, target=target, rules="conv.algorithm", exactness="approx")


def _timer(tmp_path: Path, db: str | None = "t.sqlite") -> Target:
    target = with_timer(get_target("cpu"), str(tmp_path / db) if db else "off")
    assert isinstance(target.timer, TunedTimer)
    return target


def test_a_second_plan_times_nothing_and_chooses_the_same(tmp_path: Path) -> None:
    first = _timer(tmp_path)
    plan1 = make_ = _plan(first)
    t1 = first.timer
    assert isinstance(t1, TunedTimer) and t1.made == 2  # one race per conv
    assert t1.summary()["misses"] == 2 and t1.summary()["hits"] == 0
    before = timings_made()
    again = _timer(tmp_path)  # a new run: a new timer, the rule's own cache misses
    plan2 = _plan(again)
    t2 = again.timer
    assert isinstance(t2, TunedTimer)
    assert t2.made == 0 and timings_made() == before
    s = t2.summary()
    assert (s["hits"], s["misses"], s["near"]) == (2, 0, 0)
    assert {x["outcome"] for x in s["sites"]} == {"hit"}
    assert [d.site.key for d in plan2.decisions] == [d.site.key for d in plan1.decisions]
    assert [x.where for x in plan2.skipped] == [x.where for x in make_.skipped]
    raced1 = [d.estimate.measured_s for d in plan1.decisions]
    assert raced1 == [d.estimate.measured_s for d in plan2.decisions]


def test_a_near_size_reuses_the_nearest_record_and_says_so(tmp_path: Path) -> None:
    _plan(_timer(tmp_path), size=16)
    near = _timer(tmp_path)
    _plan(near, size=17)  # 2 x log(17/16) = 0.12 from the record, within 0.25
    timer = near.timer
    assert isinstance(timer, TunedTimer)
    sites = {s["key"]: s for s in timer.summary()["sites"]}
    # the strided conv races the same candidates at both sizes: the 16 x 16 record serves
    b = sites["b@im2col"]
    assert b["outcome"] == "near" and b["near_shapes"][2] == [2, 6, 16, 16]
    # the first races one more at 17 x 17 (the FFT passes its accuracy test there): timed
    assert timer.made == (sites["a@fft"]["outcome"] == "miss")
    far = _timer(tmp_path)
    _plan(far, size=24)  # too far: timed afresh
    assert isinstance(far.timer, TunedTimer)
    assert {s["outcome"] for s in far.timer.summary()["sites"]} == {"miss"}


def test_a_new_version_is_a_miss_and_off_times_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plan(_timer(tmp_path))
    import opswap.tuning.timer as tt

    monkeypatch.setattr(tt, "versions", lambda kind: "torch 9.9; triton none")
    upgraded = _timer(tmp_path)
    _plan(upgraded)
    assert isinstance(upgraded.timer, TunedTimer) and upgraded.timer.made == 2
    off = _timer(tmp_path, None)
    plan = _plan(off)
    assert isinstance(off.timer, TunedTimer) and off.timer.db is None and off.timer.made == 2
    assert plan.tuning is None and "tuning" not in plan.to_json()


def test_a_timing_outside_a_site_is_never_reused(tmp_path: Path) -> None:
    target = _timer(tmp_path)
    timer = target.timer
    assert isinstance(timer, TunedTimer)
    for _ in range(2):  # the race of the whole model's variants calls timers like this
        timer({"a": lambda: sum(range(30)), "b": lambda: None})
    assert timer.made == 2 and timer.summary()["sites"] == []
    assert timer.db is not None and len(timer.db) == 0


@pytest.mark.slow
def test_cli_second_optimize_of_zoo_resnet_makes_no_site_timing(tmp_path: Path) -> None:
    from opswap.cli import main

    db = tmp_path / "tuning.sqlite"
    small = ["--set", "width=4", "--set", "image_size=16", "--set", "batch=2"]
    args = ["--no-bench", "--exactness", "approx", "--rules", "conv.algorithm"]
    made = []
    for i, extra in enumerate(
        (["--tuning-db", str(db)], ["--tuning-db", str(db)], ["--no-tuning-db"])
    ):
        before = timings_made()
        out = tmp_path / f"run{i}"
        try:
            main(
                ["optimize", "zoo:resnet", "--target", "cpu", *small, *args, "--samples", "1"]
                + extra
                + ["--out", str(out)]
            )
        except SystemExit as e:
            assert not e.code
        made.append(timings_made() - before)
        result = json.loads((out / "result.json").read_text())
        if i < 2:
            tuning = result["tuning"]
            assert tuning["db"] == str(db)
            assert tuning["timings_made"] == made[i]
            want = "miss" if i == 0 else "hit"
            assert tuning["sites"] and {s["outcome"] for s in tuning["sites"]} == {want}
            assert "Tuning database" in (out / "report.md").read_text()
        else:
            assert result["tuning"] is None
    assert made[0] > 0 and made[1] == 0 and made[2] == made[0]
