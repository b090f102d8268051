"""The report of one `optimize` run: what changed and why, predicted next to
measured, misses with reasons, error per layer, latency, and the cost breakdown."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from opswap.bench.stats import UNSETTLED, describe_speedup
from opswap.bench.variants import UNSETTLED_MARGIN
from opswap.cost.units import human, human_unit
from opswap.report import plots
from opswap.report.advice import advised
from opswap.report.candidates import accuracy_cell, kept_text, random_check_text, saved_mark
from opswap.report.document import Block, Bullets, Heading, Image, Para, Table, to_html, to_markdown


def _f(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}g}"
    return str(x)


def _summary(result, data) -> list[Block]:
    v = data["verification"]
    b = data["benchmark"]
    verdict = "PASSED" if v["passed"] else "FAILED"
    lines = [
        f"**{len(data['applied'])}** replacement{'' if len(data['applied']) == 1 else 's'} "
        f"applied, **{len(data['misses'])}** near miss{'' if len(data['misses']) == 1 else 'es'} "
        f"reported, **{len(data['rolled_back'])}** rolled back, "
        f"**{len(data['failed'])}** failed.",
        f"Verification **{verdict}** on {v.get('samples', '?')} input "
        f"sample{'' if v.get('samples') == 1 else 's'}: cosine "
        f"{v['cosine']:.8f}, max abs error {_f(v['max_abs'])}, SQNR {_f(v['sqnr_db'])} dB, "
        f"relative L2 {_f(v['rel_l2'])} (tolerance: "
        f"{tolerance_text(result.verification.tolerance)})"
        + (f"; on your data: {result.verified_on}." if result.verified_on else "."),
    ]
    said = random_check_text(data)
    if said is not None:
        lines.append(said)
    if v.get("top1_agreement") is not None:
        lines.append(decisions_text(v))
    if data.get("accuracy"):
        lines.append(accuracy_text(data["accuracy"]))
    if data.get("timings_settled") is False:
        lines.append(unsettled_warning())
    if data.get("variants"):
        lines.append(_headline(data))
    kept = kept_text(data)
    if kept is not None:
        lines.append(kept)
    if (data.get("deploy") or {}).get("aot"):
        lines.append(aot_text(data["deploy"]["aot"]))
    if b:
        lines.append(
            f"Your model against opswap's result as saved (model.pt2, reloaded) on "
            f"{b['device']}: {b['ref_ms']:.3f} ms → {b['opt_ms']:.3f} ms, "
            f"{interval(b['speedup_of_medians'], b.get('speedup_ci'), b.get('settled'))} "
            f"(ratio of the medians of {b['rounds']} interleaved rounds in one process, with "
            "its 95% bootstrap interval)."
        )
    elif data.get("variants"):
        mine = next((v for v in data["variants"] if v["name"] == "opswap"), None)
        why = "; ".join((mine or {}).get("reasons") or []) or "it was not raced"
        lines.append(
            f"opswap's model as saved was not timed: it did not pass verification ({why})."
        )
    else:
        lines.append("Not timed (--no-bench).")
    return [Para(" ".join(lines[:1])), Bullets(lines[1:])]


_TOLERANCE_TERMS = {
    "cosine_min": "cosine>=",
    "rel_l2_max": "rel_l2<=",
    "sqnr_min_db": "sqnr_db>=",
    "max_abs": "max_abs<=",
    "max_rel": "max_rel<=",
    "centred_rel_l2_max": "centred_rel_l2<=",
    "top1_min": "top1>=",
    "top5_min": "top5>=",
}


def aot_text(aot: dict) -> str:
    """result.json's `deploy.aot` in one sentence."""
    if not aot.get("package"):
        return f"Saved without an ahead-of-time package ({aot.get('why')}): load compiles it."
    t = aot["load_to_first_call_s"]
    return (
        f"Saved compiled ahead of time as `{aot['package']}` too: from load to the first "
        f"output {t['aot']:.2f} s, against {t['compile']:.2f} s for model.pt2 through "
        "torch.compile; `opswap.load_optimized` loads the package."
    )


