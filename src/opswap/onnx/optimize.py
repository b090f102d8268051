"""`opswap optimize model.onnx --out DIR`: plan and apply the ONNX rules, verify the result
in ONNX Runtime against the original file at the example sizes and at others where the
inputs have symbolic dims, race it against the original and against ORT's own transformer
optimizer in one interleaved loop, and save DIR/model.onnx (the file that was timed),
DIR/plan.json, DIR/result.json and DIR/report.md.

The saved model is opswap's when it passed verification and is not slower than the
input, else the input as it was, and result.json says which (`best`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opswap.errors import VerificationError
from opswap.onnx.load import other_sizes
from opswap.onnx.peer import op_counts, ort_optimize
from opswap.onnx.plan import OnnxPlan, plan_onnx
from opswap.onnx.runtime import Check, time_models, verify

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
    model_type: str = "bert",
    min_time_s: float = 1.0,
) -> OnnxResult:
    plan, candidate = plan_onnx(loaded, rules, exactness)
    sizes = [loaded.sizes, *other_sizes(loaded)]
    check = verify(loaded, candidate, sizes, exactness, samples)
    result = OnnxResult(plan, candidate, check, sizes=dict(loaded.sizes))
    peer_model = None
    try:
        peer_model, stats = ort_optimize(loaded.proto, model_type)
        result.peer = {"name": "ort-optimizer", "model_type": model_type, "fused": stats}
    except Exception as e:  # the peer failing is a finding, not opswap's error
        result.notes.append(
            f"ONNX Runtime's transformer optimizer (model_type={model_type}) failed on this "
            f"model: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        )
    peer_check = None
    if peer_model is not None:
        try:
            peer_check = verify(loaded, peer_model, sizes, "exact", 1)
            result.peer["verification"] = peer_check.to_json()
        except VerificationError as e:
            result.notes.append(f"the output of ORT's transformer optimizer does not run: {e}")
            peer_model = None
    if not bench:
        result.best = "opswap" if check.passed else "input"
        return result
    models = {"input": loaded.proto, "opswap": candidate}
    if peer_model is not None:
        models["ort-optimizer"] = peer_model
    res = time_models(models, loaded, loaded.sizes, min_time_s=min_time_s)
    verified = {
        "input": True,
        "opswap": check.passed,
        "ort-optimizer": bool(peer_check and peer_check.passed),
    }
    for name in models:
        r = res.ratio("input", name)
        result.variants.append(
            {
                "name": name,
                "ms": res[name].median_ms,
                "iqr_ms": res[name].iqr * 1e3,
                "speedup_vs_input": r.of_medians,
                "speedup_ci": [r.ci_low, r.ci_high],
                "verified": verified[name],
            }
        )
    sp = res.ratio("input", "opswap")
    result.benchmark = {
        "ref_ms": res["input"].median_ms,
        "opt_ms": res["opswap"].median_ms,
        "speedup": sp.of_medians,
        "speedup_ci": [sp.ci_low, sp.ci_high],
        "device": res.device,
        "rounds": len(res.rounds),
    }
    if "ort-optimizer" in models:
        result.benchmark["vs_ort_optimizer"] = res.ratio("ort-optimizer", "opswap").of_medians
    if not check.passed or sp.ci_high < 1.0:
        result.best = "input"
        result.model = loaded.proto
        result.notes.append(
            "opswap's model failed verification; the input is saved as it was"
            if not check.passed
            else "opswap's model was slower than the input here; the input is saved as it was"
        )
    return result


def save(result: OnnxResult, out: str | Path) -> dict[str, Path]:
    import onnx

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    paths = {
        "model": d / "model.onnx",
        "plan": d / "plan.json",
        "result": d / "result.json",
        "report_md": d / "report.md",
    }
    big = result.model.ByteSize() > _EXTERNAL_BYTES
    onnx.save(
        result.model, str(paths["model"]), save_as_external_data=big, location="model.onnx.data"
    )
    result.plan.save(paths["plan"])
    paths["result"].write_text(json.dumps(result.to_json(), indent=2) + "\n")
    paths["report_md"].write_text(report(result))
    return paths


def report(result: OnnxResult) -> str:
    data = result.to_json()
    v = data["verification"]
    lines = [
        f"# opswap on {data['model']} (ONNX)",
        "",
        f"Sizes: {data['sizes'] or 'all fixed'}; verified at {len(v['shapes'])} size set(s): "
        f"{'PASSED' if v['passed'] else 'FAILED'} (cosine {v['cosine']:.8f}, max_abs {v['max_abs']:.3g}).",
        "",
        "## Rewrites",
        "",
        "| rule | sites |",
        "|---|---|",
        *[f"| {k} | {n} |" for k, n in data["counts"].items()],
        "",
        "## Near misses",
        "",
        *([f"- {m['rule']} at `{m['where']}`: {m['reason']}" for m in data["misses"]] or ["none"]),
        "",
    ]
    if data["variants"]:
        lines += [
            "## Variants (ONNX Runtime, CPU, one interleaved loop)",
            "",
            "| variant | ms | IQR ms | vs input | verified |",
            "|---|---|---|---|---|",
        ]
        for x in data["variants"]:
            name = x["name"] + (" (saved)" if x["name"] == data["best"] else "")
            lines.append(
                f"| {name} | {x['ms']:.3f} | {x['iqr_ms']:.3f} | {x['speedup_vs_input']:.2f}x | {'yes' if x['verified'] else 'no'} |"
            )
        lines.append("")
    if data["peer"].get("fused"):
        fused = ", ".join(f"{k} {n}" for k, n in data["peer"]["fused"].items() if n)
        lines += [f"ORT's transformer optimizer fused: {fused or 'nothing'}.", ""]
    lines += [f"Note: {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"
