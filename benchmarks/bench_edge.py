"""The edge race on this CPU, per zoo model: how much of the model each ExecuTorch program
delegates to XNNPACK (opswap's legalised one against ExecuTorch's default export), and the
latency of each next to LiteRT's where the model converts to a .tflite file; then the
quantized decoder (8-bit dynamic activations, 4-bit weights) against its fp32 export.

    PYTHONPATH=src python benchmarks/bench_edge.py [--models resnet,mobilenet,bert,gpt]
        [--hf vit,distilbert,roberta,convnext,whisper] [--litert-python EDGE_VENV/bin/python]
        [--out DIR] [--rounds 50] [--decoder HIDDEN,LAYERS,HEADS,INTERMEDIATE,VOCAB]

`--hf` adds held-out Hugging Face types (not in the zoo), built by `hf:TYPE` from small
configs with random weights at batch 1 (text: sequence 64, no attention mask; images: 64
px); a type that does not build, export or lower is a row that says where and why.

Models at small sizes, batch 1, float32, random weights (zoo builders' seeds). For each:
`opswap.bench.edge.edge_race` builds `executorch` (torch.export + to_edge_transform_and_
lower with the XnnpackPartitioner, at the example's shapes), `opswap+executorch` (the plan
for the `xnnpack` edge target applied, lowered with opswap's lowerings) and, when
`--litert-python` names an interpreter with ai-edge-torch, `litert` (the model's
torch.export program converted there by benchmarks/_litert_convert.py, run here by
ai_edge_litert's interpreter, XNNPACK delegate); verifies each (cosine, top-1) and times
them interleaved. Each row: the delegated share of compute ops and of all ops for both
ExecuTorch programs, every op each leaves outside with the reason, ms per variant, the
winner and the ratios opswap/default and opswap/litert (below 1: opswap faster); and
`offline`: the model converted by coremltools to an .mlpackage (running it needs Apple
hardware) with the ANE op-set check, and the QNN (Hexagon) op-set check, from the
op-set description only.
Writes DIR/edge_cpu.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results  # noqa: E402

SIZES = {
    "resnet": {"batch": 1, "image_size": 64, "width": 32},
    "mobilenet": {"batch": 1, "image_size": 64, "width": 32},
    "bert": {"batch": 1, "seq": 64, "hidden": 128, "heads": 4, "layers": 2, "intermediate": 512},
    "gpt": {"batch": 1, "seq": 64, "hidden": 128, "heads": 4, "layers": 2, "intermediate": 344},
}
#: overrides of every `hf:TYPE` row (models.hf: a type ignores those it has no use for)
HF_SETTINGS = {"batch": "1", "seq": "64", "image_size": "64", "mask": "none"}
#: the decoder's size by default: (hidden, layers, heads, intermediate, vocab)
DECODER = (512, 4, 8, 1376, 8192)


def convert(
    python: str, model: torch.nn.Module, inputs: tuple, work: Path
) -> tuple[Path | None, str]:
    """(the .tflite file, '') or (None, why): the model's program converted in `python`."""
    pt2, tfl = work / "model.pt2", work / "model.tflite"
    torch.export.save(torch.export.export(model, inputs), pt2)
    script = Path(__file__).resolve().parent / "_litert_convert.py"
    got = subprocess.run(
        [python, str(script), str(pt2), str(tfl)], capture_output=True, text=True, timeout=900
    )
    if got.returncode != 0 or not tfl.exists():
        lines = [ln for ln in (got.stderr or got.stdout).strip().splitlines() if ln.strip()]
        return None, (lines[-1] if lines else f"exit {got.returncode}")[:300]
    return tfl, ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet,mobilenet,bert,gpt")
    p.add_argument("--litert-python", default=None)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--hf", default="", help="held-out Hugging Face types, comma-separated")
    p.add_argument("--no-decoder", action="store_true")
    p.add_argument("--decoder", default=",".join(map(str, DECODER)))
    a = p.parse_args()

    from opswap.bench.edge import edge_race, offline_checks
    from opswap.models import load
    from opswap.models.zoo import load_zoo

    rows = []
    specs = [f"zoo:{n}" for n in a.models.split(",") if n]
    specs += [f"hf:{n}" for n in a.hf.split(",") if n]
    for spec in specs:
        name = spec.split(":", 1)[1] if spec.startswith("zoo:") else spec
        try:
            if spec.startswith("zoo:"):
                m = load_zoo(name, spec, dict(SIZES.get(name, {"batch": 1})))
            else:
                m = load(spec, HF_SETTINGS)
        except Exception as err:  # a type transformers or opswap cannot build here
            rows.append({"model": name, "built": False, "error": f"{type(err).__name__}: {err}"})
            print(name, "not built:", rows[-1]["error"][:200])
            continue
        model, inputs = m.module.eval(), tuple(m.example_inputs)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            tfl, why = (None, "no --litert-python given")
            if a.litert_python:
                try:
                    tfl, why = convert(a.litert_python, model, inputs, work)
                except Exception as err:  # torch.export of the model itself failed
                    tfl, why = None, f"{type(err).__name__}: {str(err)[:300]}"
            race = edge_race(model, inputs, work / "race", tflite=tfl, rounds=a.rounds)
            try:
                offline = offline_checks(model, inputs, work)
            except Exception as err:  # torch.export of the model itself failed
                offline = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        d = race.to_dict()
        ms = {e["name"]: e["median_ms"] for e in d["entries"]}
        ours, base, lite = ms.get("opswap+executorch"), ms.get("executorch"), ms.get("litert")
        row = {
            "model": name,
            "settings": SIZES.get(name, HF_SETTINGS if spec.startswith("hf:") else {}),
            "parameters": sum(p.numel() for p in model.parameters()),
            "winner": race.winner,
            "ms": ms,
            "opswap_vs_default": None if not (ours and base) else round(ours / base, 3),
            "opswap_vs_litert": None if not (ours and lite) else round(ours / lite, 3),
            "litert": "converted" if tfl else f"not converted: {why}",
            "peak_mb": {
                e["name"]: (e["memory"] or {}).get("peak_mb") for e in d["entries"] if e["memory"]
            },
            "entries": d["entries"],
            "offline": offline,
        }
        if not any(e["verified"] for e in d["entries"]):
            with torch.no_grad():  # a degenerate model (all-zero outputs) fails every check
                outs = model(*inputs)
            outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
            row["model_output_abs_max"] = max(
                float(o.abs().max()) for o in outs if isinstance(o, torch.Tensor)
            )
        rows.append(row)
        share = {
            e["name"]: e["delegation"]["compute_share"] for e in d["entries"] if e["delegation"]
        }
        print(name, "winner", race.winner, "ms", ms, "compute share", share, row["litert"])
    extra = {}
    if not a.no_decoder:
        from opswap.bench.edge_llm import decoder_race

        hidden, layers, heads, inter, vocab = (int(v) for v in a.decoder.split(","))
        extra["decoder"] = decoder_race(hidden, layers, heads, inter, vocab)
        print("decoder", extra["decoder"])
    write_results(
        Path(a.out), "edge_cpu.json", "cpu", rows, threads=torch.get_num_threads(), **extra
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
