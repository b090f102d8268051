"""opswap.load_optimized: what `Result.save(DIR)` wrote, loaded as a user loads it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import opswap
from opswap import report
from opswap.artifact import RUN_FILES
from opswap.config import OptimizeConfig
from opswap.errors import OpswapError
from opswap.pipeline import optimize

_QUICK = OptimizeConfig(bench=False, layers=False, samples=1)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(self.a(x).relu())


class _TopK(nn.Module):
    """Returns torch.return_types.topk, which torch.export.save cannot name."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.topk(self.lin(x), 3)


def _saved(model, tmp, x):
    result = optimize(model, (x,), _QUICK)
    result.save(tmp)
    return result


@pytest.fixture
def earlier_run(tmp_path):
    torch.manual_seed(0)
    model = _Mlp().eval()
    out = tmp_path / "run"
    _saved(model, out, torch.randn(4, 8))
    assert (out / "model.pt2").is_file()
    return model, out


def test_saving_over_an_earlier_run_leaves_exactly_this_run(earlier_run):
    _, out = earlier_run
    (out / "notes.txt").write_text("my notes\n")
    torch.manual_seed(1)
    _saved(_TopK().eval(), out, torch.randn(4, 8))
    names = {p.name for p in out.iterdir()}
    assert "model.pt2" not in names and "model_state.pt" in names
    assert (out / "notes.txt").read_text() == "my notes\n"  # not opswap's: kept
    assert names - {"notes.txt"} <= RUN_FILES
    assert [p.name for p in out.parent.iterdir()] == ["run"]  # no temporary folder left
    with pytest.raises(OpswapError, match="model_state.pt but no model.pt2"):
        opswap.load_optimized(out)


def test_an_exportable_run_over_a_fallback_serves_the_new_model(tmp_path):
    out = tmp_path / "run"
    torch.manual_seed(1)
    _saved(_TopK().eval(), out, torch.randn(4, 8))
    assert (out / "model_state.pt").is_file()
    torch.manual_seed(2)
    model = _Mlp().eval()
    _saved(model, out, torch.randn(4, 8))
    assert not (out / "model_state.pt").exists() and not (out / "model_state.txt").exists()
    x = torch.randn(7, 8)
    with torch.no_grad():
        torch.testing.assert_close(opswap.load_optimized(out)(x), model(x))


def test_a_save_that_fails_leaves_the_earlier_run_as_it_was(earlier_run, monkeypatch):
    model, out = earlier_run
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(result, folder):
        raise OSError("disk full")

    monkeypatch.setattr(report, "write_reports", broken)
    with pytest.raises(OSError, match="disk full"):
        _saved(_TopK().eval(), out, torch.randn(4, 8))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["run"]
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opswap.load_optimized(out)(x), model(x))


@pytest.mark.parametrize(
    "text",
    [
        "[1]",
        "null",
        '"deploy"',
        '{"deploy": "yes"}',
        '{"deploy": [true]}',
        '{"deploy": {"compile": "no"}}',
        '{"deploy": {"compile": 1}}',
    ],
)
def test_a_result_json_of_another_shape_is_refused(earlier_run, text):
    model, out = earlier_run
    (out / "result.json").write_text(text)
    with pytest.raises(OpswapError, match=r"result\.json is not"):
        opswap.load_optimized(out)
    x = torch.randn(5, 8)
    with torch.no_grad():  # told what to do, it needs no result.json
        torch.testing.assert_close(opswap.load_optimized(out, compile=False)(x), model(x))


def test_a_result_json_without_deploy_loads_uncompiled(earlier_run):
    model, out = earlier_run
    data = json.loads((out / "result.json").read_text())
    assert data["deploy"]["compile"] is False
    del data["deploy"]
    (out / "result.json").write_text(json.dumps(data))
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(opswap.load_optimized(out)(x), model(x))


