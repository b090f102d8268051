"""Choose `_int4_gemv`'s launch per shape where it runs, and time the decode stack with it.

    PYTHONPATH=src python3 benchmarks/tune_int4.py --out DIR      (or gpu_suite.py --only tune_int4)
    PYTHONPATH=src python3 benchmarks/tune_int4.py --apply DIR/tune_int4_h100.json
    PYTHONPATH=src python3 benchmarks/tune_int4.py --stacks-only --out DIR   (the stacks alone)
    PYTHONPATH=src python3 benchmarks/tune_int4.py --against OLD.py --out DIR  (A/B of two kernels)

Triton's autotuner times each launch of a kernel alone, back to back, on the first call.
A decoding model runs a Linear between other kernels, launched as a programmatic dependent
launch on Hopper (its first weight loads overlap the kernel before it): the launch that
wins alone need not win there. This script times every configuration `_int4_gemv` may
take (the autotuner's list, loading 0, 1 or 2 chunks ahead) the way the model
runs it: a CUDA graph of the 22 layers' Linears of one shape, one after another, PDL on
where the GPU has it, for each shape of the Llama-style 1.1B model of bench_lowbit.py (and
the shapes after fusion.parallel_linear), with scale and offset in float32 and in
bfloat16. All candidates of a shape are timed round-robin in one process, and the
autotuner's own pick is timed beside them.

It then times the decode stacks at one row (154 Linears, and the 88 after parallel_linear)
in one interleaved run: bfloat16 (cuBLAS), torch's tinygemm INT4, our INT4 as the
autotuner launches it, and our INT4 with the measured table (both scale dtypes).

Writes DIR/tune_int4_<card>.json; `--update-table` (or `--apply FILE` later, on any
machine) writes the winners into opswap/kernels/int4_tiles.json, which `_int4_gemv`
reads before autotuning.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_lowbit as lb  # noqa: E402
from _results import card  # noqa: E402

#: (K, N) of every Linear shape the stacks run, before and after parallel_linear
TUNE_SHAPES = sorted(set(lb.SHAPES.values()) | set(lb.FUSED.values()))
GROUP = 128
#: the peers timed in the same run: per shape ("bf16_us") and in the stacks ("bf16",
#: "int4 tinygemm")
PEERS = {
    "bf16": "cuBLAS through F.linear on the bfloat16 weight, per shape and in the stacks",
    "int4 tinygemm": "torch's INT4 GEMM (aten._weight_int4pack_mm, what torchao's int4 "
    "weight-only layout runs on CUDA), in the stacks",
}
SCALE_DTYPES = (torch.float32, torch.bfloat16)


def _candidates(k: int) -> list[dict]:
    """Every configuration of the autotuner's list that suits rows of K codes."""
    from opswap.kernels import weight_only as wo

    units = wo.padded_k(k, GROUP) // 32
    out = []
    for c in wo._int4_configs(depths=(0, 1, 2)):
        cfg = {**c.kwargs, "num_warps": c.num_warps}
        if wo._int4_fits(cfg, units):
            out.append(cfg)
    return out


def _name(cfg: dict) -> str:
    return "n{BLOCK_N}u{BLOCK_U}s{SPLIT_K}w{num_warps}p{PREFETCH}".format(**cfg)


def _layers(k: int, n: int, sdtype: torch.dtype, seed: int) -> list:
    from opswap.rules.precision._lowbit_modules import WeightOnlyLinear

    torch.manual_seed(seed)
    mods = []
    for _ in range(lb.LAYERS):
        m = WeightOnlyLinear(torch.randn(n, k, device="cuda").bfloat16() / k**0.5, None, bits=4)
        m.scale, m.offset = m.scale.to(sdtype), m.offset.to(sdtype)
        mods.append(m)
    return mods


@contextmanager
def _table(path: Path):
    """`_int4_gemv` reads the launch table at `path` meanwhile (a path with no file: the
    autotuner decides every launch, as before the table)."""
    from opswap.kernels import weight_only as wo

    old, wo.INT4_TILES_TABLE = wo.INT4_TILES_TABLE, path
    try:
        yield
    finally:
        wo.INT4_TILES_TABLE = old


#: a table path with no file behind it
NO_TABLE = Path("/nonexistent/int4_tiles.json")


