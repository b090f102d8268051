"""Plans: which rule to apply where, chosen by running the rules on a scratch copy.

`make_plan` simulates: rules run in order (chapter order, `late` rules last) on a
private copy of the graph, each applying every site it matches that does not
overlap a site already taken, so opportunities one rewrite creates (MatMul+Add
becoming a Linear that then merges with its siblings) are found too. The plan
records the decisions in that order; `apply_plan` replays them on any fresh
capture of the same model. Plans serialise to JSON for review and editing.

A plan with static int8 decisions also holds their calibration (graph.calibrate's
CalibrationRecord, and each site's scale in its data), so that replaying it needs no
samples: `calibrate_replay` gives a fresh capture either new samples or, when the weights
are those the plan was made with, the plan's own scales, and otherwise refuses in one
sentence naming --calibration.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx

from opswap.errors import CalibrationError, PlanError
from opswap.graph.calibrate import (
    Calibration,
    CalibrationRecord,
    StoredScales,
    attach,
    attach_stored,
    calibration_of,
)
from opswap.graph.capture import Captured, copy_module
from opswap.graph.observers import QParams
from opswap.rules import registry
from opswap.rules.apply import Applied, Redo, Run, apply_sites
from opswap.rules.base import (
    EXACTNESS_ORDER,
    Estimate,
    Failure,
    Miss,
    Rule,
    Site,
    Skipped,
    misses_of,
    sites_of,
)
from opswap.rules.order import ordered
from opswap.targets.base import Target
from opswap.tuning import site_scope

PLAN_VERSION = 1
#: the rules whose sites quantise activations with scales calibration fixed
CALIBRATED_RULES = frozenset({"precision.int8_static_linear", "precision.int8_static_conv"})


@dataclass
class PlanSettings:
    """What a plan was made with; kept in plan.json so it can be reproduced."""

    target: str = "cpu"
    rules: list[str] = field(default_factory=list)  # glob patterns; empty = all
    exactness: str = "exact"


@dataclass
class Decision:
    """Apply `rule` at `site`; `estimate` is the cost model's prediction for it."""

    rule: str
    site: Site
    estimate: Estimate = field(default_factory=Estimate)
    module: str = ""  # the module path the site lies in (model.encoder.layer.0.attention)

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "site": self.site.to_json(),
            "estimate": self.estimate.to_json(),
            "module": self.module,
        }


