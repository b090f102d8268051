"""What every benchmark script writes: its rows with the date, device and versions."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path

import torch


def write_results(out_dir: Path, name: str, device: str, rows: list, **extra) -> Path:
    """out_dir/name as JSON: date (UTC), device, torch and Python versions, `extra`, rows."""
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **extra,
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print("wrote", path)
    return path


def first_tensor(out) -> torch.Tensor:
    """The first tensor of a model's output (logits for the models benchmarked), as float."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return leaves[0].float()


def compare_variants(
    fns: dict,
    inputs: tuple,
    baseline: str,
    *,
    device: str = "cpu",
    min_time_s: float = 2.0,
    max_time_s: float = 30.0,
    extra=None,
) -> list[dict]:
    """Time every callable of `fns` on `inputs` in one interleaved loop (inference mode),
    and give each its median ms, IQR, speed-up over `baseline` with the 95% interval, and
    the cosine and rel L2 of its first output against the baseline's; `extra(name, fn)`
    may add fields (a task's accuracy)."""
    from opswap.bench.timing import benchmark

    with torch.inference_mode():
        ref = first_tensor(fns[baseline](*inputs))
        quality = {}
        for k, f in fns.items():
            out = first_tensor(f(*inputs)).to(ref.device)
            quality[k] = {
                "rel_l2": float((out - ref).norm() / ref.norm()),
                "cosine": float(
                    torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
                ),
                **(extra(k, f) if extra is not None else {}),
            }
        res = benchmark(
            {k: (lambda f=f, a=inputs: f(*a)) for k, f in fns.items()},
            min_time_s=min_time_s,
            max_time_s=max_time_s,
            rel_width=0.1,
            device=device,
        )
    rows = []
    for k in fns:
        rr = res.ratio(baseline, k)
        rows.append(
            {
                "name": k,
                "ms": res[k].median * 1e3,
                "iqr_ms": res[k].iqr * 1e3,
                f"speedup_vs_{baseline}": rr.of_medians,
                "speedup_ci": [rr.ci_low, rr.ci_high],
                **quality[k],
            }
        )
    return rows


def openvino_variants(core, float_model, int8_model) -> tuple[dict, dict]:
    """The OpenVINO peers of an int8 benchmark, as callables on torch tensors, with each
    one's inference precision: "openvino_fp32" (float32 asked for), "openvino_default" (the
    CPU plugin's own pick, bfloat16 where the CPU has AVX-512 BF16) and "openvino_int8"
    (NNCF's model at the default, bfloat16 for what stays float there)."""
    fns, precision = {}, {}
    for name, model, config in (
        ("openvino_fp32", float_model, {"INFERENCE_PRECISION_HINT": "f32"}),
        ("openvino_default", float_model, {}),
        ("openvino_int8", int8_model, {}),
    ):
        compiled = core.compile_model(model, "CPU", config)
        precision[name] = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
        fns[name] = lambda *a, c=compiled: torch.from_numpy(c(tuple(t.numpy() for t in a))[0])
    return fns, precision


def card() -> str:
    """The file-name tag of this machine's GPU: the device tool lends an H100 or an H200,
    and their figures are compared only within one card."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return "h100" if "H100" in torch.cuda.get_device_name(0) else "h200"


def write_kernel_run(
    res: dict, out_dir: Path, stem: str, smoke: bool, update_crossover: bool, crossover_in=None
) -> Path:
    """A kernel benchmark's run as out_dir/STEM_<card>.json (h100 or h200; STEM_smoke.json
    with --smoke),
    and with `update_crossover` its measurements written into kernels/crossover.json
    (`crossover_in`: the rows in crossover.update's form, `res` itself by default). The
    interpreter measures nothing, so a smoke run never updates the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}_{'smoke' if smoke else card()}.json"
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print("wrote", path)
    if update_crossover and smoke:
        print("--update-crossover ignored with --smoke: the interpreter measures nothing")
    elif update_crossover:
        from opswap.kernels import crossover

        src = res if crossover_in is None else crossover_in
        new = crossover.update(src, f"measured {path.name} {res['date'][:10]}")
        print(f"crossover.json: {len(new)} entries measured")
    return path


def kernel_main(run, name: str) -> None:
    """A kernel benchmark's command line: --out (default $OUT or benchmarks/results),
    --smoke (tiny shapes on the CPU, in the interpreter), --update-crossover and --kernels
    (a subset, for a `run` that takes `kernels=`); runs `run(smoke)` and writes its record
    as DIR/<name>_<device>.json."""
    import argparse
    import os

    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", root / "benchmarks/results"))
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreter")
    ap.add_argument("--update-crossover", action="store_true", help="rewrite crossover.json")
    ap.add_argument(
        "--kernels", default="", help="comma-separated kernels to run (default: all of them)"
    )
    ap.add_argument(
        "--widths",
        default="",
        help="comma-separated row widths: the width sweep at 4096 rows instead of the default "
        "shapes (written as <name>_widths_<device>.json)",
    )
    args = ap.parse_args()
    kw: dict = {}
    picked = tuple(k for k in args.kernels.split(",") if k)
    if picked:
        kw["kernels"] = picked
    widths = tuple(int(w) for w in args.widths.split(",") if w)
    if widths:
        kw["widths"] = widths
        name += "_widths"
    res = run(args.smoke, **kw)
    write_kernel_run(res, args.out, name, args.smoke, args.update_crossover)


def pt2e_x86(module, xs, calibration):
    """torchao's PT2E static int8 with the x86 Inductor quantizer, as its docs give the flow
    for CPU inference: export, prepare_pt2e with the default x86 config (per-channel int8
    weights, per-tensor uint8 activations), calibrate on the same batches, convert_pt2e,
    then torch.compile with Inductor's freezing on, which lowers the quantize / dequantize
    patterns to onednn's int8 convolutions and Linears (with their ReLU, residual add and
    requantisation fused); or a reason string."""
    try:
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    except ImportError as e:
        return f"not installed: {e.name}"
    import torch._inductor.config as inductor_config

    try:
        gm = torch.export.export(module, tuple(xs)).module()
        quantizer = xiq.X86InductorQuantizer()
        quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
        prepared = prepare_pt2e(gm, quantizer)
        with torch.no_grad():
            for batch in calibration:
                prepared(*batch)
        converted = convert_pt2e(prepared)
        with inductor_config.patch(freezing=True), torch.inference_mode():
            fn = torch.compile(converted)
            fn(*xs)  # compiled here, with freezing
    except Exception as e:  # the peer failing must not lose the run
        return f"{type(e).__name__}: {e}"[:300]
    return fn