def tune_shape(k: int, n: int, sdtype: torch.dtype, rounds: int, dev_class: str) -> dict:
    """Every candidate of one shape and scale dtype, timed over the 22 layers' Linears."""
    from opswap.kernels import weight_only as wo

    mods = _layers(k, n, sdtype, seed=k + n)
    x = torch.randn(1, k, device="cuda").bfloat16()

    def run_all(cfg):
        return [
            wo.triton_wo_linear(
                x, m.qweight, m.scale, m.offset, None, 4, k, config=cfg, int4_gemv=True
            )
            for m in mods
        ]

    cands = _candidates(k)
    graphs, errors, worst = {}, {}, 0.0
    m0 = mods[0]
    ref = wo.reference(x, m0.qweight, m0.scale, m0.offset, None, 4, k)
    for cfg in cands:
        try:
            graphs[_name(cfg)] = lb._capture(lambda cfg=cfg: run_all(cfg))
            # every candidate's answer against float64 before its time counts
            y = run_all(cfg)[0].double()
            err = float((y - ref).norm() / ref.norm())
            worst = max(worst, err)
            if not err < 1e-2:
                graphs.pop(_name(cfg))
                errors[_name(cfg)] = f"rel error {err:.3g} against float64"
        except Exception as e:  # one configuration failing must not lose the others
            errors[_name(cfg)] = f"{type(e).__name__}: {e}"[:300]
    with _table(NO_TABLE):  # the autotuner's pick, as the kernel made it before this table
        graphs["autotuned"] = lb._capture(lambda: run_all(None))
    w = torch.randn(n, k, device="cuda").bfloat16()
    graphs["bf16"] = lb._capture(lambda: [torch.nn.functional.linear(x, w) for _ in mods])
    t = lb._time_graphs(graphs, rounds, replays=10)
    per = {nm: sec / lb.LAYERS * 1e6 for nm, sec in t.items()}
    ranked = sorted((v, nm) for nm, v in per.items() if nm not in ("autotuned", "bf16"))
    best_us, best = ranked[0]
    cfg = next(c for c in cands if _name(c) == best)
    picked = wo.tuned_config("int4_gemv").get(f"1,{n},{k}")
    return {
        "device": dev_class,
        "n": n,
        "k": k,
        "group": GROUP,
        "scale_dtype": str(sdtype).removeprefix("torch."),
        "pdl": wo.pdl_ok(x.device) and wo.INT4_PDL,
        "config": cfg,
        "us": round(best_us, 3),
        "autotuned_us": round(per["autotuned"], 3),
        "autotuned_config": picked,
        "bf16_us": round(per["bf16"], 3),
        "speedup_vs_autotuned": round(per["autotuned"] / best_us, 3),
        "runner_up": [[round(v, 3), nm] for v, nm in ranked[1:4]],
        "candidates": len(cands),
        "worst_rel_err_vs_float64": worst,
        "errors": errors,
    }


def time_stacks(rounds: int, int4_graphs, after_each=None) -> list[dict]:
    """The 154- and 88-Linear stacks at one row, each in one interleaved run: bf16 and
    tinygemm (the peers), and the graphs `int4_graphs(weights, stack)` captures (weights:
    the 22 layers' bf16 weights by name; stack(layers) runs the layers' modules).
    `after_each(row)` is called after each stack (a checkpoint)."""
    out = []
    for label, shapes, layer_fn in (
        ("154 Linears", lb.SHAPES, lb._layer_fn),
        ("88 Linears (parallel_linear)", lb.FUSED, lb._fused_layer_fn),
    ):
        torch.manual_seed(3)
        bf = [
            {
                nm: torch.randn(n, k, device="cuda").bfloat16() / k**0.5
                for nm, (k, n) in shapes.items()
            }
            for _ in range(lb.LAYERS)
        ]
        x = torch.randn(1, 2048, device="cuda").bfloat16()

        def stack(L_all, x=x, layer_fn=layer_fn):
            outs: list = []
            h = x
            for L in L_all:
                h = layer_fn(L, h, outs)
            return h, outs

        peers = {
            s: [{nm: lb._build(s, w) for nm, w in lay.items()} for lay in bf]
            for s in ("bf16", "int4 tinygemm")
        }
        graphs = {s: lb._capture(lambda ms=ms: stack(ms)) for s, ms in peers.items()}
        graphs.update(int4_graphs(bf, stack))
        t = lb._time_graphs(graphs, rounds, replays=10)
        row = {"stack": label, "rows": 1}
        for s, sec in t.items():
            row[s] = {"ms": round(sec * 1e3, 4), "speedup_vs_bf16": round(t["bf16"] / sec, 3)}
        out.append(row)
        print(json.dumps(row), flush=True)
        if after_each is not None:
            after_each(row)
        del graphs
        torch.cuda.empty_cache()
    return out


