"""The GPU low-bit Linears on the Linears of a Llama-style 1.1B model, on an H200.

    PYTHONPATH=src python3 benchmarks/bench_lowbit.py --out DIR     (or gpu_suite.py --only lowbit)

Shapes (TinyLlama-1.1B: hidden 2048, intermediate 5632, 22 layers, 4 KV heads of 64):
q and o 2048 -> 2048, k and v 2048 -> 256, gate and up 2048 -> 5632, down 5632 -> 2048.
Schemes: bfloat16 through cuBLAS (F.linear), FP8 e4m3 row-wise (opswap::fp8_linear:
Triton row quantisation + torch._scaled_mm), weight-only INT8 per channel and INT4 in
groups of 128 (opswap::wo_linear, our Triton kernel up to 16 rows), and torch.compile of
the bfloat16 layer as the peer. Rows: 1 and 16 (decoding) and 4096 (prefill). At one row,
two variants of our INT4 as well (VARIANTS): the word-wise `_int4_gemv` (the default at
one row since 2026-12-05) with float32 and with bfloat16 scale and offset, beside the
general kernel ("int4", `_wo_kernel` at every row count), so that each run shows both.
The word kernel launches as kernels/int4_tiles.json says where it has the shape, scale
dtype and PDL (benchmarks/tune_int4.py measures that table), else as Triton's autotuner
picks.

Every figure is a CUDA-graph replay (a Linear at one row runs for about 1-6 us, under the
launch cost of eager PyTorch): the whole 22-layer stack of 154 Linears, and each shape
alone over its 22 layers' weights (so that the weights come from HBM, not the 50 MB L2).
Schemes are timed interleaved, round by round, in one process; the median of the rounds
is reported with the ceilings measured in the same run (copy bandwidth, bfloat16 and FP8
matmul rates). Writes DIR/lowbit_<card>.json (h100 or h200) with the device, versions and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card  # noqa: E402  (gpu_suite reads it as bench_lowbit.card)

LAYERS = 22
# name -> (K, N)
SHAPES = {
    "q": (2048, 2048),
    "k": (2048, 256),
    "v": (2048, 256),
    "o": (2048, 2048),
    "gate": (2048, 5632),
    "up": (2048, 5632),
    "down": (5632, 2048),
}
UNIQUE = {"q/o": "q", "k/v": "k", "gate/up": "gate", "down": "down"}
# the same layer after fusion.parallel_linear (Linears that read one input become one):
# q, k, v -> qkv and gate, up -> gate_up, 4 launches a layer instead of 7
FUSED = {"qkv": (2048, 2560), "o": (2048, 2048), "gate_up": (2048, 11264), "down": (5632, 2048)}
ROWS = (1, 16, 4096)
FUSED_ROWS = (1, 16)
SCHEMES = ("bf16", "fp8", "int8", "int4")
#: torch's own INT4 GEMM (tinygemm, aten._weight_int4pack_mm: what torchao's int4
#: weight-only layout runs on CUDA), timed as the peer of our INT4 kernel
PEERS = ("int4 tinygemm",)
#: variants of our INT4, timed at one row only, to decide between them in one GPU run:
#: scale and offset stored in bfloat16 (6.25% of the codes' bytes instead of 12.5%), and
#: the previous one-row kernel (`_wo_kernel`'s grouped GEMV, int->float per code)
#: and the word kernel launched as a programmatic dependent launch (its first weight loads
#: overlapping the end of the Linear before it; `weight_only.INT4_PDL`), and both together
VARIANTS = (
    "int4 word kernel",
    "int4 word kernel bf16 scales",
    "int4 word kernel pdl",
    "int4 word kernel bf16 scales pdl",
)


def _env() -> dict:
    import triton

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
    }


def _time_graphs(graphs: dict, rounds: int, replays: int) -> dict[str, float]:
    """Median seconds per replay of each graph, timed round-robin."""
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(rounds):
        for k, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(replays):
                g.replay()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) / 1e3 / replays)
    return {k: statistics.median(v) for k, v in times.items()}


def _capture(fn, warm: int = 2) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):  # autotuning, counters and cuBLAS handles outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _launch_floor() -> float:
    """Seconds per launch of a Triton kernel that stores one number, 154 of them in a row
    in one CUDA graph, each reading what the last wrote: the least a dependent Linear
    costs here, whatever its bytes."""
    import triton
    import triton.language as tl

    @triton.jit
    def _bump(p):
        tl.store(p, tl.load(p) + 1.0)

    buf = torch.zeros(1, device="cuda")
    g = _capture(lambda: [_bump[(1,)](buf) for _ in range(154)])
    return _time_graphs({"floor": g}, rounds=7, replays=10)["floor"] / 154


def ceilings() -> dict:
    """Copy bandwidth and bfloat16 / FP8 matmul rates on random data, measured here."""
    from opswap.kernels import fp8_linear as fp8

    n = 8192
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    a8, sa = fp8.quantize_weight(a, rowwise=False)
    b8, sb = fp8.quantize_weight(b, rowwise=False)
    x = torch.empty(2 * 1024**3 // 4, device="cuda")
    y = torch.empty_like(x)
    fns = {
        "bf16": lambda: a @ b,
        "fp8": lambda: torch._scaled_mm(
            a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        "copy": lambda: y.copy_(x),
    }
    graphs = {k: _capture(f) for k, f in fns.items()}
    t = _time_graphs(graphs, rounds=7, replays=5)
    floor = _launch_floor()
    out = {
        "bf16_tflops": 2 * n**3 / t["bf16"] / 1e12,
        "fp8_tflops": 2 * n**3 / t["fp8"] / 1e12,
        "copy_tb_s": 2 * x.numel() * 4 / t["copy"] / 1e12,
        "launch_floor_us": floor * 1e6,
    }
    torch.cuda.empty_cache()
    return out


def _weight_bytes(scheme: str, k: int, n: int) -> int:
    if scheme == "bf16":
        return 2 * k * n
    if scheme == "fp8":
        return k * n + 4 * n
    if scheme == "int8":
        return k * n + 4 * n
    if scheme in ("int4 tinygemm", "int4 word kernel bf16 scales"):
        return k * n // 2 + 4 * n * (-(-k // 128))  # bfloat16 scale and zero per group
    return k * n // 2 + 8 * n * (-(-k // 128))  # int4: codes + fp32 scale and offset per group


def _tinygemm(w: torch.Tensor, group: int = 128):
    """torch's tinygemm INT4 Linear of a bfloat16 weight [N, K]: the same asymmetric
    groups of 128 as ours (scale and min per group, stored as tinygemm's scale and
    zero = min + 8 * scale, since it dequantises (q - 8) * scale + zero)."""
    from opswap.kernels import weight_only as wo

    n, k = w.shape
    q, scale, lo, _ = wo.quantize(w, 4, group)
    assert lo is not None  # INT4 has an offset
    codes = wo.unpack_int4(q).to(torch.int32)  # [N, K] in [0, 15]
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # even k high (tinygemm's order)
    wp = torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), 8)
    sz = torch.stack((scale, lo + 8 * scale), dim=2).transpose(0, 1).contiguous().bfloat16()
    return lambda x: torch.ops.aten._weight_int4pack_mm(x.contiguous(), wp, group, sz)


def _build(scheme: str, w: torch.Tensor):
    """One Linear of `scheme` from a bfloat16 weight [N, K] (no bias, as in Llama)."""
    from opswap.rules.precision._lowbit_modules import FP8Linear, WeightOnlyLinear

    if scheme == "bf16":
        return lambda x, w=w: F.linear(x, w)
    if scheme == "fp8":
        return FP8Linear(w, None, rowwise=True)
    if scheme == "int4 tinygemm":
        return _tinygemm(w)
    mod = WeightOnlyLinear(w, None, bits=8 if scheme == "int8" else 4)
    if "bf16 scales" in scheme:
        mod.scale, mod.offset = mod.scale.bfloat16(), mod.offset.bfloat16()
    if scheme.startswith("int4"):  # the word kernel, or the general kernel at every row count
        from opswap.kernels import weight_only as wo

        words = scheme.startswith("int4 word kernel")
        pdl = scheme.endswith(" pdl")

        def pinned(x, mod=mod, words=words, pdl=pdl):
            if x.numel() // mod.in_features > wo.TRITON_MAX_ROWS:
                return mod(x)
            args = (mod.qweight, mod.scale, mod.offset, None, 4, mod.in_features)
            old, wo.INT4_PDL = wo.INT4_PDL, pdl
            try:
                return wo.triton_wo_linear(x, *args, int4_gemv=words)
            finally:
                wo.INT4_PDL = old

        return pinned
    return mod


def _fused_layer_fn(L: dict, x: torch.Tensor, outs: list) -> torch.Tensor:
    qkv = L["qkv"](x)
    outs.append(qkv)
    o = L["o"](qkv[..., :2048])
    gu = L["gate_up"](o)
    outs.append(gu)
    return L["down"](gu[..., :5632])


def fused_stack(rounds: int, schemes: tuple[str, ...]) -> list[dict]:
    """The 22 layers after fusion.parallel_linear (88 Linears), at decoding rows, for
    every scheme: the launches per layer drop from 7 to 4 for bfloat16 and the low-bit
    schemes alike."""
    torch.manual_seed(1)
    ws = [
        {nm: torch.randn(n, k, device="cuda").bfloat16() / k**0.5 for nm, (k, n) in FUSED.items()}
        for _ in range(LAYERS)
    ]
    out = []
    for s in schemes:
        try:
            [_build(s, ws[0]["o"])]
        except Exception as e:
            out.append({"scheme": s, "error": f"{type(e).__name__}: {e}"[:300]})
    ok = [s for s in schemes if not any(r.get("scheme") == s for r in out)]
    models = {s: [{nm: _build(s, w) for nm, w in lay.items()} for lay in ws] for s in ok}
    wbytes = {s: sum(_weight_bytes(s, k, n) for k, n in FUSED.values()) * LAYERS for s in ok}
    rows = []
    for m in FUSED_ROWS:
        x = torch.randn(m, 2048, device="cuda").bfloat16()

        def stack(L_all, x=x):
            outs: list = []
            h = x
            for L in L_all:
                h = _fused_layer_fn(L, h, outs)
            return h, outs

        graphs, errs = {}, {}
        for s in ok:
            if m != 1 and s in VARIANTS:
                continue
            try:
                graphs[s] = _capture(lambda s=s: stack(models[s]))
            except Exception as e:
                errs[s] = f"{type(e).__name__}: {e}"[:300]
        t = _time_graphs(graphs, rounds, replays=10)
        row: dict = {"rows": m, "linears": 4 * LAYERS}
        for s, sec in t.items():
            row[s] = {
                "ms": sec * 1e3,
                "gb_s": wbytes[s] / sec / 1e9,
                "speedup_vs_bf16": t["bf16"] / sec if "bf16" in t else None,
            }
        row.update({f"{s} error": e for s, e in errs.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del graphs
        torch.cuda.empty_cache()
    return out + rows


def layer_errors() -> dict:
    """Each scheme's relative L2 error against float64 on ONE Linear of each shape (the
    stack's error compounds over 88 chained Linears of random weights; this one does not)."""
    torch.manual_seed(2)
    res: dict = {}
    for label, nm in UNIQUE.items():
        k, n = SHAPES[nm]
        w = torch.randn(n, k, device="cuda").bfloat16() / k**0.5
        x = torch.randn(1, k, device="cuda").bfloat16()
        ref = x.double() @ w.double().t()
        res[label] = {}
        for s in ("bf16",) + SCHEMES[1:] + PEERS + VARIANTS:
            try:
                y = _build(s, w)(x)
                res[label][s] = float((y.double() - ref).norm() / ref.norm())
            except Exception as e:
                res[label][s] = f"{type(e).__name__}: {e}"[:200]
    return res


