"""`opswap analyze|plan|optimize model.onnx`: the three commands on an ONNX file, each
calling one function of opswap.onnx and printing what it returns. `--set NAME=SIZE` gives
a symbolic dim's example size; `--set model_type=gpt2` the model type ORT's transformer
optimizer, the peer `optimize` races, is told."""

from __future__ import annotations

from pathlib import Path

from opswap.cli import consoles, render


def is_onnx(spec: str) -> bool:
    return spec.strip().lower().endswith(".onnx")


def refuse(spec: str, command: str) -> None:
    """A command that takes PyTorch models only, given an .onnx file: one sentence, before
    any plan or model is read."""
    if is_onnx(spec):
        from opswap.errors import SpecError

        raise SpecError(
            f"{spec} is an ONNX file; `opswap {command}` takes a PyTorch model. For an ONNX "
            "file use `opswap analyze`, `plan` or `optimize`, which rewrite and verify it in "
            "ONNX Runtime."
        )


def _load(spec: str, sets: dict[str, str]):
    from opswap.onnx.load import load_onnx

    sizes = {k: v for k, v in sets.items() if k != "model_type"}
    loaded = load_onnx(spec, sizes)
    render.line(loaded.describe() + (f"; sizes {loaded.sizes}" if loaded.sizes else ""))
    if loaded.inferred:
        render.note(f"{loaded.path.name} carried no value_info; shapes were inferred.")
    for text in loaded.notes:
        render.note(text)
    return loaded


def analyze(spec: str, sets: dict[str, str], json_path: Path | None, top: int) -> None:
    from opswap.onnx.analyze import analyze_onnx, render_table

    result = analyze_onnx(_load(spec, sets))
    render_table(result, consoles.console, top=top)
    render.write_json(json_path, result.to_json())


def _globs(rules: str | None) -> list[str] | None:
    return [g for g in rules.split(",") if g.strip()] if rules else None


def _misses(misses) -> None:
    for m in misses:
        consoles.console.print(
            f"  miss {m.rule} at {m.where}: {m.reason}", markup=False, soft_wrap=True
        )


def plan(
    spec: str, sets: dict[str, str], rules, exactness: str, out: Path, json_path: Path | None
) -> None:
    from opswap.onnx.plan import plan_onnx

    p, _ = plan_onnx(_load(spec, sets), _globs(rules), exactness)
    for rule, count in p.counts().items():
        render.line(f"  {rule}: {render.n(count, 'site')}")
    _misses(p.misses)
    p.save(out)
    render.line(f"wrote {out}")
    render.write_json(json_path, p.to_json())


def optimize(
    spec: str,
    sets: dict[str, str],
    rules,
    exactness: str,
    out: Path,
    samples: int,
    bench: bool,
    json_path: Path | None,
) -> bool:
    """Whether the result passed verification."""
    from opswap.onnx.optimize import optimize_onnx, save

    loaded = _load(spec, sets)
    result = optimize_onnx(
        loaded,
        _globs(rules),
        exactness,
        samples=samples,
        bench=bench,
        model_type=sets.get("model_type"),
    )
    paths = save(result, out)
    data = result.to_json()
    v = data["verification"]
    render.line(
        f"{data['model']}: {render.n(len(data['applied']), 'rewrite')}, "
        f"{render.n(len(data['misses']), 'near miss', 'near misses')}; verification "
        f"{'PASSED' if v['passed'] else 'FAILED'} (cosine {v['cosine']:.8f}, max_abs {v['max_abs']:.3g}, "
        f"{len(v['shapes'])} size sets)"
    )
    for x in data["variants"]:
        render.line(
            f"  {x['name']:<14} {x['ms']:8.3f} ms  {x['speedup_vs_input']:.2f}x vs input"
            + (" (saved)" if x["name"] == data["best"] else "")
        )
    for text in data["notes"][len(loaded.notes) :]:  # the load's were printed as they came
        render.note(text)
    for k, p in paths.items():
        render.line(f"  {k:<11} {p}")
    render.write_json(json_path, data)
    return bool(v["passed"])
