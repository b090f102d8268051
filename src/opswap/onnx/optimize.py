"""`opswap optimize model.onnx --out DIR`: plan and apply the ONNX rules, verify the result
in ONNX Runtime against the original file at the example sizes and at others where the
inputs have symbolic dims, race it against the original and against ORT's own transformer
optimizer in one interleaved loop (where the model has the blocks that optimizer is
written for), and save DIR/model.onnx (the file that was timed), DIR/plan.json,
DIR/result.json, DIR/report.md and DIR/report.html.

The saved model is opswap's when it passed verification and beat the input beyond the
run's noise, as in the PyTorch race (bench.variants.best), else the input as it was, and
result.json says which (`best`). Whatever fails in the peer is a note in the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opswap.bench.stats import narrow
from opswap.bench.variants import VariantTiming, best
from opswap.onnx.peer import applies, op_counts, ort_optimize
from opswap.onnx.plan import OnnxPlan, plan_onnx
from opswap.onnx.runtime import Check, time_models, verify
from opswap.onnx.sizes import other_sizes

if TYPE_CHECKING:
    import onnx

    from opswap.onnx.load import OnnxModel

#: a model this large is saved with its tensors in a data file beside it
_EXTERNAL_BYTES = 1_800_000_000


@dataclass
class OnnxResult:
    plan: OnnxPlan
    model: onnx.ModelProto
    verification: Check
    variants: list[dict[str, Any]] = field(default_factory=list)
    best: str = "opswap"
    peer: dict[str, Any] = field(default_factory=dict)
    benchmark: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.plan.model,
            "target": "cpu (onnxruntime)",
            "format": "onnx",
            "sizes": self.sizes,
            "applied": [{"rule": s.rule, "site": s.key} for s in self.plan.sites],
            "counts": self.plan.counts(),
            "misses": [m.to_json() for m in self.plan.misses],
            "verification": self.verification.to_json(),
            "benchmark": self.benchmark,
            "variants": self.variants,
            "best": self.best,
            "peer": self.peer,
            "ops": op_counts(self.model),
            "notes": self.notes,
        }


def optimize_onnx(
    loaded: OnnxModel,
    rules: list[str] | None = None,
    exactness: str = "exact",
    *,
    samples: int = 2,
    bench: bool = True,
    model_type: str | None = None,
    min_time_s: float = 1.0,
) -> OnnxResult:
    """Plan, verify and race `loaded`. ORT's transformer optimizer is raced with
    `model_type` ("bert" when None) where the model has the blocks it fuses, or always when
    `model_type` is given; whatever fails in the peer is a note, never the run's end."""
    plan, candidate = plan_onnx(loaded, rules, exactness)
    sizes = [loaded.sizes, *other_sizes(loaded)]
    check = verify(loaded, candidate, sizes, exactness, samples)
    result = OnnxResult(plan, candidate, check, sizes=dict(loaded.sizes), notes=list(loaded.notes))
    peer_model, peer_check = _peer(loaded, sizes, model_type, result)
    if not bench:
        _choose(result, loaded, faster=check.passed and bool(plan.sites))
        return result
    models = {"input": loaded.as_given, "opswap": candidate}
    if peer_model is not None:
        models["ort-optimizer"] = peer_model
    res = time_models(models, loaded, loaded.sizes, min_time_s=min_time_s)
    verified = {
        "input": True,
        "opswap": check.passed,
        "ort-optimizer": bool(peer_check and peer_check.passed),
    }
    timings = []
    for name in models:
        r = res.ratio("input", name)
        timing = VariantTiming(
            name,
            res[name].median_ms,
            res[name].iqr * 1e3,
            r.of_medians,
            r.q1,
            r.q3,
            verified[name],
            ci_low=r.ci_low,
            ci_high=r.ci_high,
            settled=True if name == "input" else narrow(r.ci_low, r.ci_high, r.of_medians, 0.1),
        )
        timings.append(timing)
        result.variants.append(timing.to_json())
    sp = res.ratio("input", "opswap")
    result.benchmark = {
        "ref_ms": res["input"].median_ms,
        "opt_ms": res["opswap"].median_ms,
        "speedup": sp.of_medians,
        "speedup_ci": [sp.ci_low, sp.ci_high],
        "within_noise": sp.within_noise,
        "device": res.device,
        "rounds": len(res.rounds),
    }
    if "ort-optimizer" in models:
        result.benchmark["vs_ort_optimizer"] = res.ratio("ort-optimizer", "opswap").of_medians
    # the PyTorch race's rule: opswap's file is saved only when it beat the input beyond
    # the run's noise (the lower end of its interval above 1), else the input is
    ours = [t for t in timings if t.name in ("input", "opswap")]
    _choose(result, loaded, faster=bool(plan.sites) and best(ours).name == "opswap")
    return result


def _peer(loaded: OnnxModel, sizes, model_type: str | None, result: OnnxResult):
    """ORT's transformer optimizer on the file as given, and its verification: (model,
    check), or (None, None) with a note saying why it is not raced."""
    proto = loaded.as_given
    if model_type is None:
        why = applies(proto)
        if why is not None:
            result.notes.append(f"ONNX Runtime's transformer optimizer was not raced: {why}.")
            return None, None
    kind = model_type or "bert"
    peer = f"ONNX Runtime's transformer optimizer (model_type={kind})"
    try:
        peer_model, stats = ort_optimize(proto, kind)
    except Exception as e:  # the peer failing is a finding, not opswap's error
        result.notes.append(f"{peer} failed on this model, so it was not raced: {_why(e)}")
        return None, None
    result.peer = {"name": "ort-optimizer", "model_type": kind, "fused": stats}
    try:
        peer_check = verify(loaded, peer_model, sizes, "exact", 1)
    except Exception as e:
        result.notes.append(f"{peer} made a model that could not be checked: {_why(e)}")
        return None, None
    result.peer["verification"] = peer_check.to_json()
    if not peer_check.passed:
        reasons = "; ".join(peer_check.reasons)[:300]
        result.notes.append(f"{peer} made a model that failed verification ({reasons}).")
        if not peer_check.ran:  # nothing to time
            return None, peer_check
    return peer_model, peer_check


def _why(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _choose(result: OnnxResult, loaded: OnnxModel, *, faster: bool) -> None:
    """Save opswap's model when `faster` (verified and ahead of the input beyond noise),
    else the file as given, with a note saying why."""
    if faster and result.verification.passed:
        result.best = "opswap"
        return
    result.best = "input"
    result.model = loaded.as_given
    if not result.verification.passed:
        why = "opswap's model failed verification"
    elif not result.plan.sites:
        why = "no rule applied"
    else:
        why = "opswap's model was not faster than the input beyond the run's noise"
    result.notes.append(f"{why}; the input is saved as it was")


def save(result: OnnxResult, out: str | Path) -> dict[str, Path]:
    import onnx

    from opswap.onnx.report import write_reports

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"model": d / "model.onnx", "plan": d / "plan.json", "result": d / "result.json"}
    big = result.model.ByteSize() > _EXTERNAL_BYTES
    onnx.save(
        result.model, str(paths["model"]), save_as_external_data=big, location="model.onnx.data"
    )
    result.plan.save(paths["plan"])
    paths["result"].write_text(json.dumps(result.to_json(), indent=2) + "\n")
    paths.update(write_reports(result.to_json(), d))
    return paths
