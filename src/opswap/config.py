"""The settings of one optimize run (`OptimizeConfig`) and the words its fields take.

It sits under everything that reads a run's settings (stages, pipeline, result, artifact,
api, the CLI), so that none of them imports another to learn the type of `config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from opswap.backends import registry
from opswap.bench.device import check_device
from opswap.bench.runtimes import missing
from opswap.bench.variants import parse_compare
from opswap.errors import OpswapError, RuleError, VerificationError
from opswap.graph.calibration_data import check_path
from opswap.graph.observers import METHODS as CALIBRATION_METHODS
from opswap.rules.base import EXACTNESS_ORDER, Exactness
from opswap.rules.registry import parse_patterns
from opswap.tuning import resolve_path
from opswap.verify.tolerance import tolerance_for

#: what `save` may name: the race's winner, or opswap's candidate whatever the race says
SAVE_CHOICES = ("winner", "candidate")

#: the sizes kept symbolic: one of these, or a comma-separated list of I:D=name axes
DynamicSetting = Literal["auto", "none", "batch", "seq"] | str
#: the baselines raced beside opswap's result: one of these (a runtime's name among them),
#: or several comma-separated
Compare = Literal["compile", "ort", "openvino", "executorch", "tvm", "none"] | str
#: what --export saves, the file of one runtime (bench.runtimes, the registry's formats)
Export = Literal["onnx", "ort", "openvino", "executorch", "pte"] | str


@dataclass
class OptimizeConfig:
    """Settings of one `optimize` run; the CLI flags map onto these fields. A setting the
    run could not use is refused when the config is made, in one sentence."""

    target: str = "cpu"
    # glob patterns, or one comma-separated string of them (made a list); empty = every rule
    rules: list[str] | str = field(default_factory=list)
    exactness: Exactness = "exact"  # loosest rule class allowed: exact < approx < lossy
    budget: str | None = None  # e.g. "cosine>=0.9999"; default follows exactness
    samples: int = 3  # random input samples verification runs on
    seed: int = 0
    bench: bool = True
    layers: bool = True  # layer-by-layer comparison in the report
    rollback: bool = True  # bisect and drop sites that break the budget
    measure_rules: bool = True  # time the result without each rule (measured per-rule gain)
    prune_slow: bool = True  # drop the rules the model measures faster without (beyond noise)
    device: str = "cpu"
    dynamic: DynamicSetting = (
        "auto"  # input sizes kept symbolic: auto, none, batch, seq, I:D=name,...
    )
    compare: Compare = "compile"  # baselines raced beside opswap's result, comma-separated
    # "onnx" or "ort": race ONNX Runtime and save model.onnx; "openvino": OpenVINO and its IR
    # (model.xml); "executorch" or "pte": ExecuTorch and model.pte
    export: Export | None = None
    keep_hooks: bool = False  # refuse a model with hooks rather than optimize it without them
    # static int8's calibration: range method (minmax, percentile, mse, entropy), how many
    # sample inputs it runs, symmetric or asymmetric activations, per-channel weights
    calibrate: str = "minmax"
    calibration_samples: int = 8
    symmetric_activations: bool = False
    per_channel_weights: bool = True
    # a file of calibration batches (.pt, .npy, .npz: graph.calibration_data), every batch
    # used; without it, `calibration_samples` random samples or a task's training batches
    calibration: str | None = None
    # what the run saves: "winner" (the race's fastest verified variant) or "candidate"
    # (opswap's model even where it loses the race; refused where it fails verification)
    save: str = "winner"
    # the tuning database's file (opswap.tuning): None is the default place (OPSWAP_TUNING_DB,
    # else the user's cache directory), "off" times every site afresh
    tuning_db: str | None = None
    # time only the k candidates the learned cost model ranks first at a site with more
    # (the baseline is always timed); None times every candidate
    tuning_top_k: int | None = None
    # plan for training (opswap.train.prepare: only rules valid in training, gradients
    # checked) and race full training steps instead of inference calls
    train: bool = False
    # how the plan is chosen: "greedy" (every site a rule predicts to pay, rule by rule) or
    # "joint" (tuning.search: from greedy's plan, whole plans measured and the fastest
    # within the budget kept), with at most `search_budget` plans measured
    search: Literal["greedy", "joint"] = "greedy"
    search_budget: int = 12
    # where the joint search's timings run (tuning.scale): None here, interleaved with
    # greedy's plan; "auto" a Ray cluster found or started here, else a Ray address
    # (HOST:6379 or ray://HOST:10001)
    ray: str | None = None

    def __post_init__(self) -> None:
        self.rules = list(parse_patterns(self.rules))  # a comma-separated string too
        if self.exactness not in EXACTNESS_ORDER:
            raise RuleError(f"exactness must be exact, approx or lossy; got {self.exactness!r}.")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise VerificationError(
                f"samples must be at least 1 (the example itself); got {self.samples!r}."
            )
        if self.calibrate not in CALIBRATION_METHODS:
            raise RuleError(
                f"calibrate must be one of {', '.join(CALIBRATION_METHODS)}; got {self.calibrate!r}."
            )
        if (
            isinstance(self.calibration_samples, bool)
            or not isinstance(self.calibration_samples, int)
            or self.calibration_samples < 1
        ):
            raise RuleError(
                f"calibration_samples must be at least 1; got {self.calibration_samples!r}."
            )
        if self.save not in SAVE_CHOICES:
            raise OpswapError(f"save must be {' or '.join(SAVE_CHOICES)}; got {self.save!r}.")
        if self.tuning_db is not None:
            resolve_path(self.tuning_db)  # a directory is refused now
        if self.tuning_top_k is not None and (
            isinstance(self.tuning_top_k, bool)
            or not isinstance(self.tuning_top_k, int)
            or self.tuning_top_k < 1
        ):
            raise OpswapError(
                f"tuning_top_k must be a whole number of candidates, at least 1; got "
                f"{self.tuning_top_k!r}."
            )
        if self.train and (self.export is not None or self.save != "winner"):
            raise OpswapError(
                "--train races training steps and saves no model; drop --export and --save."
            )
        if self.search not in ("greedy", "joint"):
            raise OpswapError(f"search must be greedy or joint; got {self.search!r}.")
        if (
            isinstance(self.search_budget, bool)
            or not isinstance(self.search_budget, int)
            or self.search_budget < 1
        ):
            raise OpswapError(
                f"search_budget must be a whole number of plans to measure, at least 1; got "
                f"{self.search_budget!r}."
            )
        if self.calibration is not None:  # a missing file fails before the model loads
            self.calibration = str(check_path(self.calibration))
        tolerance_for(self.exactness, self.budget)  # a budget it cannot read fails now
        check_device(self.device)  # so do a device name and CUDA without a GPU
        if self.bench:
            parse_compare(self.compare)  # so does a typo in the baselines
        saving = registry.for_export(self.export) if self.export is not None else None
        if self.export is not None and saving is None:
            raise OpswapError(
                f"export must be one of {', '.join(registry.export_formats())}; got "
                f"{self.export!r} (model.pt2 is written either way)."
            )
        if saving is not None and not self.bench:
            raise OpswapError(
                f"--export {self.export} saves {saving.saves}, the file the race "
                "verified and timed; drop --no-bench to export."
            )
        absent = missing(self.export) if self.export is not None else None
        if absent is not None:
            raise OpswapError(absent)