def decisions_text(v: dict) -> str:
    """result.json's verification figures for class-score outputs in one sentence."""
    text = (
        f"Class scores: top-1 class the same on {100 * v['top1_agreement']:.4g}% of "
        f"{v['decision_rows']} rows"
    )
    if v.get("top5_agreement") is not None:
        text += f", in the top 5 on {100 * v['top5_agreement']:.4g}%"
    if v.get("centred_rel_l2") is not None:
        text += f"; relative L2 centred per row {_f(v['centred_rel_l2'])}"
    return text + " (worst output)."


def accuracy_text(acc: dict) -> str:
    """result.json's `accuracy` in one sentence: the float model's, the saved model's, the
    change in points."""
    points = 100 * (acc["candidate"] - acc["reference"])
    return (
        f"Accuracy ({acc['metric']}) on {acc.get('description') or 'the model task'}: "
        f"{acc['reference']:.4f} for your model, {acc['candidate']:.4f} for the model saved "
        f"({points:+.2f} points)."
    )


def exact(x: float) -> str:
    """A threshold as set: the short form where it is exact, else every digit it has
    (0.9999999999 is not '1')."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


def tolerance_text(tol) -> str:
    """'cosine>=0.9999999999, rel_l2<=1e-05' from a Tolerance or its to_json()."""
    items = tol.to_json() if hasattr(tol, "to_json") else dict(tol or {})
    terms = [
        f"{_TOLERANCE_TERMS[k]}{exact(v)}"
        for k, v in items.items()
        if k in _TOLERANCE_TERMS and v is not None
    ]
    return ", ".join(terms) or "no threshold"


def interval(ratio, ci, settled: bool | None = True) -> str:
    """'1.42x [1.37-1.48]', or '0.99x [0.95-1.03], within noise' when the interval holds 1;
    for a timing that did not settle, the lower end first: 'at least 1.07x [1.07-38.37],
    median 14.48x'."""
    return describe_speedup(ratio, ci, settled)


def unsettled_warning(race: bool = True) -> str:
    """The sentence the CLI and the report print when the intervals stayed wide (`race`:
    of an optimize run, which also chose what to save)."""
    saved = (
        f", and a variant is saved only where that lower end is at least {UNSETTLED_MARGIN:.2f}x"
        if race
        else ""
    )
    return (
        f"**{UNSETTLED}**: the intervals stayed wide in the time allowed, so each figure "
        f"leads with its interval's lower end{saved}; run again on a quieter machine for "
        "figures to rely on."
    )


def _headline(data) -> str:
    """The best opswap variant against the best baseline, and what was saved."""
    timed = {v["name"]: v for v in data["variants"] if v["ms"] is not None}
    ours = [v for n, v in timed.items() if n.startswith("opswap")]
    theirs = [v for n, v in timed.items() if not n.startswith("opswap") and n != "captured"]
    mine = min(ours, key=lambda v: v["ms"]) if ours else None
    peer = min(theirs, key=lambda v: v["ms"])
    saved = data["deploy"]
    text = f"Saved: **{saved['variant']}**, {saved['holds']}."
    if mine is not None:
        ratio = peer["ms"] / mine["ms"]
        against = (
            interval(ratio, mine.get("speedup_ci"), mine.get("settled"))
            if peer["name"] == "input"
            else versus(ratio, mine, peer)
        )
        text += (
            f" Best opswap variant `{mine['name']}` {mine['ms']:.3f} ms against the best "
            f"baseline `{peer['name']}` {peer['ms']:.3f} ms: **{against}**."
        )
    if "ort" in timed and "opswap+ort" in timed:
        text += (
            f" In ONNX Runtime: opswap's export {timed['opswap+ort']['ms']:.3f} ms against "
            f"your model's export {timed['ort']['ms']:.3f} ms "
            f"({timed['ort']['ms'] / timed['opswap+ort']['ms']:.2f}x)."
        )
    if saved["variant"] == "input":
        text += " Nothing opswap made beat your model beyond the run's noise: keep it."
    return text


def versus(ratio: float, mine: dict, peer: dict) -> str:
    """opswap's best variant against another baseline than the input: the ratio of the
    medians with a bound from the two speed-ups' intervals (each against the input, so
    the bound is wider than the ratio's own interval would be): [mine low / peer high,
    mine high / peer low], led by the end it supports when the run did not settle."""
    a, b = mine.get("speedup_ci") or (None, None), peer.get("speedup_ci") or (None, None)
    if peer["name"] == "input":
        b = (1.0, 1.0)
    ends = [float(x) for x in (*a, *b) if x is not None]
    if len(ends) < 4 or any(math.isnan(x) for x in ends) or min(ends[2:]) <= 0:
        return f"{ratio:.2f}x (ratio of the medians)"
    settled = mine.get("settled") is not False and peer.get("settled") is not False
    return interval(ratio, (ends[0] / ends[3], ends[1] / ends[2]), settled)