def _layer_fn(L: dict, x: torch.Tensor, outs: list) -> torch.Tensor:
    q = L["q"](x)
    outs += [L["k"](x), L["v"](x)]
    o = L["o"](q)
    g = L["gate"](o)
    outs.append(L["up"](o))
    return L["down"](g)


def _bf16_layer(x, wq, wk, wv, wo, wg, wu, wd):
    """The bfloat16 layer's Linears as one function of tensors (what torch.compile gets)."""
    q = F.linear(x, wq)
    o = F.linear(q, wo)
    return F.linear(F.linear(o, wg), wd), F.linear(x, wk), F.linear(x, wv), F.linear(o, wu)


def run(rounds: int = 15, path: Path | None = None) -> dict:
    """Every figure; with `path`, the figures so far are written there after each step, so a
    run cut short by the device's time limit keeps what it measured."""
    from opswap.kernels import weight_only as wo

    def checkpoint() -> None:
        if path is not None:
            path.write_text(json.dumps(res, indent=2, default=str) + "\n")

    torch.manual_seed(0)
    res: dict = {"env": _env(), "model": "Llama-style 1.1B Linears", "layers": LAYERS}
    res["shapes_k_n"] = SHAPES
    res["ceilings"] = ceilings()
    print("ceilings", res["ceilings"], flush=True)
    t0 = time.time()
    bf = [
        {
            name: torch.randn(n, k, device="cuda").bfloat16() / k**0.5
            for name, (k, n) in SHAPES.items()
        }
        for _ in range(LAYERS)
    ]
    models = {"bf16": [{nm: _build("bf16", w) for nm, w in lay.items()} for lay in bf]}
    for s in SCHEMES[1:]:
        models[s] = [{nm: _build(s, w) for nm, w in lay.items()} for lay in bf]
    try:
        models["int4 tinygemm"] = [
            {nm: _build("int4 tinygemm", w) for nm, w in lay.items()} for lay in bf
        ]
    except Exception as e:  # the peer failing must not lose our figures
        res["tinygemm_error"] = f"{type(e).__name__}: {e}"[:500]
    for v in VARIANTS:
        try:
            models[v] = [{nm: _build(v, w) for nm, w in lay.items()} for lay in bf]
        except Exception as e:  # a variant failing must not lose the other figures
            res.setdefault("variant_errors", {})[v] = f"{type(e).__name__}: {e}"[:500]
    schemes = tuple(models)
    res["build_s"] = round(time.time() - t0, 1)
    layer_bytes = {
        s: sum(_weight_bytes(s, k, n) for k, n in SHAPES.values()) * LAYERS for s in schemes
    }
    flops_per_row = 2 * sum(k * n for k, n in SHAPES.values()) * LAYERS
    res["stack"], res["per_shape"], res["errors"] = [], [], {}
    for m in ROWS:
        x = torch.randn(m, 2048, device="cuda").bfloat16()

        def stack(L_all, x=x):
            outs: list = []
            h = x
            for L in L_all:
                h = _layer_fn(L, h, outs)
            return h, outs

        # tinygemm: a decoding peer; the INT4 variants differ from int4 at one row only
        here = [s for s in schemes if (m <= 16 or s not in PEERS) and (m == 1 or s not in VARIANTS)]
        fns = {s: (lambda s=s: stack(models[s])) for s in here}
        try:
            compiled = torch.compile(_bf16_layer, dynamic=False)
            wts = [tuple(lay[nm] for nm in SHAPES) for lay in bf]

            def cstack(x=x, compiled=compiled, wts=wts):
                outs: list = []
                h = x
                for ws in wts:
                    h, *rest = compiled(h, *ws)
                    outs += rest
                return h, outs

            cstack()
            fns["bf16 compiled"] = cstack
        except Exception as e:  # the peer failing must not lose our figures
            res.setdefault("compile_error", {})[m] = f"{type(e).__name__}: {e}"[:500]
        outs = {}
        graphs = {}
        for s, f in fns.items():
            try:
                graphs[s] = _capture(f)
                outs[s] = f()[0]
            except Exception as e:
                res["errors"][f"{s} rows={m}"] = traceback.format_exc()[-1500:]
                print("ERROR", s, m, e, flush=True)
        t = _time_graphs(graphs, rounds, replays=3 if m > 16 else 10)
        ref = outs["bf16"].double()
        row: dict = {"rows": m}
        for s, sec in t.items():
            wb = layer_bytes["bf16" if s == "bf16 compiled" else s]
            act = 2 * m * sum(k + n for k, n in SHAPES.values()) * LAYERS
            row[s] = {
                "ms": sec * 1e3,
                "tflops": flops_per_row * m / sec / 1e12,
                "gb_s": (wb + act) / sec / 1e9,
                "speedup_vs_bf16": t["bf16"] / sec,
                # the scheme's last-layer output against bf16's (errors compound over layers)
                "rel_err_vs_bf16": float((outs[s].double() - ref).norm() / ref.norm())
                if s in outs
                else None,
            }
        res["stack"].append(row)
        print(json.dumps(row), flush=True)
        del graphs
        torch.cuda.empty_cache()
        # each shape alone, over the 22 layers' weights
        for label, nm in UNIQUE.items():
            k, n = SHAPES[nm]
            xs = torch.randn(m, k, device="cuda").bfloat16()
            gs = {}
            for s in here:
                lins = [models[s][i][nm] for i in range(LAYERS)]
                gs[s] = _capture(lambda lins=lins, xs=xs: [f(xs) for f in lins])
            ts = _time_graphs(gs, rounds, replays=3 if m > 16 else 10)
            prow = {"rows": m, "shape": label, "k": k, "n": n}
            for s, sec in ts.items():
                per = sec / LAYERS
                b = _weight_bytes(s, k, n) + 2 * m * (k + n)
                prow[s] = {
                    "us": per * 1e6,
                    "tflops": 2 * m * k * n / per / 1e12,
                    "gb_s": b / per / 1e9,
                    "speedup_vs_bf16": ts["bf16"] / sec,
                }
            res["per_shape"].append(prow)
            print(json.dumps(prow), flush=True)
            del gs
        torch.cuda.empty_cache()
        checkpoint()
    res["layer_rel_err_vs_float64"] = layer_errors()
    checkpoint()
    res["fused_stack"] = fused_stack(rounds, schemes)
    res["tuned"] = {kind: wo.tuned_config(kind) for kind in wo.KINDS}
    fused1: dict = next((r for r in res["fused_stack"] if r.get("rows") == 1), {})
    res["targets"] = {
        "int4_rows1_vs_bf16": res["stack"][0].get("int4", {}).get("speedup_vs_bf16"),
        "int4_rows1_fused_vs_bf16_fused": fused1.get("int4", {}).get("speedup_vs_bf16"),
        "int4_rows1_goal": 2.5,
        "int4_variants_rows1_vs_bf16": {
            v: res["stack"][0][v]["speedup_vs_bf16"] for v in VARIANTS if v in res["stack"][0]
        },
        "fp8_prefill_vs_bf16": res["stack"][-1]["fp8"]["speedup_vs_bf16"],
        "fp8_prefill_goal": 1.3,
    }
    return res


def table(res: dict) -> str:
    lines = [f"ceilings: {json.dumps({k: round(v, 1) for k, v in res['ceilings'].items()})}"]
    lines.append("stack of 154 Linears (ms, speedup vs bf16):")
    for row in res["stack"]:
        cells = [
            f"{s} {v['ms']:.3f} ({v['speedup_vs_bf16']:.2f}x, {v['gb_s']:.0f} GB/s, {v['tflops']:.0f} TF/s)"
            for s, v in row.items()
            if s != "rows"
        ]
        lines.append(f"  rows {row['rows']}: " + " | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"lowbit_{card()}.json"
    res = run(args.rounds, path)
    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(table(res))
    print("wrote", path)


if __name__ == "__main__":
    main()