@dataclass
class Plan:
    model: str
    settings: PlanSettings
    decisions: list[Decision] = field(default_factory=list)
    misses: list[Miss] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)  # not worth it, with why
    capture_method: str = ""
    fingerprint: str = ""  # of the graph it was made on (graph_fingerprint); "" = unchecked
    notes: list[str] = field(default_factory=list)  # what the settings could not give
    #: how the static int8 decisions' scales were calibrated; None when there are none
    calibration: CalibrationRecord | None = None
    #: what the tuning database gave the run's timed sites (TunedTimer.summary); None: no
    #: site was timed through one
    tuning: dict[str, Any] | None = None
    #: the joint search that chose this plan (tuning.search.SearchResult.to_json); None:
    #: the greedy planner's
    search: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "model": self.model,
            "capture_method": self.capture_method,
            "fingerprint": self.fingerprint,
            "settings": asdict(self.settings),
            "decisions": [d.to_json() for d in self.decisions],
            "misses": [m.to_json() for m in self.misses],
            "failed": [f.to_json() for f in self.failed],
            "skipped": [s.to_json() for s in self.skipped],
            "notes": self.notes,
            # only a plan with static int8 decisions has one
            **({"calibration": self.calibration.to_json()} if self.calibration else {}),
            **({"tuning": self.tuning} if self.tuning else {}),
            **({"search": self.search} if self.search else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """The one way in for plan.json data: checked field by field, so a hand edit gone
        wrong fails here with the field's name, not later inside a rule."""
        _check_plan(data)
        try:
            decisions = []
            for d in data["decisions"]:
                s, rule = d["site"], registry.current_name(d["rule"])  # a renamed rule's new name
                site = Site(
                    rule,
                    s["key"],
                    tuple(s.get("nodes", ())),
                    s.get("description", ""),
                    s.get("data", {}),
                    s.get("anchor", ""),
                )
                decisions.append(
                    Decision(
                        rule, site, Estimate(**d.get("estimate", {})), str(d.get("module", ""))
                    )
                )
            return cls(
                model=data.get("model", ""),
                settings=PlanSettings(**data.get("settings", {})),
                decisions=decisions,
                misses=[Miss.from_json(m) for m in data.get("misses", [])],
                failed=[Failure.from_json(f) for f in data.get("failed", [])],
                skipped=[Skipped.from_json(s) for s in data.get("skipped", [])],
                capture_method=data.get("capture_method", ""),
                fingerprint=data.get("fingerprint", ""),
                notes=[str(n) for n in data.get("notes", [])],
                calibration=_calibration_record(data.get("calibration")),
                tuning=data.get("tuning") if isinstance(data.get("tuning"), dict) else None,
                search=data.get("search") if isinstance(data.get("search"), dict) else None,
            )
        except (KeyError, TypeError, AttributeError) as e:  # fields _check_plan leaves alone
            raise PlanError(
                f"The plan is malformed ({type(e).__name__}: {e}); "
                "regenerate it with `opswap plan`."
            ) from e

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise PlanError(
                f"No plan file at {path}; write one with `opswap plan SPEC --out {path}`."
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{path} is not valid JSON ({e}).") from e
        try:
            return cls.from_json(data)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None

    def without(self, index: int) -> Plan:
        """A copy of the plan with decision `index` removed (used when rolling back)."""
        p = copy.copy(self)
        p.decisions = self.decisions[:index] + self.decisions[index + 1 :]
        return p


def _calibration_record(data: Any) -> CalibrationRecord | None:
    if data is None:
        return None
    try:
        return CalibrationRecord.from_json(data)
    except ValueError as e:
        raise PlanError(
            f"{e}; delete the plan's calibration (and pass --calibration FILE) or make the "
            "plan again with `opswap optimize`."
        ) from e


_MISSING = object()
_STR = ("a string", lambda v: isinstance(v, str))
_OBJ = ("an object", lambda v: isinstance(v, dict))
_LIST = ("a list", lambda v: isinstance(v, list))
_STRS = ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
_INT = ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
_NUM = ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool))
_NUM_OR_NULL = ("a number or null", lambda v: v is None or _NUM[1](v))
_EXACTNESS = (
    "one of " + ", ".join(EXACTNESS_ORDER),
    lambda v: isinstance(v, str) and v in EXACTNESS_ORDER,
)


def _need(value: Any, kind: tuple[str, Any], name: str) -> Any:
    """`value` if it is of `kind`, else a PlanError naming the field and what it holds."""
    want, ok = kind
    if ok(value):
        return value
    got = (
        "but it is missing"
        if value is _MISSING
        else "got an object"
        if isinstance(value, dict)
        else "got a list"
        if isinstance(value, list)
        else f"got {json.dumps(value, default=repr)}"
    )
    raise PlanError(f"{name} must be {want}, {got}; regenerate the plan with `opswap plan`.")