def stacks(rounds: int, table: Path) -> list[dict]:
    """The stacks with our INT4 autotuned and with the measured table at `table`, float32
    and bfloat16 scales, beside bf16 and tinygemm."""
    from opswap.rules.precision._lowbit_modules import WeightOnlyLinear

    def int4_graphs(bf, stack):
        graphs = {}
        for sd in SCALE_DTYPES:
            mods = []
            for lay in bf:
                d = {}
                for nm, w in lay.items():
                    m = WeightOnlyLinear(w, None, bits=4)
                    m.scale, m.offset = m.scale.to(sd), m.offset.to(sd)
                    d[nm] = m
                mods.append(d)
            name = f"int4 {str(sd).removeprefix('torch.')} scales"
            with _table(NO_TABLE):
                graphs[f"{name}, autotuned"] = lb._capture(lambda mods=mods: stack(mods))
            with _table(table):
                graphs[f"{name}, table"] = lb._capture(lambda mods=mods: stack(mods))
        return graphs

    return time_stacks(rounds, int4_graphs)


def run(rounds: int, out_path: Path, table: Path) -> dict:
    from opswap.kernels import weight_only as wo
    from opswap.kernels.crossover import device_class

    dev_class = device_class(torch.device("cuda"))
    res: dict = {
        "env": lb._env(),
        "device_class": dev_class,
        "group": GROUP,
        # what our INT4 is timed against in this same run
        "peers": PEERS,
        "shapes": [],
    }
    t0 = time.time()
    for sd in SCALE_DTYPES:
        for k, n in TUNE_SHAPES:
            r = tune_shape(k, n, sd, rounds, dev_class)
            res["shapes"].append(r)
            print(
                f"K={k} N={n} {r['scale_dtype']}: best {_name(r['config'])} {r['us']} us, "
                f"autotuned {r['autotuned_us']} us ({r['speedup_vs_autotuned']}x), "
                f"bf16 {r['bf16_us']} us",
                flush=True,
            )
            out_path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    res["tune_s"] = round(time.time() - t0, 1)
    wo.update_int4_tiles(res["shapes"], "measured (scratch)", table)
    res["stacks"] = stacks(rounds, table)
    out_path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    return res


