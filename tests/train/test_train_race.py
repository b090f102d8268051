"""train.race: full training steps of every variant, losses checked against eager's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.train.race import race_training


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(19, 33), nn.LayerNorm(33), nn.GELU(), nn.Dropout(0.1), nn.Linear(33, 10)
    )


def test_eager_and_opswap_steps_are_timed_and_their_losses_agree() -> None:
    model = _mlp()
    batches = [(torch.randn(7, 19), torch.randint(0, 10, (7,))) for _ in range(3)]
    before = [p.detach().clone() for p in model.parameters()]
    race = race_training(
        model,
        batches[0],
        F.cross_entropy,
        batches=batches,
        variants=("eager", "opswap"),
        min_time_s=0.05,
    )
    assert [r.name for r in race.rows] == ["eager", "opswap"]
    for r in race.rows:
        assert r.verified, r.note
        assert r.median_s is not None and r.median_s > 0
        assert r.peak_bytes is not None and r.peak_bytes >= 0
    assert race.row("eager").loss_error == 0.0
    assert race.memory_method in ("profiler", "cuda-allocator")
    assert "| opswap |" in race.table()
    assert race.to_json()["check_steps"] == 3
    for p, q in zip(model.parameters(), before, strict=True):  # the user's model is only copied
        assert torch.equal(p, q)


def test_a_variant_that_trains_differently_is_reported_unverified() -> None:
    model = _mlp()
    batch = (torch.randn(5, 19), torch.randint(0, 10, (5,)))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    race = race_training(
        model,
        batch,
        loss_fn,
        variants=("eager", "opswap"),
        min_time_s=0.02,
        loss_rtol=0.0,
        prepare_kw={"fuse_loss": True},
        lr=0.5,
    )
    # a zero tolerance: only a bit-identical loss passes; the fused loss rounds differently
    opswap = race.row("opswap")
    assert opswap.loss_error is not None
    assert opswap.verified == (opswap.loss_error == 0.0)


def test_bad_variants_are_refused() -> None:
    with pytest.raises(ValueError, match="variants"):
        race_training(
            _mlp(),
            (torch.randn(2, 19), torch.randint(0, 10, (2,))),
            F.cross_entropy,
            variants=("opswap",),
        )


def test_optimize_train_prints_the_race_and_writes_result_json(tmp_path: Path) -> None:
    from opswap.cli import main

    out = tmp_path / "out"
    try:
        main(
            [
                "optimize",
                "zoo:gpt",
                "--set",
                "layers=1",
                "--set",
                "seq=12",
                "--train",
                "--compare",
                "none",
                "-o",
                str(out),
            ]
        )
    except SystemExit as e:
        assert not e.code
    data = json.loads((out / "result.json").read_text())
    assert [v["name"] for v in data["variants"]] == ["eager", "opswap"]
    assert all(v["verified"] for v in data["variants"])
    assert any(r["rule"] == "attention.sdpa" for r in data["prepare"]["replaced"])
    assert any("fuse_loss=True" in n for n in data["prepare"]["notes"])  # a CPU target
    assert data["prepare"]["gradients"]["passed"]


def test_optimize_train_refuses_export() -> None:
    from opswap.config import OptimizeConfig
    from opswap.errors import OpswapError

    with pytest.raises(OpswapError, match="--train"):
        OptimizeConfig(train=True, export="onnx")


class _WithOwnLoss(nn.Module):
    """A peer that computes its loss in its forward (as Liger's patched model does)."""

    def __init__(self, model: nn.Module, scale: float = 1.0):
        super().__init__()
        self.model, self.scale = model, scale

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y) * self.scale


def test_extra_peers_are_raced_and_checked_like_the_rest() -> None:
    model = _mlp()
    batch = (torch.randn(6, 19), torch.randint(0, 10, (6,)))
    same, off = _mlp(), _mlp()
    same.load_state_dict(model.state_dict())
    off.load_state_dict(model.state_dict())
    race = race_training(
        model,
        batch,
        F.cross_entropy,
        variants=("eager",),
        min_time_s=0.02,
        extra={"peer": _WithOwnLoss(same), "scaled": _WithOwnLoss(off, 1.5)},
    )
    assert [r.name for r in race.rows] == ["eager", "peer", "scaled"]
    assert race.row("peer").verified and race.row("peer").median_s is not None
    assert not race.row("scaled").verified and "differs" in race.row("scaled").note