def why_text(v: dict) -> str:
    """A variant's note, and for one that was not verified, why not (the check's reasons:
    which metric, at which shape, by how much)."""
    reasons = [r for r in v.get("reasons") or [] if r and r != v.get("note")]
    if v["verified"] or not reasons:
        return v["note"] or ""
    why = "not verified: " + "; ".join(reasons)
    return f"{v['note']}; {why}" if v.get("note") else why


def _variants(data) -> list[Block]:
    if not data.get("variants"):
        return []
    rows = []
    for v in data["variants"]:
        rows.append(
            [
                f"`{v['name']}`" + saved_mark(v["name"], data),
                _f(v["ms"]),
                _f(v["iqr_ms"]),
                "1.00x (the yardstick)"
                if v["name"] == "input"
                else interval(v["speedup_vs_input"], v.get("speedup_ci"), v.get("settled"))
                if v["speedup_vs_input"]
                else "-",
                "yes" if v["verified"] else "no",
                accuracy_cell(v.get("accuracy")),
                _f(v["compile_s"]) if v["compile_s"] is not None else "",
                why_text(v),
            ]
        )
    return [
        Heading("Variants, timed in one run"),
        Para(
            "Every way to run the model, verified against the input and timed in one "
            "interleaved loop; `captured` and `opswap` are timed as reloaded from the "
            "model.pt2 they save, `ort` and `opswap+ort` as ONNX Runtime sessions over the "
            "model.onnx they save. `vs input` is the ratio of the medians, with its 95% "
            "bootstrap interval (rounds resampled in pairs). A variant is saved only when "
            "the interval's lower end is above 1 (and at least "
            f"{UNSETTLED_MARGIN:.2f}x when the interval did not narrow to 10% of the ratio "
            "in the time allowed): otherwise your model is kept (unless `--save candidate` "
            "asked for opswap's). `accuracy` is the verification each variant was judged by: "
            "the metric that decided it (the one it broke, else the one nearest its bound), "
            "with top-1 agreement for class scores and the task's metric where there is one."
        ),
        Table(
            [
                "variant",
                "ms",
                "IQR ms",
                "vs input [95%]",
                "verified",
                "accuracy",
                "compile s",
                "note",
            ],
            rows,
            align_right={1, 2, 3, 6},
        ),
    ]


def _changes(result) -> list[Block]:
    blocks: list[Block] = [Heading("What changed and why")]
    if not result.plan.decisions:
        return blocks + [Para("No rule applied to this model (see the near misses below).")]
    from opswap.rules import registry

    applied = {s.key for s in result.applied}
    tuning = result.plan.tuning or {}
    tuned = {(t["rule"], t["key"]): _tuning_cell(t) for t in tuning.get("sites", [])}
    rows = []
    for i, d in enumerate(result.plan.decisions):
        rule = registry.get(d.rule)
        e = d.estimate
        rows.append(
            [
                str(i),
                f"`{d.rule}`",
                (f"`{d.module}`: " if d.module else "") + f"`{d.site.key}`",
                d.site.description,
                rule.exactness,
                # one cell, so that the table fits a 1280 px page beside the descriptions
                f"{human_unit(e.bytes_saved, 'B')}, {human_unit(e.flops_saved, 'FLOP')}, "
                + (_f(e.time_saved_s * 1e6) + " µs" if e.time_saved_s is not None else "- µs"),
                "yes" if d.site.key in applied else "no",
                tuned.get((d.rule, d.site.key), "-"),
            ]
        )
    blocks.append(
        Table(
            [
                "#",
                "rule",
                "module: site",
                "what",
                "exactness",
                "predicted saving (bytes, FLOPs, time)",
                "applied",
                "tuning db",
            ],
            rows,
            align_right={0, 5},
        )
    )
    return blocks + _tuning(tuning)


