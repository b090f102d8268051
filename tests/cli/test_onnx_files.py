import json

from onnx import helper

from opswap.cli import main


def _model(graphs):
    nodes = [
        graphs.const("r", 2**0.5),
        graphs.const("one", 1.0),
        graphs.const("half", 0.5),
        helper.make_node("Div", ["x", "r"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["x", "half"], ["m"]),
        helper.make_node("Mul", ["m", "a"], ["y"]),
    ]
    return graphs.save(graphs.proto(nodes, [("x", ["batch", "seq", 8])], ["y"]))


def test_analyze_plan_and_optimize_take_an_onnx_file(graphs, tmp_path, capsys):
    path = _model(graphs)
    main(["analyze", path, "--json", str(tmp_path / "a.json")])
    assert {r["op"] for r in json.loads((tmp_path / "a.json").read_text())["ops"]} >= {"Erf", "Mul"}
    main(["plan", path, "-o", str(tmp_path / "plan.json"), "--set", "seq=5"])
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["counts"] == {"onnx.gelu": 1}
    main(["optimize", path, "--out", str(tmp_path / "out"), "--no-bench", "--samples", "1"])
    data = json.loads((tmp_path / "out" / "result.json").read_text())
    assert data["verification"]["passed"] and data["counts"] == {"onnx.gelu": 1}
    assert (tmp_path / "out" / "model.onnx").exists() and (tmp_path / "out" / "report.md").exists()
    out = capsys.readouterr().out
    assert "onnx.gelu: 1 site" in out and "PASSED" in out


def test_onnx_errors_are_one_line_and_exit_2(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["plan", str(tmp_path / "missing.onnx")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_apply_verify_bench_and_export_refuse_an_onnx_file_before_reading_the_plan(
    graphs, tmp_path, capsys
):
    import pytest

    path = _model(graphs)
    missing_plan = str(tmp_path / "no-plan.json")  # never read: the spec is refused first
    for command in (
        ["apply"],
        ["verify"],
        ["bench"],
        ["export", "--to", "onnx", "-o", str(tmp_path / "e")],
    ):
        with pytest.raises(SystemExit) as e:
            main([command[0], path, missing_plan, *command[1:]])
        err = capsys.readouterr().err
        assert e.value.code == 2, command
        assert f"`opswap {command[0]}` takes a PyTorch model" in err and "analyze" in err
        assert len(err.strip().splitlines()) == 1, err


def test_sizes_too_large_to_allocate_are_one_line_and_exit_2(graphs, tmp_path, capsys):
    """`--set seq=99999999` on an ONNX file: refused before the inputs are drawn, as on a
    file.py spec, not numpy's out-of-memory traceback."""
    import pytest

    for sets in (["seq=99999999"], ["batch=100000000", "seq=1000"]):
        with pytest.raises(SystemExit) as e:
            main(
                [
                    "optimize",
                    _model(graphs),
                    *(a for s in sets for a in ("--set", s)),
                    "--out",
                    str(tmp_path / "o"),
                ]
            )
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err
        assert (
            "needs about" in err and "--set NAME=SIZE" in err and len(err.strip().splitlines()) <= 3
        )
