"""What the commands print: tables and lines of text, from the values opswap.api returns
(or their JSON). Every cell and line that holds a name, a site or a reason is Text, not
markup: square brackets in them ("[torch.float16]") must print as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from opswap.cli import consoles
from opswap.verify.metrics import RESOLUTION_NOTE, shown, within_resolution


def n(count: int, singular: str, plural: str | None = None) -> str:
    """'1 replacement', '3 replacements'."""
    return f"{count} {singular if count == 1 else plural or singular + 's'}"


def note(text: str, label: str = "note", style: str = "yellow") -> None:
    """One line `label: text`, the text printed as written (no rich markup)."""
    consoles.console.print(Text.assemble((f"{label}:", style), " ", str(text)), soft_wrap=True)


def line(text: str, style: str | None = None) -> None:
    """One line printed as written, never broken by rich (a path in it stays whole to copy;
    the terminal wraps what is wider than it)."""
    consoles.console.print(Text(text, style=style or ""), soft_wrap=True)


def write_json(path: Path | None, data) -> None:
    """Write `data` to --json's path, if one was given, and say so."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    line(f"wrote {path}", "dim")


def rules(rows: list[dict], wide: bool) -> None:
    """The rules as a table of first sentences, or (wide) each described whole."""
    console = consoles.console
    if wide:
        for r in rows:
            where = f", from {r['origin']}" if r["origin"] != "opswap" else ""
            console.print(
                Text.assemble(
                    (r["name"], "bold"),
                    f"  ({r['family']}, ch. {r['chapter']}, "
                    f"{r['exactness']}, targets {','.join(r['targets'])}{where})",
                )
            )
            console.print(Padding(Text(" ".join(r["description"].split())), (0, 0, 1, 4)))
        return
    table = Table(title=n(len(rows), "rule"))
    # on a narrow terminal the family (the name's first part) gives its room to the text
    cols: tuple[str, ...] = ("name", "family", "ch.", "exactness", "targets", "what it does")
    if console.width < 120:
        cols = tuple(c for c in cols if c != "family")
    if any(r["origin"] != "opswap" for r in rows):
        cols += ("from",)
    for col in cols:
        table.add_column(col, overflow="fold", no_wrap=col == "name")
    cut = False
    for r in rows:
        first = _first_sentence(r["description"])
        cut |= first != " ".join(r["description"].split())
        cells = {
            "name": Text(r["name"]),
            "family": r["family"],
            "ch.": str(r["chapter"]),
            "exactness": r["exactness"],
            "targets": ",".join(r["targets"]),
            "what it does": Text(first),
            "from": Text(r["origin"]),
        }
        table.add_row(*(cells[c] for c in cols))
    console.print(table)
    if cut:
        console.print(
            "descriptions stop at their first sentence; `opswap rules --wide` prints them whole",
            style="dim",
            markup=False,
        )