def _search(found: dict[str, Any] | None) -> list[Block]:
    """The joint search's front (tuning.search): a plot, and a table of the front's plans
    with greedy's and the chosen one."""
    if not found:
        return []
    g, c = found["greedy"], found["chosen"]
    said = (
        f"The joint search measured {found['evaluations']} whole plan(s) in "
        f"{found['seconds']:.1f} s: greedy's plan {g['latency_ms']:.3f} ms, the chosen "
        f"{c['latency_ms']:.3f} ms ({found['speedup_over_greedy']:.2f}x), error "
        f"{c['error']:.2e}. "
        + (
            f"No plan beat greedy's by more than {found['noise']:.0%} within the budget, "
            "so greedy's plan is kept."
            if found["kept_greedy"]
            else "The budget picked the fastest plan within it."
        )
    )
    rows = [
        [
            str(p["index"]),
            p["how"],
            f"`{p['choices']}`",
            str(p["decisions"]),
            f"{p['latency_ms']:.3f}",
            f"{p['error']:.2e}",
            "yes" if p["within_budget"] else "no",
            ("chosen" if p.get("chosen") else "") + (" greedy" if p["how"] == "greedy" else ""),
        ]
        for p in found["points"]
        if p["on_front"] or p.get("chosen") or p["how"] == "greedy"
    ]
    png = plots.pareto_front(found["points"], "Joint search: latency against error")
    return [
        Heading("Joint search"),
        Para(said),
        Image("pareto_front.png", png, "Every plan measured; the step line is the front."),
        Table(
            ["#", "how", "choices", "decisions", "ms", "error", "in budget", ""],
            rows,
            align_right={0, 3, 4, 5},
        ),
    ]


def _tuning_cell(site: dict[str, Any]) -> str:
    """A timed site's outcome in the tuning database: hit, miss, or near (the shapes used)."""
    out = str(site.get("outcome", ""))
    if out == "near":
        out += " (" + " ".join("x".join(map(str, s)) for s in site.get("near_shapes", [])) + ")"
    if site.get("pruned"):
        out += f"; not timed: {', '.join(site['pruned'])}"
    return out


def _tuning(tuning: dict[str, Any]) -> list[Block]:
    """One line per site timed through the tuning database, and the totals."""
    sites = tuning.get("sites", [])
    if not sites:
        return []
    return [
        Para(
            f"Tuning database `{tuning['db']}`: {tuning['hits']} hit(s), {tuning['near']} "
            f"near, {tuning['misses']} miss(es); {tuning['timings_made']} site timing(s) "
            "made. Sites timed:"
        ),
        Bullets([f"`{s['rule']}` at `{s['key']}`: {_tuning_cell(s)}" for s in sites]),
    ]


def _raced(result) -> list[Block]:
    """Sites a rule chose by racing candidates on the target (conv.algorithm): each
    candidate's roofline prediction next to its measured time."""
    rows = []
    for d in result.plan.decisions:
        e = d.estimate
        for name in sorted(e.measured_s, key=lambda n: e.measured_s[n]):
            predicted = e.predicted_s.get(name)
            rows.append(
                [
                    f"`{d.site.key}`",
                    name,
                    _f(predicted * 1e3) if predicted is not None else "-",
                    _f(e.measured_s[name] * 1e3),
                ]
            )
    if not rows:
        return []
    return [
        Heading("Raced sites: roofline against measured", 3),
        Para(
            "Every candidate timed at the site's shapes on the target; the site runs the "
            "fastest (its key names it), PyTorch's conv where none beat it."
        ),
        Table(["site", "candidate", "roofline (ms)", "measured (ms)"], rows, align_right={2, 3}),
    ]