def _check_plan(data: Any) -> None:
    """The JSON type of every field `Plan.from_json` reads; optional ones may be absent."""
    _need(data, _OBJ, "A plan")
    version = _need(data.get("version", PLAN_VERSION), _INT, "The plan's version")
    if version > PLAN_VERSION:
        raise PlanError(
            f"This plan has version {version}; this opswap reads up to "
            f"{PLAN_VERSION}: upgrade opswap."
        )
    settings = _need(data.get("settings", {}), _OBJ, "settings")
    _need(settings.get("exactness", "exact"), _EXACTNESS, "settings.exactness")
    _need(settings.get("target", "cpu"), _STR, "settings.target")
    _need(settings.get("rules", []), _STRS, "settings.rules")
    _need(data.get("fingerprint", ""), _STR, "fingerprint")
    for i, d in enumerate(_need(data.get("decisions", _MISSING), _LIST, "decisions")):
        at = f"decision {i}:"
        _need(d, _OBJ, f"decision {i}")
        _need(d.get("rule", _MISSING), _STR, f"{at} rule")
        site = _need(d.get("site", _MISSING), _OBJ, f"{at} site")
        _need(site.get("key", _MISSING), _STR, f"{at} site key")
        _need(site.get("nodes", []), _STRS, f"{at} site nodes")
        _need(site.get("data", {}), _OBJ, f"{at} site data")
        _need(site.get("description", ""), _STR, f"{at} site description")
        _need(site.get("anchor", ""), _STR, f"{at} site anchor")
        estimate = _need(d.get("estimate", {}), _OBJ, f"{at} estimate")
        for key in ("flops_saved", "bytes_saved"):
            _need(estimate.get(key, 0.0), _NUM, f"{at} estimate {key}")
        _need(estimate.get("time_saved_s"), _NUM_OR_NULL, f"{at} estimate time_saved_s")
        _need(estimate.get("note", ""), _STR, f"{at} estimate note")
        for key in ("measured_s", "predicted_s"):
            for name, secs in _need(estimate.get(key, {}), _OBJ, f"{at} estimate {key}").items():
                _need(secs, _NUM, f"{at} estimate {key} {name}")


def site_module(gm: fx.GraphModule, site: Site) -> str:
    """The innermost module holding every node of a site (the common prefix of their module
    paths), so a site of an exported graph reads `model.encoder.layer.0.attention`, not
    `linear, linear_1, linear_2`; "" when the nodes carry no module path."""
    from opswap.cost.analyze import module_path
    from opswap.rules.base import node_by_name

    paths = [
        module_path(n) for n in (node_by_name(gm, name) for name in site.nodes) if n is not None
    ]
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    common = parts[0]
    for other in parts[1:]:
        k = 0
        while k < min(len(common), len(other)) and common[k] == other[k]:
            k += 1
        common = common[:k]
    return ".".join(common)


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """A short hash of what a plan depends on: the graph's ops in order and its weights'
    shapes, not the input sizes (a plan made at batch 2 applies at batch 8)."""
    import hashlib

    from opswap.graph.ops import compute_nodes, op_kind

    h = hashlib.sha1()
    for n in compute_nodes(gm):
        h.update(f"{op_kind(n)};".encode())
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)};".encode())
    return h.hexdigest()[:16]


