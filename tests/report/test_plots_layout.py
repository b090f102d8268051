"""The report's plots as drawn: no text runs into other text, the title is inside the figure."""

from __future__ import annotations

import itertools

import pytest

from opswap.report import plots


@pytest.fixture
def figures(monkeypatch):
    """Keep each figure a plot function makes (drawn, as _png would) instead of its PNG."""
    kept = []

    def keep(fig):
        fig.tight_layout()
        fig.canvas.draw()
        kept.append(fig)
        return b""

    monkeypatch.setattr(plots, "_png", keep)
    yield kept
    for f in kept:
        plots.plt.close(f)


def _texts(fig):
    """Every text that is drawn: titles, axis labels, legend entries, annotations, and the
    tick labels of ticks inside the view (matplotlib keeps, but does not draw, the others)."""
    r = fig.canvas.get_renderer()
    texts = []
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        if ax.get_legend():
            texts += ax.get_legend().get_texts()
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if lo - 1e-9 * abs(hi) <= tick.get_loc() <= hi * (1 + 1e-9):
                    texts.append(tick.label1)
    return [
        (t.get_text(), t.get_window_extent(r))
        for t in texts
        if t.get_visible() and t.get_text().strip()
    ]


def _overlaps(fig):
    return [
        (a, b)
        for (a, ea), (b, eb) in itertools.combinations(_texts(fig), 2)
        if ea.overlaps(eb) and ea.width > 0 and eb.width > 0
    ]


def _inside(fig):
    W, H = fig.canvas.get_width_height()
    return [t for t, e in _texts(fig) if e.x0 < -1 or e.y0 < -1 or e.x1 > W + 1 or e.y1 > H + 1]


def test_layer_error_labels_do_not_collide(figures):
    names = [f"layers_{i // 9}_attention_output_dense_{i}" for i in range(140)]
    plots.layer_errors(
        names,
        [1e-7 * (1 + i % 5) for i in range(140)],
        1e-5,
        70,
        "Relative L2 error per layer (candidate vs reference)",
    )
    (fig,) = figures
    assert not _overlaps(fig), _overlaps(fig)[:5]
    assert not _inside(fig)


def test_latency_labels_clear_the_whiskers(figures):
    plots.latency_bars(
        ["input", "captured", "opswap", "compile(input)"],
        [7.4, 7.1, 2.4, 2.3],
        [3.0, 0.2, 0.9, 0.1],
        "hf:some-very-long-model-name-from-a-local-directory on "
        "cpu: Intel(R) Xeon(R) Processor, 2 threads, measured in one run",
    )
    (fig,) = figures
    assert not _overlaps(fig), _overlaps(fig)
    assert not _inside(fig)
    ax = fig.axes[0]
    r = fig.canvas.get_renderer()
    cap_px = 4 * fig.dpi / 72  # errorbar capsize=4 points
    ends = [v + s / 2 for v, s in zip([7.4, 7.1, 2.4, 2.3], [3.0, 0.2, 0.9, 0.1], strict=True)]
    assert len(ax.texts) == 4
    for i, t in enumerate(ax.texts):  # each "x.xxx ms" label starts past its own whisker's cap
        whisker_px = ax.transData.transform((ends[i], i))[0]
        box = t.get_window_extent(r)
        assert box.x0 >= whisker_px + cap_px / 2 - 1, (t.get_text(), box.x0, whisker_px)
        assert box.x1 <= ax.get_window_extent(r).x1 + 1, t.get_text()


def test_roofline_labels_do_not_collide(figures):
    pts = [(f"layers_{i}_ffn_up", 12.0 + 0.1 * i, 1e11 - 1e8 * i) for i in range(6)]
    pts += [(f"mul_{i}", 0.12, 2e7 * (1 + i)) for i in range(6)]
    plots.roofline(pts, 1.2e11, 1.3e10, "Roofline of cpu (float32), original model")
    (fig,) = figures
    assert not _overlaps(fig), _overlaps(fig)
    assert not _inside(fig)


def test_latency_axis_follows_the_bars_not_the_whiskers(figures):
    # a busy machine: one variant's IQR is ten times every median
    medians, spreads = [7.4, 7.1, 2.4], [80.0, 0.2, 0.9]
    plots.latency_bars(["input", "captured", "opswap"], medians, spreads, "busy")
    (fig,) = figures
    ax = fig.axes[0]
    assert ax.get_xlim()[1] <= 2.5 * max(medians)
    assert not _overlaps(fig), _overlaps(fig)
    assert not _inside(fig)
    r = fig.canvas.get_renderer()
    for t in ax.texts:  # every label inside the axes, the cut one saying so
        assert t.get_window_extent(r).x1 <= ax.get_window_extent(r).x1 + 1, t.get_text()
    assert [t.get_text().endswith("(IQR cut)") for t in ax.texts] == [True, False, False]