def _against(path: Path):
    """A file holding another `_int4_gemv_fn` (and the helpers it calls), loaded as a
    module of its own: the kernel to time beside the tree's (--against)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("int4_against", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def _kernel_of(mod):
    """`_int4_gemv` launches `mod`'s kernel meanwhile (None: the tree's)."""
    import triton

    from opswap.kernels import weight_only as wo

    key = ("int4_gemv_fixed", False)
    old = wo._KERNELS.get(key)
    wo._KERNELS[key] = (
        triton.jit(mod._int4_gemv_fn) if mod is not None else (old or triton.jit(wo._int4_gemv_fn))
    )
    try:
        yield
    finally:
        if old is None:
            wo._KERNELS.pop(key, None)
        else:
            wo._KERNELS[key] = old


def ab(rounds: int, against: Path, out_path: Path, splits: tuple[int, ...]) -> dict:
    """The tree's kernel ("tree") against the one in `against` ("against"): every
    candidate launch of both on each Linear shape of the stacks (float32 scales), timed
    round-robin in one process; then the 154- and 88-Linear stacks with each kernel on
    its own measured table, beside bf16 and tinygemm, in one interleaved run."""
    from opswap.kernels import weight_only as wo
    from opswap.kernels.crossover import device_class
    from opswap.rules.precision._lowbit_modules import WeightOnlyLinear

    mod = _against(against)
    dev_class = device_class(torch.device("cuda"))
    kernels = {"tree": None, "against": mod}
    res: dict = {"env": lb._env(), "against": against.name, "peers": PEERS, "shapes": []}
    rows: dict[str, list] = {k: [] for k in kernels}
    # the unfused layer's shapes first, costliest first, then parallel_linear's
    order = sorted(set(lb.SHAPES.values()), key=lambda kn: -kn[0] * kn[1] - kn[0])
    order += [kn for kn in TUNE_SHAPES if kn not in order]
    for k, n in order:
        mods = _layers(k, n, torch.float32, seed=k + n)
        x = torch.randn(1, k, device="cuda").bfloat16()
        ref = wo.reference(x, mods[0].qweight, mods[0].scale, mods[0].offset, None, 4, k)
        cands = [c for c in _candidates(k) if c["SPLIT_K"] in splits]
        graphs, errors = {}, {}
        for kname, kmod in kernels.items():
            with _kernel_of(kmod):
                for cfg in cands:
                    nm = f"{kname} {_name(cfg)}"

                    def run_all(cfg=cfg, x=x, k=k, mods=mods):
                        return [
                            wo.triton_wo_linear(
                                x,
                                m.qweight,
                                m.scale,
                                m.offset,
                                None,
                                4,
                                k,
                                config=cfg,
                                int4_gemv=True,
                            )
                            for m in mods
                        ]

                    try:
                        graphs[nm] = lb._capture(run_all)
                        err = float((run_all()[0].double() - ref).norm() / ref.norm())
                        if not err < 1e-2:
                            graphs.pop(nm)
                            errors[nm] = f"rel error {err:.3g} against float64"
                    except Exception as e:  # one launch failing must not lose the others
                        errors[nm] = f"{type(e).__name__}: {e}"[:300]
        t = lb._time_graphs(graphs, rounds, replays=10)
        per = {nm: sec / lb.LAYERS * 1e6 for nm, sec in t.items()}
        shape = {"n": n, "k": k, "errors": errors}
        for kname in kernels:
            ranked = sorted(
                (v, nm.split(" ", 1)[1]) for nm, v in per.items() if nm.startswith(kname + " ")
            )
            best_us, best = ranked[0]
            cfg = next(c for c in cands if _name(c) == best)
            shape[kname] = {
                "us": round(best_us, 3),
                "config": cfg,
                "all": [[round(v, 3), nm] for v, nm in ranked],
            }
            rows[kname].append(
                {
                    "device": dev_class,
                    "n": n,
                    "k": k,
                    "group": GROUP,
                    "scale_dtype": "float32",
                    "pdl": wo.pdl_ok(x.device) and wo.INT4_PDL,
                    "config": cfg,
                    "us": round(best_us, 3),
                }
            )
        res["shapes"].append(shape)
        print(
            f"K={k} N={n}: tree {shape['tree']['us']} us ({_name(shape['tree']['config'])}), "
            f"against {shape['against']['us']} us ({_name(shape['against']['config'])})",
            flush=True,
        )
        out_path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        del graphs
        torch.cuda.empty_cache()
    tables = {}
    for kname in kernels:
        tables[kname] = out_path.parent / f"int4_tiles_{kname}_scratch.json"
        tables[kname].unlink(missing_ok=True)
        wo.update_int4_tiles(rows[kname], "measured (scratch)", tables[kname])

    def int4_graphs(bf, stack):
        int4 = [{nm: WeightOnlyLinear(w, None, bits=4) for nm, w in lay.items()} for lay in bf]
        graphs = {}
        for kname, kmod in kernels.items():
            with _kernel_of(kmod), _table(tables[kname]):
                graphs[f"int4 {kname}, table"] = lb._capture(lambda: stack(int4))
        return graphs

    res["stacks"] = []

    def checkpoint(row: dict) -> None:
        res["stacks"].append(row)
        out_path.write_text(json.dumps(res, indent=1, default=str) + "\n")

    time_stacks(rounds, int4_graphs, checkpoint)
    return res


def wo_table() -> Path:
    """The launch table the package reads (kernels/int4_tiles.json)."""
    from opswap.kernels import weight_only as wo

    return wo.INT4_TILES_TABLE


def apply(path: Path) -> None:
    from opswap.kernels import weight_only as wo

    res = json.loads(path.read_text())
    n = wo.update_int4_tiles(res["shapes"], f"measured {path.name} {res['env']['date'][:10]}")
    print(f"int4_tiles.json: {n} entries from {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--update-table", action="store_true", help="rewrite int4_tiles.json")
    ap.add_argument("--apply", type=Path, help="write a earlier run's winners into the table")
    ap.add_argument(
        "--against", type=Path, help="a file with another _int4_gemv_fn: time both, A/B"
    )
    ap.add_argument("--splits", default="1,2", help="split-K values tried with --against")
    ap.add_argument(
        "--stacks-only",
        action="store_true",
        help="time the decode stacks with the committed table only (a few minutes: the "
        "autotuned variants timed beside it tune on their first call)",
    )
    args = ap.parse_args()
    if args.apply:
        apply(args.apply)
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: tune_int4.py times launches on one")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stacks_only:
        res = {
            "env": lb._env(),
            "table": "src/opswap/kernels/int4_tiles.json as committed",
            "peers": PEERS,
            "stacks": stacks(args.rounds, wo_table()),
        }
        path = args.out / f"tune_int4_stacks_{card()}.json"
        path.write_text(json.dumps(res, indent=1) + "\n")
        print("wrote", path)
        return
    if args.against:
        splits = tuple(int(v) for v in args.splits.split(","))
        ab(args.rounds, args.against, args.out / f"tune_int4_ab_{card()}.json", splits)
        return
    path = args.out / f"tune_int4_{card()}.json"
    res = run(args.rounds, path, args.out / "int4_tiles_scratch.json")
    if args.update_table:
        apply(path)
    print("wrote", path)
    for r in res["stacks"]:
        print(r["stack"], {k: v["speedup_vs_bf16"] for k, v in r.items() if isinstance(v, dict)})


if __name__ == "__main__":
    main()