@pytest.mark.hf
def test_transformers_outputs_load_in_a_fresh_process(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from opswap.models import load

    cfg = BertConfig(
        vocab_size=60,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=40,
        num_labels=3,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(tmp_path / "ckpt")
    spec = tmp_path / "spec.py"
    spec.write_text(
        textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForSequenceClassification

        def model():
            m = AutoModelForSequenceClassification.from_pretrained({str(tmp_path / "ckpt")!r})
            return m.eval(), (torch.randint(0, 60, (2, 12)),)
    """)
    )
    loaded = load(f"{spec}:model")
    optimize(loaded.module, loaded.example_inputs, _QUICK).save(tmp_path / "out")
    ids = torch.randint(0, 60, (3, 9), generator=torch.Generator().manual_seed(5))
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(f"""
        import sys, torch, opswap
        m = opswap.load_optimized({str(tmp_path / "out")!r})
        with torch.inference_mode():
            out = m(torch.load({str(tmp_path / "ids.pt")!r}))
        torch.save({{"type": type(out).__name__, "logits": out.logits}},
                   {str(tmp_path / "got.pt")!r})
    """)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = torch.load(tmp_path / "got.pt")
    assert got["type"] == "SequenceClassifierOutput"
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], loaded.module(ids).logits)


def test_a_model_optimized_with_keyword_inputs_is_called_by_those_names(tmp_path):
    import opswap
    from opswap.errors import InputError

    class Keyed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask=None):
            return self.out((self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1))

    torch.manual_seed(0)
    m = Keyed().eval()
    ex = {"input_ids": torch.randint(0, 50, (2, 8)), "attention_mask": torch.ones(2, 8)}
    r = opswap.optimize(m, ex, compare="none", bench=False)
    r.save(tmp_path)
    other = {"input_ids": torch.randint(0, 50, (3, 11)), "attention_mask": torch.ones(3, 11)}
    with torch.no_grad():
        want = m(**other)
        for fn in (r.candidate, opswap.load_optimized(tmp_path)):
            torch.testing.assert_close(fn(**other), want)
            torch.testing.assert_close(
                fn(other["input_ids"], attention_mask=other["attention_mask"]), want
            )
            with pytest.raises(InputError, match="no input 'mask'"):
                fn(input_ids=other["input_ids"], mask=other["attention_mask"])


def test_a_bad_call_with_tuple_inputs_is_one_sentence_in_memory_and_loaded(tmp_path):
    # `load_optimized(dir)(bad)` on a model taking a tuple raised IndexError (rank),
    # RuntimeError from inside an op (dtype) or `AssertionError: Guard failed` (size), and
    # `result.candidate` named the leaf "input input 0"
    from opswap.errors import InputError

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 5)

        def forward(self, pair):
            a, b = pair
            return self.lin(a).relu() if a.shape[1] > 4 else self.lin(b).tanh()

    torch.manual_seed(0)
    m = Pair().eval()
    r = opswap.optimize(
        m, ((torch.randn(2, 9, 6), torch.randn(2, 9, 6)),), compare="none", bench=False
    )
    r.save(tmp_path)
    x, y = torch.randn(3, 7, 6), torch.randn(3, 7, 6)
    for fn in (r.candidate, opswap.load_optimized(tmp_path)):
        with torch.no_grad():
            torch.testing.assert_close(fn((x, y)), m((x, y)))
        for args, match in (
            ((x[0], y), r"input pair\[0\] must be a 3-D torch.float32 tensor, got a 2-D"),
            (
                (x, y.double()),
                r"input pair\[1\] must be a 3-D torch.float32 tensor, got a 3-D torch.float64",
            ),
            ((x[:, :3], y[:, :3]), r"input pair\[0\] has size 3 in dim 1, but .*(>= 5|> 4)"),
        ):
            with pytest.raises(InputError, match=match) as e:
                fn(args)
            assert "\n" not in str(e.value) and "input input" not in str(e.value)