def _first_sentence(text: str) -> str:
    words = " ".join(text.split())
    m = re.search(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.\s(?=[A-Z(])", words)
    return words[: m.start() + 1] + " ..." if m else words


def models(data: dict) -> None:
    """The zoo and the Hugging Face kinds, from api.list_models()."""
    table = Table(title="zoo: (built-in reference models)")
    table.add_column("spec")
    table.add_column("chapters")
    table.add_column("what it holds", overflow="fold")
    for z in data["zoo"]:
        table.add_row(f"zoo:{z['name']}", ",".join(map(str, z["chapters"])), z["description"])
    consoles.console.print(table)
    hf = Table(title="hf: (Hugging Face types checked end to end; small configs, random weights)")
    hf.add_column("kind")
    hf.add_column("specs", overflow="fold")
    for kind in ("encoder", "decoder", "encoder-decoder", "vision", "vision-text"):
        names = [t for t, k in data["hf_kinds"].items() if k == kind]
        if names:
            hf.add_row(kind, ", ".join(f"hf:{t}" for t in names))
    consoles.console.print(hf)
    consoles.console.print(
        "Any other type transformers knows is tried the same way; --set size=full "
        "builds its default sizes, --set mask=none drops the padded attention mask."
    )


def plan(p) -> None:
    """The decisions, the near misses, and the failed and skipped sites of a Plan."""
    from opswap.cost.units import human, human_unit

    table = Table(title="plan: " + n(len(p.decisions), "replacement"))
    for col in ("#", "rule", "module", "site", "what", "pred. bytes saved", "pred. FLOPs saved"):
        table.add_column(col, overflow="fold")
    for i, d in enumerate(p.decisions):
        table.add_row(
            str(i),
            Text(d.rule),
            Text(d.module or "-"),
            Text(d.site.key),
            Text(d.site.description),
            human_unit(d.estimate.bytes_saved, "B"),
            human(d.estimate.flops_saved),
        )
    consoles.console.print(table)
    if p.misses:
        mt = Table(title=n(len(p.misses), "near miss", "near misses"))
        for col in ("rule", "where", "why not"):
            mt.add_column(col, overflow="fold")
        for m in p.misses:
            mt.add_row(Text(m.rule), Text(m.where), Text(m.reason))
        consoles.console.print(mt)
    for f in p.failed:
        note(f"{f.rule} at {f.where}: {f.reason}", "failed", "red")
    for line in skipped_lines(p.skipped):
        note(line, "skipped")


def skipped_lines(skipped) -> list[str]:
    """One line per rule and reason: sites skipped for the same reason are counted, not
    listed (a Triton rule skipped on a CPU at every LayerNorm: one line)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for s in skipped:
        groups.setdefault((s.rule, s.reason), []).append(s.where)
    out = []
    for (rule, reason), where in groups.items():
        at = where[0] if len(where) == 1 else f"{len(where)} sites ({where[0]}, ...)"
        out.append(f"{rule} at {at}: {reason}")
    return out


def not_applied(applied) -> None:
    """One line per decision of a replayed plan that could not be applied."""
    for f in applied.failed:
        note(f"{f.rule} at {f.where}: {f.reason}", "not applied", "red")


def partial(p, applied, done: str) -> None:
    """The line that goes with exit status 1 when part of a plan did not apply; `done` says
    what the command did with the rest ('{n}' stands for their number)."""
    if applied.failed:
        rest = done.format(n=len(applied.applied))
        note(
            f"{len(applied.failed)} of {n(len(p.decisions), 'decision')} could not be "
            f"applied (listed above); {rest}; exit status 1.",
            "partial plan",
            "red",
        )


def inputs(module) -> None:
    """Say which positional order a model given keyword inputs is captured in."""
    from opswap.graph.keywords import KeywordCall

    if isinstance(module, KeywordCall):
        note(
            "the model takes keyword inputs; the optimized model " + module.describe(),
            "inputs",
            "cyan",
        )


def verification(check, budget: str | None, samples: int) -> None:
    """An api.PlanCheck: the metrics, the tolerance and where it came from, the samples,
    the reasons of a failure and the first layer that diverges."""
    v, data = check.verification, check.verification.to_json()
    cols = ("max_abs", "max_rel", "cosine", "sqnr_db", "rel_l2")
    table = Table(title="verification " + ("PASSED" if v.passed else "FAILED"))
    for col in cols:
        table.add_column(col, justify="right")
    table.add_row(*(shown(data, c, ".3g") for c in cols))
    consoles.console.print(table)
    if within_resolution(data):
        line(RESOLUTION_NOTE)
    if data.get("top1_agreement") is not None:
        line(decisions_text(data))
    source = f"budget {budget} over the" if budget else "the"
    line(
        f"tolerance: {tolerance_text(data['tolerance'])} ({source} "
        f"{check.replay.plan.settings.exactness} defaults); {_samples_text(v, samples)}"
    )
    for r in getattr(v, "reasons", []):
        line(str(r), "red")
    if check.first_divergence is not None:
        line(f"first divergence: {check.first_divergence}")


#: rows of the runtime's layer table shown when none diverges (else up to 3 past the first)
_LAYER_ROWS = 40


def runtime_layers(check, backend: str) -> None:
    """An api.PlanCheck's comparison inside the runtime, when it was made: what it
    compares, its table up to a little past the first divergence, and that divergence."""
    report = check.runtime_layers
    if report is None:
        return
    if isinstance(report, str):
        note(report)
        return
    from opswap.backends.runtime_layers import NOTE

    compared = sum(r.metrics is not None for r in report.rows)
    first = check.runtime_divergence
    if backend == "pytorch":
        line(
            f"layer by layer in PyTorch: {n(compared, 'value')} of the plan's graph compared "
            "with the same node of your model's capture; "
            f"{n(len(report.only_in_reference), 'node')} of the capture rewritten away"
        )
    else:
        line(
            f"{backend} layer by layer: {n(compared, 'value')} compared ({NOTE}); "
            f"{n(len(report.only_in_reference), 'node')} of the graph not in the file"
        )
    shown = [i for i, r in enumerate(report.rows) if r.metrics is not None]
    upto = _LAYER_ROWS if first is None else shown.index(first.index) + 4
    # the nodes not in the file are counted above, not listed (hundreds in a large model)
    table = report.table(max_rows=upto, mark=first, unpaired=False)
    consoles.console.print(Text(table), soft_wrap=True)
    if first is None:
        line(f"no value in {backend} breaks the tolerance or jumps past the ones before it")
    else:
        line(f"first divergence in {backend}: {first}", "red")


def runtime_layers_json(check) -> dict | str:
    """The runtime's layer comparison for --json: its rows and first divergence, or the
    sentence why there is none."""
    report = check.runtime_layers
    if isinstance(report, str):
        return report
    data = report.to_json()
    first = check.runtime_divergence
    data["first_divergence"] = first.to_json() if first is not None else None
    return data


def _samples_text(v, asked: int) -> str:
    """'5 samples: 3 at the example shape 2x3x32x32, one at each of batch 1, batch 3'."""
    first, others = (v.shapes[0], v.shapes[1:]) if v.shapes else ("example shape", [])
    text = f"{n(v.samples, 'sample')}: {asked} at the {first}"
    return text + (f", one at each of {', '.join(others)}" if others else "")


def decisions_text(data: dict) -> str:
    """Verification.to_json()'s figures for class-score outputs, in one sentence."""
    from opswap.report.optimize_report import decisions_text

    return decisions_text(data)


def tolerance_text(tol: dict) -> str:
    """'cosine>=0.99999, rel_l2<=1e-05, sqnr_db>=100' from Tolerance.to_json(), every
    threshold as set (0.9999999999 stays that, not a rounded 1)."""
    from opswap.report.optimize_report import tolerance_text

    return tolerance_text(tol)


def bench(data: dict) -> None:
    """One ModelBench.to_json() as a line: both times, the speed-up and its interval."""
    from opswap.report.optimize_report import interval

    line(
        f"reference {data['ref_ms']:.3f} ms (IQR {data['ref_iqr_ms']:.3f}), optimized "
        f"{data['opt_ms']:.3f} ms (IQR {data['opt_iqr_ms']:.3f}), speedup "
        f"{interval(data['speedup_of_medians'], data['speedup_ci'], data['settled'])} "
        f"(ratio of the medians, 95% interval; IQR of the per-round ratios "
        f"{data['spread']:.2f}), {n(data['rounds'], 'interleaved round')} on "
        f"{data['device']}"
    )
    if data["settled"] is False:
        unsettled(race=False)


def unsettled(race: bool = True) -> None:
    """The warning for timings whose intervals stayed wide (a busy machine)."""
    from opswap.report.optimize_report import unsettled_warning

    note(unsettled_warning(race).replace("**", ""), "warning", "red")
