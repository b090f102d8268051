"""The learned cost model: trained from the database's rows, it ranks held-out sites'
candidates; with top_k the timer times only the promising ones; without LightGBM it
says so and times every candidate."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

from opswap.errors import OpswapError
from opswap.tuning import Key, TuningDB, TuningDBWarning, site_scope, tuned
from opswap.tuning import costmodel as cm
from opswap.tuning.features import NUMERIC
from opswap.tuning.timer import Measured


def _site(rng: random.Random) -> dict[str, Any]:
    m, n, k = (rng.randint(3, 700) for _ in range(3))
    flops, bytes_ = 2 * m * n * k, 4 * (m * k + k * n + m * n)
    f = {name: 0.0 for name in NUMERIC}
    f.update(
        log_flops=math.log(flops),
        log_bytes=math.log(bytes_),
        log_intensity=math.log(flops / bytes_),
        log_roofline_s=math.log(max(flops / 1e11, bytes_ / 1e10)),
        log_d0_0=math.log(m),
        log_d0_1=math.log(k),
        log_d1_0=math.log(n),
        log_d1_1=math.log(k),
        rank0=2.0,
        rank1=2.0,
        op="linear",
        dtype="float32",
    )
    return f


def _seconds(f: dict[str, Any], candidate: str) -> float:
    """A made-up machine: 'slow' pays per FLOP, 'lean' per byte, 'fixed' a constant."""
    flops, bytes_ = math.exp(f["log_flops"]), math.exp(f["log_bytes"])
    return {"slow": flops / 2e10, "lean": bytes_ / 1e8, "fixed": 2e-4}[candidate] + 1e-6


def _rows(n: int, seed: int) -> list[cm.Row]:
    rng = random.Random(seed)
    sites = [_site(rng) for _ in range(n)]
    return [cm.Row(f, c, _seconds(f, c)) for f in sites for c in ("slow", "lean", "fixed")]


def test_spearman() -> None:
    assert cm.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert cm.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert cm.spearman([1, 2, 2, 4], [1, 3, 3, 4]) == pytest.approx(1.0)  # ties
    assert math.isnan(cm.spearman([1, 1], [1, 2]))
    with pytest.raises(OpswapError, match="one length"):
        cm.spearman([1], [1, 2])


def test_ranks_held_out_sites() -> None:
    pytest.importorskip("lightgbm")
    model = cm.CostModel.train(_rows(120, seed=1))
    held = _rows(40, seed=2)
    predicted = [model.predict(r.features, [r.candidate])[0] for r in held]
    assert cm.spearman(predicted, [r.seconds for r in held]) > 0.9
    # within a site: the order of its candidates, mostly right
    right = 0
    for i in range(0, len(held), 3):
        site = held[i : i + 3]
        truth = [r.candidate for r in sorted(site, key=lambda r: r.seconds)]
        right += model.rank(site[0].features, ["slow", "lean", "fixed"])[0] == truth[0]
    assert right >= 0.8 * len(held) / 3
    # a candidate it never saw is ranked, not refused
    assert len(model.rank(held[0].features, ["slow", "new"])) == 2


def test_too_few_rows_or_no_lightgbm_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OpswapError, match="at least 40 timed candidates"):
        cm.CostModel.train(_rows(3, seed=0))
    monkeypatch.setattr(cm.importlib.util, "find_spec", lambda name: None)
    assert cm.lightgbm_missing() == cm.NO_LIGHTGBM
    with pytest.raises(OpswapError, match="needs LightGBM"):
        cm.CostModel.train(_rows(50, seed=0))


def _db_with_rows(path: Path, n: int) -> TuningDB:
    db = TuningDB(path)
    for i, r in enumerate(_rows(n, seed=3)[::3]):
        times = {c: _seconds(r.features, c) for c in ("slow", "lean", "fixed")}
        key = Key("site-time", f"s{i}", ((i + 1,),), "float32", "contiguous", "cpu", "v")
        db.put(key, {"times": times, "pruned": [], "features": r.features})
    return db


def test_top_k_times_the_baseline_and_the_promising_only(tmp_path: Path) -> None:
    import torch
    import torch.fx as fx

    from opswap.targets import get_target

    pytest.importorskip("lightgbm")
    db = _db_with_rows(tmp_path / "t.sqlite", 60)
    rank = cm.ranker(db)
    timed: list[list[str]] = []

    def measure(fns: dict[str, Any]) -> Measured:
        timed.append(list(fns))
        return Measured({n: 1e-3 for n in fns}, 5, 0.01)

    timer = tuned(measure, db, "cpu", top_k=1, ranker=rank)
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    node.meta["val"] = torch.empty(2, 4)
    for ph in gm.graph.nodes:
        ph.meta["val"] = torch.empty(2, 4)
    fns = {"base": lambda: None, "slow": lambda: None, "lean": lambda: None, "fixed": lambda: None}
    with site_scope("test.rule", "lin", gm, [node], get_target("h100")) as site:
        got = timer(fns)
    assert len(timed) == 1 and timed[0][0] == "base" and len(timed[0]) == 2
    assert sorted(n for n, t in got.items() if math.isinf(t)) == sorted(site.pruned)
    assert len(site.pruned) == 2 and site.outcome == "miss"
    with site_scope("test.rule", "lin", gm, [node], get_target("h100")) as again:
        assert timer(fns) == got  # the pruned read as untimed from the record too
    assert again.outcome == "hit" and again.pruned == site.pruned and len(timed) == 1
    # a run that times every candidate does not take a pruned record: it times them all
    every = tuned(measure, db, "cpu")
    with site_scope("test.rule", "lin", gm, [node], get_target("h100")) as full:
        assert all(math.isfinite(t) for t in every(fns).values())
    assert full.outcome == "miss" and full.pruned == [] and timed[-1] == list(fns)


def test_without_lightgbm_every_candidate_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cm.importlib.util, "find_spec", lambda name: None)
    import opswap.tuning.timer as tt

    monkeypatch.setattr(tt, "_WARNED", set())
    rank = cm.ranker(_db_with_rows(tmp_path / "t.sqlite", 60))
    with pytest.warns(TuningDBWarning, match="needs LightGBM") as caught:
        assert rank({}, ["a", "b"]) is None
    assert len(caught) == 1
