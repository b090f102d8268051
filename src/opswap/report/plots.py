"""Plots for the report, as PNG bytes (matplotlib, headless Agg backend)."""

from __future__ import annotations

import io
import math
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _title(ax, text: str, width: int = 60) -> None:
    """A title wrapped to the figure, so a long model name is not cut off."""
    ax.set_title("\n".join(textwrap.wrap(text, width)) or text, fontsize=10)


# A whisker may reach this far past the longest bar before it is cut: on a busy machine one
# variant's IQR can be several times every median, and an axis stretched to it shrinks the
# bars (the figure that counts) to slivers.
_WHISKER_ROOM = 1.5


def latency_bars(
    labels: list[str], medians_ms: list[float], spreads_ms: list[float], title: str
) -> bytes:
    """Median latency per variant with its spread (IQR) as error bars; each label sits
    past its bar's whisker. The axis follows the bars: a whisker longer than
    `_WHISKER_ROOM` times the longest bar is cut there and marked with an arrow head."""
    fig, ax = plt.subplots(figsize=(7, 1.4 + 0.55 * len(labels)))
    palette = ["#8e8e93", "#636366", "#0a84ff", "#ff9f0a", "#30d158", "#bf5af2"]
    colors = [palette[i % len(palette)] for i in range(len(labels))]
    limit = _WHISKER_ROOM * max(medians_ms, default=1.0)
    half = [min(s / 2, max(limit - v, 0.0)) for v, s in zip(medians_ms, spreads_ms, strict=True)]
    cut = [s / 2 > h for s, h in zip(spreads_ms, half, strict=True)]
    ax.barh(labels, medians_ms, xerr=half, color=colors, capsize=4)
    ends = [v + h for v, h in zip(medians_ms, half, strict=True)]
    for i, (v, end) in enumerate(zip(medians_ms, ends, strict=True)):
        if cut[i]:
            ax.plot([end], [i], marker=">", color="#1d1d1f", ms=6)
        # offset in points, so the label clears the whisker's cap at any scale
        ax.annotate(
            f"{v:.3f} ms" + (" (IQR cut)" if cut[i] else ""),
            (end, i),
            xytext=(6 if not cut[i] else 9, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
    ax.set_xlabel("latency, ms (median; whisker = IQR)")
    _title(ax, title)
    ax.invert_yaxis()
    ax.set_xlim(0, max(ends) * 1.4 if ends else 1)
    return _png(fig)


def layer_errors(
    names: list[str], rel_l2: list[float], limit: float | None, first_bad: int | None, title: str
) -> bytes:
    """Relative L2 error of each layer's output, in execution order, log scale."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    floor = 1e-12
    ys = [max(v, floor) if math.isfinite(v) else 1e3 for v in rel_l2]
    xs = list(range(len(ys)))
    ax.plot(xs, ys, marker="o", ms=3, lw=1, color="#0a84ff")
    if limit is not None:
        ax.axhline(limit, color="#b00020", ls="--", lw=1, label=f"tolerance {limit:g}")
        ax.legend(loc="upper left")
    if first_bad is not None and 0 <= first_bad < len(xs):
        ax.scatter([first_bad], [ys[first_bad]], s=80, facecolors="none", edgecolors="#b00020")
        ax.annotate(
            f"first divergence: {names[first_bad]}",
            (first_bad, ys[first_bad]),
            textcoords="offset points",
            xytext=(6, 8),
            fontsize=8,
            color="#b00020",
        )
    ax.set_yscale("log")
    ax.set_ylabel("relative L2 error")
    ax.set_xlabel("layer (execution order)")
    # Upright labels, at most ~30 of them: slanted long names run into their neighbours.
    step = max(1, -(-len(names) // 30))
    ax.set_xticks(xs[::step])
    ax.set_xticklabels([n[-22:] for n in names[::step]], rotation=90, fontsize=7)
    _title(ax, title, 90)
    return _png(fig)


def category_time(
    categories: list[str], before: list[float], after: list[float], title: str
) -> bytes:
    """Estimated (roofline) time per op category, before and after."""
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.35 * len(categories)))
    ys = list(range(len(categories)))
    h = 0.4
    ax.barh([y - h / 2 for y in ys], [b * 1e6 for b in before], h, label="before", color="#8e8e93")
    ax.barh([y + h / 2 for y in ys], [a * 1e6 for a in after], h, label="after", color="#0a84ff")
    ax.set_yticks(ys)
    ax.set_yticklabels(categories)
    ax.invert_yaxis()
    ax.set_xlabel("estimated time, µs (roofline)")
    ax.legend()
    _title(ax, title)
    return _png(fig)


def roofline(
    points: list[tuple[str, float, float]], peak_flops: float, bandwidth: float, title: str
) -> bytes:
    """Ops as (label, intensity FLOP/byte, attainable FLOP/s) under the target's roofline."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ridge = peak_flops / bandwidth
    lo = min([p[1] for p in points if p[1] > 0] + [ridge / 100]) / 2
    hi = max([p[1] for p in points] + [ridge * 10]) * 2
    xs = [lo, ridge, hi]
    ax.plot(xs, [min(peak_flops, x * bandwidth) for x in xs], color="#1d1d1f", lw=1.5)
    ax.axvline(ridge, color="#8e8e93", ls=":", lw=1)
    xs_pos = [(x, y) for _, x, y in points if x > 0 and y > 0]
    if xs_pos:
        ax.scatter([p[0] for p in xs_pos], [p[1] for p in xs_pos], s=14, color="#0a84ff")
    # label the costliest ops, skipping any that would print over a label already placed
    placed: list[tuple[float, float]] = []
    for label, x, y in sorted(points, key=lambda p: -p[2])[:8]:
        if x <= 0 or y <= 0:
            continue
        lx, ly = math.log10(x), math.log10(y)
        if any(abs(lx - px) < 0.35 and abs(ly - py) < 0.25 for px, py in placed):
            continue
        placed.append((lx, ly))
        ax.annotate(label[-22:], (x, y), fontsize=7, textcoords="offset points", xytext=(4, 2))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity, FLOP/byte")
    ax.set_ylabel("attainable FLOP/s")
    _title(ax, title)
    return _png(fig)


def sparsity_curve(points: list[dict], reference: float, metric: str, title: str) -> bytes:
    """Accuracy against the share of weights dropped, one colour per method (points are
    train.finetune_sparse's CurvePoint dicts): dashed as pruned, solid after fine-tuning."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, method in enumerate(dict.fromkeys(p["method"] for p in points)):
        pts = sorted((p for p in points if p["method"] == method), key=lambda p: p["sparsity"])
        xs = [100 * p["sparsity"] for p in pts]
        ax.plot(xs, [p["accuracy"] for p in pts], "--o", color=f"C{i}", alpha=0.6, label=method)
        tuned = [p for p in pts if p.get("fine_tuned") is not None]
        if tuned:
            ax.plot(
                [100 * p["sparsity"] for p in tuned],
                [p["fine_tuned"] for p in tuned],
                "-s",
                color=f"C{i}",
                label=f"{method}, fine-tuned",
            )
    ax.axhline(reference, color="grey", lw=0.8, ls=":", label="unpruned")
    ax.set_xlabel("weights dropped (%)")
    ax.set_ylabel(f"accuracy ({metric})")
    _title(ax, title)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    return _png(fig)


def pareto_front(points: list[dict], title: str) -> bytes:
    """The joint search's plans, latency against error (tuning.search's point dicts):
    within the budget filled, beyond it hollow, the Pareto front as a step line, greedy's
    plan and the one chosen marked."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    floor = min((p["error"] for p in points if p["error"] > 0), default=1e-12) / 2

    def err(p: dict) -> float:  # a log axis cannot show 0: an exact plan sits at the floor
        return max(p["error"], floor)

    ok = [p for p in points if p["within_budget"]]
    bad = [p for p in points if not p["within_budget"]]
    ax.scatter(
        [p["latency_ms"] for p in ok], [err(p) for p in ok], c="C0", s=22, label="within budget"
    )
    ax.scatter(
        [p["latency_ms"] for p in bad],
        [err(p) for p in bad],
        facecolors="none",
        edgecolors="C3",
        s=22,
        label="beyond budget",
    )
    front = sorted((p for p in points if p.get("on_front")), key=lambda p: p["latency_ms"])
    if front:
        ax.step(
            [p["latency_ms"] for p in front],
            [err(p) for p in front],
            where="post",
            color="grey",
            lw=0.8,
            label="Pareto front",
        )
    for p in points:
        if p["how"] == "greedy":
            ax.scatter(
                [p["latency_ms"]],
                [err(p)],
                marker="s",
                s=80,
                facecolors="none",
                edgecolors="k",
                label="greedy",
            )
        if p.get("chosen"):
            ax.scatter([p["latency_ms"]], [err(p)], marker="*", s=160, c="C2", label="chosen")
    ax.set_yscale("log")
    ax.set_xlabel("latency, ms (whole model, median)")
    ax.set_ylabel("error (relative L2 against the model)")
    _title(ax, title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _png(fig)