def _predicted_vs_measured(result, data) -> list[Block]:
    before, after = result.analysis_before, result.analysis_after
    blocks: list[Block] = [Heading("Predicted next to measured")]
    saved = sum(d.estimate.time_saved_s or 0.0 for d in result.plan.decisions)
    rows = [
        [
            "roofline estimate of the whole model",
            f"{before.est_time_s * 1e3:.4f} ms",
            f"{after.est_time_s * 1e3:.4f} ms",
            f"{before.est_time_s / after.est_time_s:.2f}x" if after.est_time_s else "-",
        ],
        [
            "sum of the sites' predicted savings",
            "",
            f"saves {saved * 1e3:.4f} ms",
            f"{before.est_time_s / max(before.est_time_s - saved, 1e-12):.2f}x"
            if before.est_time_s
            else "-",
        ],
        [
            "bytes moved (unfused, per op)",
            human_unit(before.total_bytes, "B"),
            human_unit(after.total_bytes, "B"),
            "",
        ],
        ["FLOPs", human(before.total_flops), human(after.total_flops), ""],
    ]
    b = data["benchmark"]
    if b:
        rows.append(
            [
                "measured latency (median)",
                f"{b['ref_ms']:.4f} ms",
                f"{b['opt_ms']:.4f} ms",
                interval(b["speedup_of_medians"], b.get("speedup_ci"), b.get("settled")),
            ]
        )
        if before.est_time_s and after.est_time_s:
            rows.append(
                [
                    "measured / roofline estimate (how far to trust it)",
                    f"{b['ref_ms'] / (before.est_time_s * 1e3):.1f}x",
                    f"{b['opt_ms'] / (after.est_time_s * 1e3):.1f}x",
                    "",
                ]
            )
    blocks.append(Table(["", "before", "after", "speedup"], rows, align_right={1, 2, 3}))
    blocks.append(
        Para(
            "The roofline estimate assumes every op runs alone at the target's peak FLOP/s or "
            f"bandwidth, plus {before.target.dispatch_s * 1e6:.1f} µs of dispatch per op "
            "(measured on this machine for the CPU target); it cannot see Python overheads, "
            "cache effects or which kernel a library picks, so the measured figure is the one "
            "that counts, and the row above says how far the estimate is from it. Where the two "
            "disagree in sign, the replacement does not pay on this device."
        )
    )
    att = result.attribution
    if att is not None and att.rules:
        blocks += _attribution(att)
    if b:
        bench = result.benchmark
        spreads = [
            getattr(bench, "ref_iqr_ms", 0.0) or 0.0,
            getattr(bench, "opt_iqr_ms", 0.0) or 0.0,
        ]
        timed = [v for v in data.get("variants", []) if v["ms"] is not None]
        if timed:
            names = [v["name"] for v in timed]
            ms, spreads = [v["ms"] for v in timed], [v["iqr_ms"] or 0.0 for v in timed]
        else:
            names, ms = ["input", "opswap"], [b["ref_ms"], b["opt_ms"]]
        png = plots.latency_bars(names, ms, spreads, f"{result.model} on {b['device']}")
        blocks.append(
            Image(
                "latency.png",
                png,
                "Latency of each variant (median, IQR), timed in one interleaved run.",
            )
        )
    return blocks


