"""opswap's ONNX rules against ONNX Runtime's transformer optimizer on tiny BERT, GPT-2 and
ViT: at least as many of every fused op the optimizer makes, and the outputs still match."""

import onnx
import pytest

from opswap.onnx.load import load_onnx, other_sizes
from opswap.onnx.peer import covers, op_counts, ort_optimize
from opswap.onnx.plan import plan_onnx
from opswap.onnx.runtime import verify


@pytest.mark.parametrize("kind", ["bert", "gpt2", "vit"])
def test_opswap_fuses_at_least_what_ort_optimizer_fuses(exported, kind):
    m = load_onnx(exported(kind))
    _, theirs = ort_optimize(onnx.load(exported(kind)), kind, num_heads=4, hidden_size=64)
    plan, out = plan_onnx(m)
    ours = op_counts(out)
    table = covers(ours, theirs)
    assert table, f"ORT's optimizer fused nothing on {kind}: the comparison would prove nothing"
    short = {k: v for k, v in table.items() if v[0] < v[1]}
    assert not short, f"{kind}: opswap (ours, ORT's) short of ORT's optimizer: {short}"
    check = verify(m, out, [m.sizes, *other_sizes(m)], "exact", 1)
    assert check.passed, check.reasons
    assert len(check.shapes) == 3  # batch (and sequence) symbolic: verified at three sizes


def test_covers_counts_containing_fusions_and_says_where_short():
    ours = {"SkipLayerNormalization": 4, "LayerNormalization": 1, "BiasGelu": 2}
    theirs = {"LayerNormalization": 5, "Gelu": 2, "FastGelu": 0, "Attention": 2}
    assert covers(ours, theirs) == {
        "LayerNormalization": (5, 5),
        "Gelu": (2, 2),
        "Attention": (0, 2),
    }