def weights_digest(gm: fx.GraphModule) -> str:
    """A short hash of the values of `gm`'s parameters and buffers, whatever their names:
    of each tensor its shape, dtype and up to 4096 evenly spaced elements (so that a
    billion-parameter model hashes in milliseconds; retrained or other weights differ in
    all of them)."""
    import hashlib

    import torch

    parts = []
    for t in list(gm.parameters()) + list(gm.buffers()):
        if t.device.type == "meta":
            continue
        flat = t.detach().flatten()
        step = max(1, flat.numel() // 4096)
        sample = flat[::step][:4096].cpu().contiguous()
        h = hashlib.sha1(f"{tuple(t.shape)};{t.dtype};".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
        parts.append(h.hexdigest())
    return hashlib.sha1(";".join(sorted(parts)).encode()).hexdigest()[:16]


def _stored_scales(plan: Plan) -> dict[str, QParams]:
    """The activation scale of each static int8 decision, by the layer it quantises."""
    out: dict[str, QParams] = {}
    for d in plan.decisions:
        data = d.site.data
        layer = d.site.anchor or data.get("conv") or data.get("linear")
        if d.rule not in CALIBRATED_RULES or not isinstance(layer, str):
            continue
        scale, zp = data.get("scale"), data.get("zero_point")
        if (
            isinstance(scale, int | float)
            and not isinstance(scale, bool)
            and scale > 0
            and isinstance(zp, int)
            and not isinstance(zp, bool)
            and 0 <= zp <= 255
        ):
            out[layer] = QParams(float(scale), zp)
    return out


def calibrate_replay(
    captured: Captured,
    plan: Plan,
    samples: list[tuple[Any, ...]] | None = None,
    source: str = "calibration inputs",
    fallback: Callable[[], tuple[list[tuple[Any, ...]], str]] | None = None,
) -> str | None:
    """Give `captured` what `plan`'s static int8 decisions need to be applied again, and
    say in a sentence what that was (None when the plan has no such decision).

    `samples` (input tuples, `source` says what they are) are calibrated on afresh, with
    the plan's calibration settings; without them, the scales the plan holds are used
    when this model's weights are the ones they were observed with (weights_digest);
    else `fallback()` gives samples (a spec's calibration(), a task's training batches).
    With none of these, a CalibrationError names --calibration."""
    count = sum(d.rule in CALIBRATED_RULES for d in plan.decisions)
    if not count:
        return None
    rec = plan.calibration
    if samples is None and rec is not None and weights_digest(captured.gm) == rec.weights:
        attach_stored(captured.gm, StoredScales(_stored_scales(plan), rec))
        return (
            f"static int8 scales as the plan holds them (calibrated on {rec.describe()}); "
            "--calibration FILE (calibration_data=) calibrates again"
        )
    if samples is None and fallback is not None:
        samples, source = fallback()
    if samples is not None:
        cal = (
            rec.calibration(samples, source)
            if rec is not None
            else Calibration(samples, source=source)
        )
        attach(captured.gm, cal)
        return f"static int8 calibrated on {cal.describe()}"
    sites = f"{count} static int8 site{'s' if count != 1 else ''}"
    why = (
        "holds scales observed with other weights than this model's (did you pass the "
        "--weights the plan was made with?)"
        if rec is not None
        else "holds no activation scales for them (it was made by an opswap from before "
        "plans kept them, or without calibration)"
    )
    raise CalibrationError(
        f"The plan's {sites} need calibration, and the plan {why}; pass --calibration FILE "
        "with sample input batches (calibration_data= in Python) to calibrate them."
    )


def _missing_classes(exactness: str) -> list[str]:
    """A sentence for each looser exactness class the setting allows but no installed rule
    belongs to, so that `--exactness approx` never silently means `exact`."""
    level = EXACTNESS_ORDER.get(exactness, 0)
    allowed = [c for c, rank in EXACTNESS_ORDER.items() if rank <= level]
    present = {r.exactness for r in registry.all_rules()}
    return [
        f"no {c} rules are installed, so --exactness {exactness} plans only the "
        f"{', '.join(sorted(k for k in present if k in allowed))} rules"
        for c in allowed
        if c != "exact" and c not in present
    ]


def _looser_rules(exactness: str, patterns: list[str]) -> list[str]:
    """A sentence naming the installed rules this exactness leaves out (among those the
    patterns select), so that a user sees that `--exactness approx` would add them."""
    level = EXACTNESS_ORDER.get(exactness, 0)
    left_out = [
        r
        for r in registry.select(patterns or None, "lossy")
        if EXACTNESS_ORDER[r.exactness] > level
    ]
    return [
        f"{cls} rules not considered at --exactness {exactness} (--exactness {cls} plans "
        f"them): {', '.join(names)}"
        for cls in ("approx", "lossy")
        if (names := [r.name for r in left_out if r.exactness == cls])
    ]


def check_plan_fits(captured: Captured, plan: Plan) -> None:
    """Refuse a plan made for another model, in one sentence, before any site is looked up."""
    if not plan.fingerprint or plan.capture_method != captured.method:
        return
    if graph_fingerprint(captured.gm) != plan.fingerprint:
        raise PlanError(
            f"This plan was made for {plan.model or 'another model'} (graph "
            f"{plan.fingerprint}), and this model's graph differs ("
            f"{graph_fingerprint(captured.gm)}); make a plan for it with `opswap plan`."
        )


def _ordered(rules: list[Rule]) -> list[Rule]:
    """The rules in the order their after/before/phase declarations require (ties by
    chapter, then name); see rules/order.py."""
    return ordered(rules)


def make_plan(
    captured: Captured,
    *,
    target: Target | str | None = None,
    rules: list[str] | str | None = None,
    exactness: str = "exact",
    model_name: str = "model",
    progress: Callable[[str], None] | None = None,
    exclude_rules: set[str] | frozenset[str] = frozenset(),
    exclude_sites: dict[tuple[str, str], str] | None = None,
    keep_slower: bool = False,
    force_sites: frozenset[tuple[str, str]] = frozenset(),
) -> Plan:
    """Choose (rule, site) decisions for `captured` by simulating the rules in order.

    `target` is a Target (a name is looked up; None: this machine's CPU); rules not expected to pay there are left out,
    and a site whose predicted time saving is negative is skipped with the reason.
    `exclude_rules` (names) and `exclude_sites` ((rule, site key) -> reason) take
    rules and sites out, as rollback and pruning do; planning again rather than
    deleting decisions lets the sites that depended on an excluded one be matched
    afresh on the graph without it (a Conv+ReLU fusion whose BatchNorm fold was
    rolled back then fuses the conv as it is, or is refused with its own reason).
    `keep_slower` takes the sites the speed model predicts slower too: precision
    debugging asks which layers a scheme can take, not which pay.
    `force_sites` ((rule, site key) pairs, the joint search's choices: tuning.search) are
    tried before the rule's other sites and taken even when predicted slower.
    """
    return plan_with_graph(
        captured,
        target=target,
        rules=rules,
        exactness=exactness,
        model_name=model_name,
        progress=progress,
        exclude_rules=exclude_rules,
        exclude_sites=exclude_sites,
        keep_slower=keep_slower,
        force_sites=force_sites,
    )[0]


def plan_with_graph(
    captured: Captured,
    *,
    target: Target | str | None = None,
    rules: list[str] | str | None = None,
    exactness: str = "exact",
    model_name: str = "model",
    progress: Callable[[str], None] | None = None,
    exclude_rules: set[str] | frozenset[str] = frozenset(),
    exclude_sites: dict[tuple[str, str], str] | None = None,
    keep_slower: bool = False,
    force_sites: frozenset[tuple[str, str]] = frozenset(),
) -> tuple[Plan, fx.GraphModule]:
    """make_plan's plan, and the graph planning rewrote on the way: the plan's decisions
    carried out on a copy of `captured`, as `apply_plan` would make them again, its code
    not yet written (`gm.recompile()`). For a caller that only times the result
    (leave-one-out), this saves applying the plan a second time; what is verified and
    saved still comes from apply_plan."""
    exclude_sites = exclude_sites or {}
    from opswap.targets import get_target

    tgt = get_target("cpu" if target is None else target)  # a Target passes through
    patterns = list(registry.parse_patterns(rules))
    chosen = _ordered(registry.select(patterns or None, exactness, None))
    chosen = [
        r
        for r in chosen
        if (r.applies_to(tgt.name) or r.applies_to(tgt.kind)) and r.name not in exclude_rules
    ]
    plan = Plan(
        model_name,
        PlanSettings(tgt.name, patterns, exactness),
        capture_method=captured.method,
        fingerprint=graph_fingerprint(captured.gm),
    )
    plan.notes += _missing_classes(exactness) + _looser_rules(exactness, patterns)
    gm = copy_module(captured.gm)
    seen_misses: set[tuple[str, str, str]] = set()
    for rule in chosen:
        marks = (len(plan.decisions), len(plan.skipped), len(plan.failed))
        try:
            gm, changed = _plan_rule(
                rule, Run(gm), plan, tgt, exclude_sites, seen_misses, keep_slower, force_sites
            )
        except Redo:  # a rewrite failed: the rule's rewrites are undone, made again one by one
            del plan.decisions[marks[0] :], plan.skipped[marks[1] :], plan.failed[marks[2] :]
            gm, changed = _plan_rule(
                rule,
                Run(gm, careful=True),
                plan,
                tgt,
                exclude_sites,
                seen_misses,
                keep_slower,
                force_sites,
            )
        if changed:
            captured.propagate(gm)
        if progress is not None:
            progress(rule.name)
    cal = calibration_of(captured.gm)
    if cal is not None and any(d.rule in CALIBRATED_RULES for d in plan.decisions):
        plan.calibration = cal.record(weights_digest(captured.gm))
    return plan, gm


def _plan_rule(
    rule: Rule,
    run: Run,
    plan: Plan,
    tgt: Target,
    exclude_sites: dict[tuple[str, str], str],
    seen_misses: set[tuple[str, str, str]],
    keep_slower: bool = False,
    force_sites: frozenset[tuple[str, str]] = frozenset(),
) -> tuple[fx.GraphModule, bool]:
    """Match `rule` on run's graph and rewrite each site planning takes, recording the
    decisions, skips, failures and misses in `plan`; (the graph, whether it changed).
    Raises Redo (the graph as it was before) when a rewrite fails in a run that is not
    careful."""
    found = rule.match(run.gm)
    for m in misses_of(found):
        if (m.rule, m.where, m.reason) not in seen_misses:
            seen_misses.add((m.rule, m.where, m.reason))
            plan.misses.append(m)
    taken: set[str] = set()
    changed = False
    sites = sites_of(found)
    if force_sites:  # a forced site first, so it wins the nodes it shares with another
        sites = sorted(sites, key=lambda s: (rule.name, s.key) not in force_sites)
    for site in sites:
        if taken.intersection(site.nodes):
            continue  # overlaps a site of this rule already applied
        why = exclude_sites.get((rule.name, site.key))
        if why is not None:
            plan.skipped.append(Skipped(rule.name, site.key, why))
            continue
        # the match itself while the graph is as it was matched, else its anchor again
        match = rule.replay(run.gm, site.kept() if changed else site)
        if isinstance(match, str):
            plan.failed.append(Failure(rule.name, site.key, match))
            continue
        # a rule's timings at this site go through the tuning database (opswap.tuning)
        with site_scope(rule.name, site.key, run.gm, match.nodes, tgt):
            est = rule.predict(run.gm, match, tgt)
        where = site_module(run.gm, site)
        forced = (rule.name, site.key) in force_sites
        if est.time_saved_s is not None and est.time_saved_s < 0 and not (keep_slower or forced):
            plan.skipped.append(
                Skipped(rule.name, site.key, f"predicted slower on {tgt.name}: {est.note}")
            )
            continue
        err = run.rewrite(rule, match)  # the graph is what the next checks read
        if err:
            plan.failed.append(Failure(rule.name, site.key, err))
            continue
        taken.update(site.nodes)
        changed = True
        plan.decisions.append(Decision(rule.name, site.kept(), est, where))
    return run.gm, changed


def check_exactness(plan: Plan, rules: list[Rule]) -> None:
    """Refuse, in one sentence, the first decision whose rule is looser than the plan's
    settings.exactness: a decision hand-added to a plan marked exact would otherwise be
    applied, saved and verified against the exact tolerance's promise without a word."""
    level = EXACTNESS_ORDER[plan.settings.exactness]
    for i, rule in enumerate(rules):  # rules[i] is decision i's rule
        if EXACTNESS_ORDER[rule.exactness] > level:
            raise PlanError(
                f"Decision {i} applies {rule.name}, an {rule.exactness} rule, but the plan "
                f"allows exactness {plan.settings.exactness}; pass --allow-looser to "
                f"`opswap apply` (allow_looser=True to apply_plan) to apply it anyway, or "
                f"set the plan's settings.exactness to {rule.exactness}."
            )


def apply_plan(
    captured: Captured,
    plan: Plan,
    *,
    progress: Callable[[], None] | None = None,
    allow_looser: bool = False,
    shapes: bool = True,
) -> Applied:
    """Replay `plan` on a copy of `captured`; the capture itself is left untouched. A plan
    whose fingerprint says it was made for another graph is refused (PlanError), and so is
    a decision whose rule is looser than the plan's exactness unless `allow_looser`.
    `shapes=False`: the result's last rewrites are left without shapes (rules.apply), for
    a caller that only runs it."""
    check_plan_fits(captured, plan)
    rules = [registry.get(d.rule) for d in plan.decisions]
    if not allow_looser:
        check_exactness(plan, rules)
    decisions = [(rule, d.site) for rule, d in zip(rules, plan.decisions, strict=True)]
    return apply_sites(captured, decisions, progress=progress, shapes=shapes)
