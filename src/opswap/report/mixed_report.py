"""The mixed-precision debugger's report: the per-site table and a plot of each site's
sensitivity against the tolerance, as report.md (+ its PNG) and a self-contained
report.html, with debug.json holding every figure and plan.json the plan it chose."""

from __future__ import annotations

import json
import math
from pathlib import Path

from opswap.report.document import Block, Bullets, Heading, Image, Para, Table, to_html, to_markdown
from opswap.report.plots import _png, _title, plt
from opswap.verify.mixed import GUARANTEE, MixedPrecision


def _g(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


def sensitivity_bars(names: list[str], rel_l2: list[float], kept: list[bool], limit, title: str):
    """Each site's relative L2 error when it alone is in low precision (log scale), in
    graph order; the sites kept in float32 in red, the tolerance as a dashed line."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.32 * max(len(names), 1)))
    ys = [max(v, 1e-12) if math.isfinite(v) else 1e3 for v in rel_l2]
    colors = ["#b00020" if k else "#0a84ff" for k in kept]
    ax.barh(names, ys, color=colors)
    if limit is not None:
        ax.axvline(limit, color="#1d1d1f", ls="--", lw=1, label=f"tolerance rel_l2 {limit:g}")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("relative L2 of the model's output, this site alone in low precision")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    _title(ax, title)
    return _png(fig)


def build(mp: MixedPrecision) -> list[Block]:
    kept = mp.kept
    blocks: list[Block] = [
        Heading(f"Mixed-precision debugging: {mp.model} with {', '.join(mp.rules)}", 1),
        Para(
            f"{len(mp.layers)} site(s) of the scheme on {mp.target}; tolerance "
            f"`{mp.tolerance}`; {mp.samples} sample(s). The scheme everywhere: rel_l2 "
            f"{_g(mp.everywhere.rel_l2)}, cosine {mp.everywhere.cosine:.6f}. "
            f"**{len(kept)} kept in float32** ({', '.join(f'`{s.site}`' for s in kept) or 'none'}): "
            f"rel_l2 {_g(mp.result.rel_l2)}, cosine {mp.result.cosine:.6f}; final verification "
            + (
                "PASSED"
                if mp.passed
                else "FAILED: "
                + "; ".join(mp.verification.reasons if mp.verification else ["not run"])
            )
            + f". {mp.trials} plans measured."
        ),
        Para(GUARANTEE),
        Heading("Per site"),
        Table(
            ["site", "module", "op", "rel_l2 alone", "cosine alone", "SQNR alone (dB)", "float32"],
            [
                [
                    f"`{s.site}`",
                    s.module or "-",
                    s.op,
                    _g(s.alone.rel_l2),
                    f"{s.alone.cosine:.6f}",
                    _g(s.alone.sqnr_db),
                    "kept" if s.kept else "-",
                ]
                for s in mp.layers
            ],
            align_right={3, 4, 5},
        ),
    ]
    if mp.layers:
        blocks.append(
            Image(
                "sensitivity.png",
                sensitivity_bars(
                    [s.site for s in mp.layers],
                    [s.alone.rel_l2 for s in mp.layers],
                    [s.kept for s in mp.layers],
                    mp.tolerance.rel_l2_max,
                    f"{mp.model}: sensitivity per site ({', '.join(mp.rules)})",
                ),
                "Each site alone in low precision; red: kept in float32",
            )
        )
    if mp.skipped:
        blocks += [Heading("Not candidates"), Bullets(mp.skipped[:50])]
    return blocks


def write_report(mp: MixedPrecision, out: str | Path) -> dict[str, Path]:
    """debug.json, plan.json, report.md (+ sensitivity.png) and report.html in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    blocks = build(mp)
    md, files = to_markdown(blocks)
    for name, png in files.items():
        (out / name).write_bytes(png)
    paths = {
        "debug": out / "debug.json",
        "plan": out / "plan.json",
        "report_md": out / "report.md",
        "report_html": out / "report.html",
    }
    paths["debug"].write_text(json.dumps(mp.to_json(), indent=2, default=str))
    mp.plan.save(paths["plan"])
    paths["report_md"].write_text(md)
    paths["report_html"].write_text(to_html(blocks, f"opswap: {mp.model} mixed precision"))
    return paths
