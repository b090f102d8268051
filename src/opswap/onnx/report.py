"""The report of `opswap optimize model.onnx`: report.md and a self-contained report.html,
built once as blocks (report.document) from result.json's data, so that a run writes both
whatever happened in it: a peer that failed or was not raced, a rewrite that failed
verification, no timing at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opswap.bench.stats import describe_speedup
from opswap.report.document import Block, Bullets, Heading, Image, Para, Table, to_html, to_markdown


def _f(x: Any, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)  # x != x: NaN


def _summary(data: dict[str, Any]) -> list[Block]:
    v, b = data["verification"], data["benchmark"]
    saved = "opswap's rewrite" if data["best"] == "opswap" else "the input as it was"
    text = f"Saved: **{saved}** (`{data['best']}`)."
    if b:
        ci = b.get("speedup_ci")
        text += (
            f" opswap's model against the input: {b['ref_ms']:.3f} ms -> {b['opt_ms']:.3f} ms, "
            f"{describe_speedup(b['speedup'], ci)} ({b['rounds']} rounds, {b['device']})."
        )
    sizes = data["sizes"] or "all fixed"
    verdict = "PASSED" if v["passed"] else "FAILED"
    check = (
        f"Sizes: {sizes}; verified at {len(v['shapes'])} size set(s): {verdict} "
        f"(cosine {_f(v.get('cosine'), '.8f')}, max_abs {_f(v.get('max_abs'), '.3g')})."
    )
    out: list[Block] = [Para(text), Para(check)]
    if v.get("reasons"):
        out.append(Bullets([f"`{r}`" if "`" not in r else r for r in v["reasons"]]))
    return out


def _variants(data: dict[str, Any]) -> list[Block]:
    if not data["variants"]:
        return []
    rows = []
    for x in data["variants"]:
        name = x["name"] + (" (saved)" if x["name"] == data["best"] else "")
        rows.append(
            [
                name,
                _f(x["ms"], ".3f"),
                _f(x["iqr_ms"], ".3f"),
                "1.00x (the yardstick)"
                if x["name"] == "input"
                else describe_speedup(x["speedup_vs_input"], x.get("speedup_ci")),
                "yes" if x["verified"] else "no",
            ]
        )
    out: list[Block] = [
        Heading("Variants (ONNX Runtime, CPU, one interleaved loop)"),
        Table(["variant", "ms", "IQR ms", "vs input [95% interval]", "verified"], rows, {1, 2}),
    ]
    try:
        from opswap.report.plots import latency_bars

        timed = [x for x in data["variants"] if x["ms"] is not None]
        png = latency_bars(
            [x["name"] for x in timed],
            [x["ms"] for x in timed],
            [x["iqr_ms"] or 0.0 for x in timed],
            f"{data['model']}: latency at {data['sizes'] or 'its fixed sizes'}",
        )
        out.append(Image("latency.png", png, "Median latency of each variant, IQR as whiskers."))
    except Exception:  # the plot is a bonus (matplotlib missing, no display backend)
        pass
    return out


def build(data: dict[str, Any]) -> list[Block]:
    """The report's blocks from result.json's data (OnnxResult.to_json)."""
    blocks: list[Block] = [Heading(f"opswap on {data['model']} (ONNX)", 1), *_summary(data)]
    if data["notes"]:
        blocks += [Heading("Notes"), Bullets(list(data["notes"]))]
    blocks += [Heading("Rewrites")]
    if data["counts"]:
        blocks.append(
            Table(["rule", "sites"], [[k, str(n)] for k, n in data["counts"].items()], {1})
        )
    else:
        blocks.append(Para("No rule applied."))
    blocks += [
        Heading("Near misses"),
        Bullets([f"{m['rule']} at `{m['where']}`: {m['reason']}" for m in data["misses"]])
        if data["misses"]
        else Para("none"),
    ]
    blocks += _variants(data)
    peer = data["peer"]
    if peer.get("fused") is not None:
        fused = ", ".join(f"{k} {n}" for k, n in peer["fused"].items() if n)
        blocks += [
            Heading("Peer"),
            Para(
                f"ONNX Runtime's transformer optimizer (model_type={peer['model_type']}) "
                f"fused: {fused or 'nothing'}."
            ),
        ]
    return blocks


def write_reports(data: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """report.md (with its PNG files) and the self-contained report.html in `out`."""
    out = Path(out)
    blocks = build(data)
    md, files = to_markdown(blocks)
    for name, png in files.items():
        (out / name).write_bytes(png)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(to_html(blocks, f"opswap: {data['model']} (ONNX)"))
    return {"report_md": out / "report.md", "report_html": out / "report.html"}
