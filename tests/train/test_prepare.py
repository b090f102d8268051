"""opswap.train.prepare: training-valid rules only, the user's own parameters, train-mode
behaviour kept (dropout, BatchNorm), the fused loss head, refusals with reasons."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from opswap.errors import OpswapError
from opswap.rules import registry
from opswap.rules.base import Found, Rule
from opswap.train.prepare import LOSS_HEAD, PrepareError, prepare, training_rules


class _Block(nn.Module):
    """Norm, attention written out (softmax), dropout, MLP: odd sizes."""

    def __init__(self, d: int = 20, heads: int = 4, p: float = 0.2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 36), nn.GELU(), nn.Linear(36, d))
        self.drop = nn.Dropout(p)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, -1)
        )
        att = ((q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5).softmax(-1)
        x = x + self.drop(self.o((att @ v).transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.ff(self.ln2(x)))


class _LM(nn.Module):
    def __init__(self, vocab: int = 41, d: int = 20):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = _Block(d)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.block(self.emb(ids))))


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(6 * 5 * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.bn(self.conv(x))))
        return self.fc(h.flatten(1))


def _steps(fn: Any, params: Any, batches: list[tuple[torch.Tensor, ...]], seed: int) -> list[float]:
    """Losses of a few AdamW steps of `fn(*batch)` from one random state."""
    opt = torch.optim.AdamW(params, lr=1e-2)
    torch.manual_seed(seed)
    out = []
    for b in batches:
        loss = fn(*b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def test_lm_fuses_the_loss_head_and_trains_the_users_parameters() -> None:
    torch.manual_seed(0)
    model = _LM()
    twin = _LM()
    twin.load_state_dict(model.state_dict())
    ids, labels = torch.randint(0, 41, (3, 11)), torch.randint(0, 41, (3, 11))
    prepared = prepare(model, (ids, labels), _lm_loss, fuse_loss=True)
    rules = [r for r, _ in prepared.report.replaced]
    assert LOSS_HEAD in rules
    assert "attention.sdpa" in rules
    assert prepared.report.check is not None and prepared.report.check.passed
    assert {id(p) for p in prepared.parameters()} == {id(p) for p in model.parameters()}
    assert "opswap_train_losses_linear_cross_entropy" in prepared.graph.code
    batches = [(torch.randint(0, 41, (3, 11)), torch.randint(0, 41, (3, 11))) for _ in range(4)]
    got = _steps(prepared, model.parameters(), batches, seed=5)  # optimizer on the model's own
    want = _steps(lambda i, y: _lm_loss(twin(i), y), twin.parameters(), batches, seed=5)
    assert got == pytest.approx(want, rel=1e-4)
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        # Adam divides by sqrt(v): a near-zero gradient (q and k biases) magnifies rounding
        torch.testing.assert_close(p, q, rtol=1e-3, atol=2e-3, msg=n)


def test_dropout_stays_random_and_batchnorm_updates_the_models_statistics() -> None:
    torch.manual_seed(1)
    model = _CNN()
    x, y = torch.randn(4, 1, 7, 7), torch.randint(0, 10, (4,))
    before = model.bn.running_mean.clone()
    prepared = prepare(model, (x, y), F.cross_entropy)
    assert torch.equal(model.bn.running_mean, before)  # prepare itself leaves them alone
    assert not any(
        r.startswith(("fusion.conv_bn", "layout.drop_dropout")) for r, _ in prepared.report.replaced
    )
    torch.manual_seed(3)
    a = prepared(x, y)
    torch.manual_seed(4)
    b = prepared(x, y)
    assert float(a.detach()) != float(b.detach())  # dropout in train mode, a new mask each call
    twin = _CNN()
    twin.load_state_dict(model.state_dict())  # the statistics after the two calls above
    x2 = torch.randn(5, 1, 7, 7)  # another batch size
    y2 = torch.randint(0, 10, (5,))
    torch.manual_seed(9)
    got = prepared(x2, y2)
    torch.manual_seed(9)
    want = F.cross_entropy(twin(x2), y2)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)
    assert int(model.bn.num_batches_tracked) == int(twin.bn.num_batches_tracked) == 3


def test_prepare_leaves_the_random_state_as_it_found_it() -> None:
    model = _CNN()
    batch = (torch.randn(2, 1, 7, 7), torch.randint(0, 10, (2,)))
    torch.manual_seed(11)
    state = torch.get_rng_state()
    prepare(model, batch, F.cross_entropy)
    assert torch.equal(torch.get_rng_state(), state)


def test_without_a_loss_the_module_returns_the_outputs() -> None:
    model = _CNN()
    x = torch.randn(3, 1, 7, 7)
    prepared = prepare(model, (x,))
    assert not prepared.with_loss
    torch.manual_seed(2)
    got = prepared(x)
    torch.manual_seed(2)
    torch.testing.assert_close(got, _CNN.forward(model, x))


def test_training_rules_are_opt_in() -> None:
    names = training_rules()
    assert "norm.rms_norm" in names and "attention.sdpa" in names
    for never in (
        "fusion.conv_bn",
        "fusion.linear_bn",
        "layout.drop_dropout",
        "fusion.parallel_linear",
    ):
        assert never not in names
    assert training_rules(["norm.*"]) == [n for n in names if n.startswith("norm.")]


class _BadRelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp_min(0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * (x > 0) * 2  # wrong on purpose: twice the gradient


def _bad_relu(x: torch.Tensor) -> torch.Tensor:
    return _BadRelu.apply(x)


class _BrokenBackward(Rule):
    """Test-only: relu -> the same forward with a wrong backward."""

    name, family, chapter, exactness = "activation.test_broken_backward", "activation", 27, "exact"
    anchors = ("relu",)
    training = True

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found:
        return Found((node,), f"{node.name} -> a relu whose backward is wrong", x=node.args[0])

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node = found.nodes[0]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(_bad_relu, (found["x"],))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)


class _NewWeights(Rule):
    """Test-only: a Linear whose weight becomes a new Parameter (a copy)."""

    name, family, chapter, exactness = "fusion.test_new_weights", "fusion", 27, "exact"
    anchors = ("linear",)
    training = True

    def check(self, gm: fx.GraphModule, node: fx.Node) -> Found | None:
        return (
            Found((node,), f"{node.name} with a copied weight")
            if node.op == "call_module"
            else None
        )

    def rewrite(self, gm: fx.GraphModule, found: Found) -> None:
        node = found.nodes[0]
        old = gm.get_submodule(str(node.target))
        assert isinstance(old, nn.Linear)
        new = nn.Linear(old.in_features, old.out_features)
        new.weight = nn.Parameter(old.weight.detach().clone())
        new.bias = old.bias
        gm.add_submodule(f"{node.target}_copy".replace(".", "_"), new)
        node.target = f"{node.target}_copy".replace(".", "_")


@pytest.mark.parametrize("rule", [_BrokenBackward, _NewWeights])
def test_a_rule_that_breaks_training_is_refused_with_the_reason(rule: type[Rule]) -> None:
    registry.register(rule)
    try:
        model = _CNN()
        x, y = torch.randn(3, 1, 7, 7), torch.randint(0, 10, (3,))
        prepared = prepare(model, (x, y), F.cross_entropy, rules=[rule.name], fuse_loss=False)
    finally:
        registry._RULES.pop(rule.name, None)
    refused = dict(prepared.report.refused)
    assert rule.name in refused
    want = "gradients differ" if rule is _BrokenBackward else "makes new parameters"
    assert want in refused[rule.name]
    assert rule.name not in {r for r, _ in prepared.report.replaced}
    assert {id(p) for p in prepared.parameters()} == {id(p) for p in model.parameters()}


def test_bad_input_is_refused_in_a_sentence() -> None:
    model = _CNN()
    x, y = torch.randn(2, 1, 7, 7), torch.randint(0, 10, (2,))
    with pytest.raises(PrepareError, match="inputs..., target"):
        prepare(model, x, F.cross_entropy)
    with pytest.raises(PrepareError, match="eval mode"):
        prepare(model.eval(), (x, y), F.cross_entropy)
    with pytest.raises(PrepareError, match="exactness"):
        prepare(model.train(), (x, y), F.cross_entropy, exactness="roughly")
    prepared = prepare(model.train(), (x, y), F.cross_entropy, rules=["layout.*"])
    with pytest.raises(OpswapError, match="prepared model"):
        prepared(torch.randn(2, 7, 7), y)  # another rank
    with pytest.raises(OpswapError, match="prepared model"):
        prepared(x)  # no target
    with pytest.raises(PrepareError, match="nn.Module"):
        prepare(lambda z: z, (x, y), F.cross_entropy)  # type: ignore[arg-type]


def test_a_head_whose_logits_are_read_elsewhere_is_left_with_the_reason() -> None:
    torch.manual_seed(2)
    model = _LM(vocab=23)
    ids, labels = torch.randint(0, 23, (2, 5)), torch.randint(0, 23, (2, 5))

    def with_z_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _lm_loss(logits, y) + 1e-3 * logits.logsumexp(-1).pow(2).mean()

    prepared = prepare(model, (ids, labels), with_z_loss, rules=["layout.*"], fuse_loss=True)
    assert LOSS_HEAD not in {r for r, _ in prepared.report.replaced}
    left = [why for rule, _, why in prepared.report.left if rule == LOSS_HEAD]
    assert left and "also read elsewhere" in left[0]
    assert prepared.report.check is not None and prepared.report.check.passed
    assert "left" in str(prepared.report) and prepared.report.to_json()["gradients"]["passed"]


def test_on_a_cpu_target_the_loss_head_is_left_unless_forced() -> None:
    model = _CNN()
    x, y = torch.randn(3, 1, 7, 7), torch.randint(0, 10, (3,))
    prepared = prepare(model, (x, y), F.cross_entropy, rules=["layout.*"])
    assert LOSS_HEAD not in {r for r, _ in prepared.report.replaced}
    assert any("fuse_loss=True forces it" in n for n in prepared.report.notes)
    forced = prepare(model, (x, y), F.cross_entropy, rules=["layout.*"], fuse_loss=True)
    assert LOSS_HEAD in {r for r, _ in forced.report.replaced}
    with pytest.raises(PrepareError, match="target"):
        prepare(model, (x, y), F.cross_entropy, target="tpu9")


def test_a_loss_module_with_settings_and_an_optimizer_missing_a_parameter() -> None:
    torch.manual_seed(4)
    model = _CNN()
    x, y = torch.randn(5, 1, 7, 7), torch.randint(0, 10, (5,))
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n != "fc.bias"], lr=0.1)
    loss = nn.CrossEntropyLoss(label_smoothing=0.1)
    prepared = prepare(model, (x, y), loss, fuse_loss=True, optimizer=opt, rules=["nothing.*"])
    assert [r for r, _ in prepared.report.replaced] == [LOSS_HEAD]
    assert prepared.report.check is not None and prepared.report.check.passed
    notes = " ".join(prepared.report.notes)
    assert "does not hold 1 trained parameter(s) (fc.bias)" in notes
    assert "select no rule valid in training" in notes
    torch.manual_seed(0)
    got = prepared(x, y)
    torch.manual_seed(0)
    torch.testing.assert_close(got, loss(_CNN.forward(model, x), y))