def _ms(x, ci=None) -> str:
    """'0.1234 ms [0.1100-0.1400]'; a saving whose interval holds zero leads with that:
    'within noise [-46.2600-1.8600] ms, median 0.5251 ms'."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if ci is None or ci[0] is None or math.isnan(ci[0]) or math.isnan(ci[1]):
        return f"{x:.4f} ms"
    if ci[0] <= 0 <= ci[1]:
        return f"within noise [{ci[0]:.4f}-{ci[1]:.4f}] ms, median {x:.4f} ms"
    return f"{x:.4f} ms [{ci[0]:.4f}-{ci[1]:.4f}]"


def _pays(t) -> str:
    """A rule's verdict, where its leave-one-out interval and its measured saving agree:
    'yes' only for a saving above zero whose interval excludes no gain."""
    if t.verdict == "slower":
        return "**no**: slower with it"
    saved = t.loo_saved_s if t.pruned else t.measured_saved_s
    if t.verdict == "pays" and saved is not None and saved > 0:
        return "yes"
    return "within noise"


def _attribution(att) -> list[Block]:
    """Each rule's share of the total saving with its interval, on the race's scale (see
    bench.attribution), beside its leave-one-out ratio and verdict."""
    source = (
        "the race: `captured` against `opswap`, timed in the run that picked what is saved"
        if att.source == "race"
        else "the leave-one-out run: no rule against all of them"
    )
    blocks: list[Block] = [
        Heading("What each rule is worth, measured", 3),
        Para(
            f"Method: {att.method}. The total comes from {source}; the model's own time there "
            f"is {_ms(att.model_ms)}, which no saving can exceed. Device: {att.device}."
            + (f" Note: {att.note}." if att.note else "")
        ),
    ]
    rows = []
    for t in att.rules:
        loo_ci = (
            ((t.ci_low - 1) * t.with_ms, (t.ci_high - 1) * t.with_ms)
            if t.ci_low is not None and t.ci_high is not None
            else None
        )
        if t.pruned:
            saving = f"pruned: {_ms(t.loo_saved_s * 1e3, loo_ci)} in the leave-one-out run"
        else:
            saving = _ms(t.measured_saved_s * 1e3, t.share_ci_ms)
        ratio = "-"
        if t.predicted_saved_s and not t.pruned:
            ratio = f"{t.measured_saved_s / t.predicted_saved_s:.1f}x" + (
                " (within noise)" if t.verdict == "within noise" else ""
            )
        rows.append(
            [
                f"`{t.rule}`",
                str(t.sites),
                f"{t.predicted_saved_s * 1e3:.4f} ms",
                saving,
                ratio,
                interval(t.without_ms / t.with_ms, (t.ci_low, t.ci_high)),
                _pays(t),
            ]
        )
    kept = [t for t in att.rules if not t.pruned]
    predicted = sum(t.predicted_saved_s for t in kept)
    rows.append(
        [
            "sum of the rules",
            "",
            f"{predicted * 1e3:.4f} ms",
            _ms(att.sum_saved_ms, att.total_ci_ms),
            "",
            "",
            "",
        ]
    )
    rows.append(
        [
            "all rules together"
            + (" (the race: captured → opswap)" if att.source == "race" else " (no rule → all)"),
            "",
            "",
            _ms(att.total_saved_ms, att.total_ci_ms),
            "",
            interval(att.ratio, att.ratio_ci),
            "",
        ]
    )
    blocks.append(
        Table(
            [
                "rule",
                "sites",
                "predicted saving",
                "measured saving [95%]",
                "measured / predicted",
                "leave-one-out: without it / with it [95%]",
                "pays here",
            ],
            rows,
            align_right={1, 2, 3, 4, 5},
        )
    )
    return blocks


def _misses(result) -> list[Block]:
    blocks: list[Block] = [Heading("Near misses")]
    if not result.plan.misses:
        return blocks + [
            Para("None: every place a rule looked at either matched or was not close.")
        ]
    rows = [[f"`{m.rule}`", f"`{m.where}`", m.reason] for m in result.plan.misses]
    return blocks + [
        Para("Places where a rule nearly applied, and why it did not."),
        Table(["rule", "where", "why not"], rows),
    ]


def _problems(result) -> list[Block]:
    items = [f"failed: `{f.rule}` at `{f.where}`: {f.reason}" for f in result.failed]
    items += [
        f"rolled back: `{r.decision.rule}` at `{r.decision.site.key}`: {r.reason}"
        for r in result.rolled_back
    ]
    items += [
        f"skipped: `{s.rule}` at `{s.where}`: {s.reason}"
        for s in result.plan.skipped
        if not s.reason.startswith("rolled back")
    ]  # listed above already
    if not items:
        return []
    return [Heading("Failed, rolled back, skipped"), Bullets(items)]


def _verification(result) -> list[Block]:
    v = result.verification
    rows = [
        [
            f"`{o.name}`",
            _f(o.metrics.max_abs),
            _f(o.metrics.max_rel),
            f"{o.metrics.cosine:.8f}",
            _f(o.metrics.sqnr_db),
            _f(o.metrics.rel_l2),
            _centred(o.decisions),
            _top1(o.decisions),
            "PASSED" if o.passed else "FAILED",
        ]
        for o in v.outputs
    ]
    shapes = ", ".join(v.shapes) or "the example shape only"
    ran_on = (
        f"{v.samples} input sample{'' if v.samples == 1 else 's'} (the example, fresh "
        f"random inputs of the same shapes, "
        f"and one sample at each other shape the model is claimed at: {shapes})"
    )
    if result.verified_on:  # calibration data given: the verdict is reached on it
        ran_on = (
            f"{v.samples} input samples of your data ({result.verified_on}; then random "
            "inputs drawn like it and held inside the range it takes, at its shapes and at "
            f"each other shape the model is claimed at: {shapes})"
        )
    blocks: list[Block] = [
        Heading("Verification"),
        Para(
            f"Reference (the model as given, not its capture) and candidate ran on {ran_on}; "
            f"worst case over samples. Tolerance: {tolerance_text(v.tolerance)}."
        ),
        Para(
            "Dynamic sizes (the saved model runs at any of them): "
            + (result.dynamic.describe() if result.dynamic is not None else "not recorded")
            + "."
        ),
        Table(
            [
                "output",
                "max abs",
                "max rel",
                "cosine",
                "SQNR dB",
                "rel L2",
                "centred rel L2",
                "top-1 same (rows)",
                "verdict",
            ],
            rows,
            align_right={1, 2, 3, 4, 5, 6, 7},
        ),
    ]
    judged = [o for o in v.outputs if o.decisions is not None]
    if judged:
        blocks.append(
            Para(
                "Class scores ("
                + "; ".join(f"`{o.name}`: {o.decisions.scores.why}" for o in judged)
                + "): compared centred per row where a common offset carries no information, "
                "and by the rows whose top-1 class changes (or leaves the top 5), on "
                "more rows than the samples where the tolerance lets some change."
            )
        )
    if v.reasons:
        blocks.append(Bullets(list(v.reasons)))
    said = random_check_text(result.to_json()) if result.random_check is not None else None
    if said is not None:
        blocks.append(Para(said))
    if result.accuracy is not None:
        blocks.append(Para(accuracy_text(result.accuracy.to_json())))
    blocks += _sparsity(result.sparsity)
    return blocks


def _sparsity(curve: dict | None) -> list[Block]:
    """Where a sparsity rule ran on a model with a task: its metric against sparsity."""
    if not curve or not curve.get("points"):
        return []
    rows = [
        [p["method"], f"{100 * p['sparsity']:.1f}%", f"{p['accuracy']:.4f}"]
        for p in curve["points"]
    ]
    title = f"Accuracy against sparsity: {curve['model']}"
    png = plots.sparsity_curve(curve["points"], curve["reference"], curve["metric"], title)
    return [
        Para(
            f"Accuracy ({curve['metric']}) against sparsity, the Linear weights pruned as the "
            f"sparsity rules that ran prune them, not fine-tuned ({curve['reference']:.4f} "
            "unpruned; opswap.train.finetune_sparse fine-tunes with the zeros kept):"
        ),
        Table(["method", "weights dropped", curve["metric"]], rows, align_right={1, 2}),
        Image("sparsity_curve.png", png, "Accuracy against the share of weights dropped."),
    ]


def _centred(judged) -> str:
    mc = judged.centred_metrics if judged is not None else None
    return _f(mc.rel_l2) if mc is not None else "-"


def _top1(judged) -> str:
    if judged is None:
        return "-"
    return f"{100 * judged.top1.agreement:.4g}% ({judged.top1.rows})"


def _layers(result) -> list[Block]:
    lr = result.layers
    rows = [r for r in (lr.rows if lr is not None else []) if r.metrics is not None]
    if not rows:
        return []
    tol = result.verification.tolerance
    first = lr.first_divergence(tol)
    names = [r.name for r in rows]
    errs = [r.metrics.rel_l2 for r in rows]
    first_idx = (
        names.index(first.row.name) if first is not None and first.row.name in names else None
    )
    png = plots.layer_errors(
        names,
        errs,
        getattr(tol, "rel_l2_max", None),
        first_idx,
        "Relative L2 error per layer (candidate vs reference)",
    )
    blocks: list[Block] = [
        Heading("Error layer by layer"),
        Image(
            "layer_errors.png",
            png,
            "Error of each layer's output, in "
            "execution order; layers are paired by node name, consumer and "
            "module path.",
        ),
    ]
    if first is not None:
        blocks.append(Para(f"First divergence: {first}."))
    else:
        blocks.append(
            Para("No layer exceeds the tolerance or jumps 10x over the layers before it.")
        )
    unpaired = len(lr.rows) - len(rows)
    if unpaired:
        blocks.append(
            Para(
                f"{unpaired} reference nodes have no counterpart in the candidate "
                "(removed by a rewrite) and are not compared on their own."
            )
        )
    # only layers that differ at all: eight exact embedding rows say nothing
    differing = [r for r in rows if not (r.metrics.max_abs == 0 and r.metrics.rel_l2 == 0)]
    if not differing:
        blocks.append(Para(f"All {len(rows)} compared layers match exactly."))
        return blocks
    worst = sorted(
        differing, key=lambda r: -(r.metrics.rel_l2 if math.isfinite(r.metrics.rel_l2) else 1e30)
    )[:8]
    blocks.append(
        Table(
            ["layer", "module", "paired by", "max abs", "cosine", "rel L2"],
            [
                [
                    f"`{r.name}`",
                    r.module or "",
                    r.paired_by,
                    _f(r.metrics.max_abs),
                    f"{r.metrics.cosine:.8f}",
                    _f(r.metrics.rel_l2),
                ]
                for r in worst
            ],
            align_right={3, 4, 5},
        )
    )
    return blocks


def _analysis(result) -> list[Block]:
    before, after = result.analysis_before, result.analysis_after
    cats = sorted(
        set(before.categories) | set(after.categories),
        key=lambda c: -max(_cat_time(before, c), _cat_time(after, c)),
    )
    tb = [_cat_time(before, c) for c in cats]
    ta = [_cat_time(after, c) for c in cats]
    blocks: list[Block] = [Heading("Where the time goes (cost model)")]
    blocks.append(
        Image(
            "categories.png",
            plots.category_time(cats, tb, ta, "Estimated time per op category"),
            f"Roofline estimate per category on {result.target}, before and after.",
        )
    )
    sentences = advised(before).bottlenecks(5)
    if sentences:
        blocks.append(Para("Top bottlenecks of the original model:"))
        blocks.append(Bullets(sentences))
    tgt = before.target
    dtype = "float32"
    pts = [
        (r.name, r.intensity, r.flops / r.est_time_s if r.est_time_s else 0.0)
        for r in before.rows
        if r.flops > 0 and r.est_time_s
    ]
    if pts:
        blocks.append(
            Image(
                "roofline.png",
                plots.roofline(
                    pts,
                    tgt.peak(dtype),
                    tgt.mem_bandwidth,
                    f"Roofline of {tgt.name} (float32), original model",
                ),
                "Each op at its arithmetic intensity and roofline-attainable FLOP/s.",
            )
        )
    return blocks


def _cat_time(analysis, cat: str) -> float:
    c = analysis.categories.get(cat)
    if c is None:
        return 0.0
    return c["est_time_s"] if isinstance(c, dict) else getattr(c, "est_time_s", 0.0)


def _environment(result, data) -> list[Block]:
    vers = data["versions"]
    run = data.get("run") or {}
    items = [
        f"opswap {vers['opswap']}, torch {vers['torch']}, Python {vers['python']}",
        f"capture: {data['capture_method']}",
        "inputs: "
        + (
            ", ".join(
                f"{i['name']} {i['dtype']} {tuple(i['shape'])}" for i in run.get("inputs", [])
            )
            or "not recorded"
        ),
        f"timed on: {run.get('device', '?')}, {run.get('threads', '?')} CPU threads",
        "model settings (defaults and --set): "
        + (", ".join(f"{k}={v}" for k, v in (run.get("model_settings") or {}).items()) or "none"),
        f"settings: rules {data['settings']['rules'] or 'all'}, exactness "
        f"{data['settings']['exactness']}, budget {data['settings']['budget'] or 'default'}",
        f"created {data['created']}",
    ]
    items += [f"note: {n}" for n in result.notes]
    return [Heading("Environment"), Bullets(items)]


def build_report(result) -> list[Block]:
    data = result.to_json()
    blocks: list[Block] = [Heading(f"opswap report: {result.model} on {result.target}", 1)]
    blocks += _summary(result, data)
    blocks += _variants(data)
    blocks += _changes(result)
    blocks += _search(result.plan.search)
    blocks += _raced(result)
    blocks += _predicted_vs_measured(result, data)
    blocks += _misses(result)
    blocks += _problems(result)
    blocks += _verification(result)
    blocks += _layers(result)
    blocks += _analysis(result)
    blocks += _environment(result, data)
    return blocks


def write_reports(result, out: str | Path) -> dict[str, Path]:
    """Write report.md (+ its PNG files) and the self-contained report.html into `out`."""
    out = Path(out)
    blocks = build_report(result)
    md, files = to_markdown(blocks)
    for name, png in files.items():
        (out / name).write_bytes(png)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(to_html(blocks, f"opswap: {result.model}"))
    return {"report_md": out / "report.md", "report_html": out / "report.html"}
