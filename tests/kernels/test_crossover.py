"""The crossover table: the shipped one holds no invented figures (every entry without a
measurement says "none yet"), a benchmark's rows update it, and a measured entry decides
a rule's prediction on a CUDA target where the roofline would otherwise."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from opswap.kernels import crossover as cx
from opswap.rules import _triton
from opswap.targets import get_target


def test_shipped_table_is_honest_and_keyed_by_the_benchmark_shapes():
    entries = cx.load()
    assert entries and {e.kernel for e in entries} == set(cx.kernels())
    for e in entries:
        assert e.measured == e.source.startswith("measured"), e
        if not e.measured:
            assert e.source == "none yet" and e.speedup_vs_eager is None
    assert cx.shape_class(4096, 32768) == "h<=4096,rows<=32768"
    assert cx.shape_class(5632, 40000) == "h<=8192,rows>32768"
    assert cx.device_class(get_target("h200")) == "sm90"
    assert cx.device_class(get_target("cpu")) == "cpu"


def _kernel_names_in_calls() -> dict[str, str]:
    """Kernel name -> where, for every name written out in src/opswap as the kernel of a
    table look-up: compiles_to_reference("x", ...), lookup("x", ...), predict(t, "x", ...)."""
    where: dict[str, str] = {}
    src = Path(cx.__file__).resolve().parents[1]
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            fn = getattr(node.func, "attr", getattr(node.func, "id", None))
            at = {"compiles_to_reference": 0, "lookup": 0, "predict": 1}.get(str(fn))
            if at is None or len(node.args) <= at:
                continue
            arg = node.args[at]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                where[arg.value] = f"{path.relative_to(src)}:{node.lineno}"
    return where


def test_the_kernel_list_is_what_the_kernel_modules_declare_and_covers_every_use():
    from opswap.kernels import activation, reduction, rms_norm
    from opswap.rules.activation.pointwise import FORMULAS

    names = cx.kernels()
    assert len(names) == len(set(names))
    assert set(rms_norm.CROSSOVER) | set(reduction.CROSSOVER) <= set(names)
    assert set(activation.CROSSOVER) <= set(names) and "bias_act" in names
    # every formula the rule replaces is measured under its own name
    assert {f"bias_act:{form}" for form, *_ in FORMULAS} <= set(names)
    used = _kernel_names_in_calls()
    assert {"rms_norm", "swiglu", "flash_attention", "group_norm"} <= set(used)  # the scan works
    unknown = {k: v for k, v in used.items() if k not in names}
    assert not unknown, f"kernel names no kernel module declares in CROSSOVER: {unknown}"


def _result(ours, eager):
    row = dict(kernel="rms_norm", dtype="bfloat16", rows=32768, hidden=4096)
    return {
        "device_class": "sm90",
        "rows": [
            dict(row, **{"pass": "forward", "ours_ms": ours, "eager_ms": eager, "compile_ms": 0.5}),
            dict(row, **{"pass": "forward+backward", "ours_ms": None, "eager_ms": 1.0}),
        ],
    }


def test_update_replaces_entries_and_lookup_finds_the_measured_ones(tmp_path, monkeypatch):
    path = tmp_path / "crossover.json"
    path.write_text((cx.TABLE).read_text())
    new = cx.update(_result(0.2, 0.6), "measured norm_kernels_h200.json 2026-01-01", path)
    assert len(new) == 1  # the untimed row gives no entry
    table = cx.load(path)
    e = cx.lookup("rms_norm", "sm90", torch.bfloat16, 4096, 32768, entries=table)
    assert e is not None and e.beats_eager and e.beats_compile and e.speedup_vs_eager == 3.0
    assert len(table) == len(cx.load())  # replaced in place, nothing added
    # a measured loss decides the prediction: predicted slower, with the measurement's source
    cx.update(_result(0.9, 0.6), "measured norm_kernels_h200.json 2026-01-02", path)
    monkeypatch.setattr(cx, "TABLE", path)
    est = _triton.predict(
        get_target("h200"), "rms_norm", [], _triton.NodeCost(0, 1), torch.bfloat16, 4096, 32768, ""
    )
    assert est.time_saved_s is not None and est.time_saved_s < 0 and "2026-01-02" in est.note
    est = _triton.predict(
        get_target("h200"), "rms_norm", [], _triton.NodeCost(0, 1), torch.bfloat16, 8192, 256, "x"
    )
    assert "roofline" in est.note  # nothing measured at hidden 8192


def test_a_tensor_shape_in_a_row_is_not_taken_for_a_shape_class(tmp_path):
    # bench_kernels18.py's rows carry the tensor's shape as a list; the class is then made
    # from hidden and rows (a list as a key failed the update on the H200)
    row = {"kernel": "bias_gelu_cuda", "dtype": "bfloat16", "rows": 8192, "hidden": 4096}
    row.update({"pass": "forward", "shape": [8192, 4096], "ours_ms": 1.0, "eager_ms": 2.0})
    new = cx.entries_from_benchmark({"device_class": "sm90", "rows": [row]}, "measured x")
    assert [e.shape for e in new] == [cx.shape_class(4096, 8192)]
    attn = {**row, "kernel": "flash_attention", "shape": "d=64,sq<=4096,sk<=4096"}
    assert cx.entries_from_benchmark({"device_class": "sm90", "rows": [attn]}, "m")[0].shape == (
        "d=64,sq<=4096,sk<=4096"
    )


def _aot_forward_targets(fn, *shapes):
    """The call targets of the forward graph AOTAutograd traces for `fn` on fake CUDA
    tensors (this machine has no GPU: the trace needs none, running the result would)."""
    import contextlib

    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen: list[set[str]] = []

    def capture(gm, _):
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    with FakeTensorMode():
        args = [torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes]
        with contextlib.suppress(RuntimeError):  # running on fake CUDA tensors fails here
            aot_function(fn, fw_compiler=capture)(*args)
    return seen[0]


def test_under_compile_an_op_traces_its_reference_where_inductor_measured_faster(
    tmp_path, monkeypatch
):
    from opswap.kernels import rms_norm as R

    def row(rows, ours, compile_):
        r = {"kernel": "rms_norm", "dtype": "bfloat16", "rows": rows, "hidden": 4096}
        return {**r, "pass": "forward", "ours_ms": ours, "eager_ms": 1.0, "compile_ms": compile_}

    path = tmp_path / "crossover.json"
    path.write_text('{"entries": []}')
    # Inductor faster at 4096 rows, ours at 32768; nothing measured at 256
    cx.update(
        {"device_class": "sm90", "rows": [row(4096, 0.5, 0.3), row(32768, 0.2, 0.3)]}, "m", path
    )
    monkeypatch.setattr(cx, "TABLE", path)
    monkeypatch.setattr(cx, "device_class", lambda where: "sm90")

    def fn(x, w):
        return R.rms_norm(x, w, 1e-6, 0.0, True)

    at = {rows: _aot_forward_targets(fn, (rows, 4096), (4096,)) for rows in (4096, 32768, 256)}
    assert "aten.rsqrt.default" in at[4096] and not any("triton" in t for t in at[4096])
    assert "triton_kernel_wrapper_functional" in at[32768] and "aten.rsqrt.default" not in at[32768]
    assert "triton_kernel_wrapper_functional" in at[256]  # unmeasured: the kernel
    # eager calls and torch.export never ask: the op is what export records
    from opswap.kernels._rows import compiles_to_reference

    assert not compiles_to_reference("rms_norm", torch.randn(4096, 4096))


def test_against_compile_the_gpu_times_decide_where_measured():
    r = {"kernel": "rms_norm", "dtype": "bfloat16", "rows": 4096, "hidden": 4096}
    r.update({"pass": "forward", "ours_ms": 0.06, "eager_ms": 0.24, "compile_ms": 0.02})
    host_bound = cx.entries_from_benchmark({"device_class": "sm90", "rows": [r]}, "m")[0]
    assert host_bound.beats_eager and host_bound.beats_compile is False
    r.update({"ours_graph_ms": 0.016, "compile_graph_ms": 0.018})
    e = cx.entries_from_benchmark({"device_class": "sm90", "rows": [r]}, "m")[0]
    assert e.beats_eager and e.beats_compile and e.speedup_vs_compile == round(0.018 / 0.016, 3)


def test_two_widths_of_one_class_in_a_run_give_the_least_favourable_entry():
    """The width sweep's 5120 and 8192 both fall in h<=8192: a win at one and a loss at
    the other must not read as a win for the class (whichever row comes last)."""

    def row(hidden, ours, compile_):
        r = {"kernel": "layer_norm", "dtype": "bfloat16", "rows": 4096, "hidden": hidden}
        return {**r, "pass": "forward", "ours_ms": ours, "eager_ms": 1.0, "compile_ms": compile_}

    for rows in (
        [row(5120, 0.5, 0.4), row(8192, 0.2, 0.4)],
        [row(8192, 0.2, 0.4), row(5120, 0.5, 0.4)],
    ):
        (e,) = cx.entries_from_benchmark({"device_class": "sm90", "rows": rows}, "m")
        assert e.shape == "h<=8192,rows<=4096"
        assert e.beats_eager and e.beats_compile is False
        assert e.speedup_vs_compile == 0.8 and e.speedup_vs_eager == 2.0
    # a class of one shape is that shape's entry
    (e,) = cx.entries_from_benchmark({"device_class": "sm90", "rows": [row(3072, 0.2, 0.4)]}, "m")
    assert e.beats_compile and e.speedup_vs_compile == 2.0
