"""opswap.train.prune: structured pruning over the dependency graph. Each model here is
pruned, runs at other batch sizes, loses the parameters counted by hand, is unchanged at
ratio 0, and, where the removed channels were made dead beforehand (zero weights), keeps
its function exactly: that checks every coupled slice (BatchNorm statistics, residual
branches, concat offsets, flatten, heads) lines up. The user's model is never changed."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opswap.errors import RuleError
from opswap.models.zoo_transformer import bert
from opswap.train.prune import count_params, dependency_groups, prune


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class MLP(nn.Module):
    def __init__(self, d: int = 13, h: int = 37) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.gate = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate(x)) * self.up(x)  # gate and up are pruned together
        return self.head(F.relu(x + self.down(h)))  # the residual ties down to the input: kept


def test_mlp_prunes_the_gated_width_only_and_counts_parameters() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 13)
    before = copy.deepcopy(model.state_dict())
    p = prune(model, (x,), 0.5)
    kept = round(37 * 0.5)  # 18 (round half to even)
    assert p.model.up.out_features == p.model.gate.out_features == p.model.down.in_features == kept
    assert p.model.down.out_features == 13 and p.model.head.out_features == 5
    assert p.params_before == count_params(model)
    assert p.params_after == count_params(model) - 2 * (37 - kept) * (13 + 1) - (37 - kept) * 13
    assert p.macs_after < p.macs_before
    blocked = {g.name: g.blocked for g in p.groups}
    assert "adds" not in str(blocked) and "model input" not in str(blocked)
    assert blocked["head's output features"] == "it reaches the model's output"
    assert any("whose size is fixed" in str(b) for b in blocked.values())  # x + down(h)
    assert p.model(torch.randn(1, 13)).shape == (1, 5)
    assert _same_dict(model.state_dict(), before)


def _same_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dead_gated_channels_are_removed_exactly() -> None:
    torch.manual_seed(1)
    model, x = MLP(11, 23), torch.randn(6, 11)
    dead = torch.arange(0, 23, 3)  # 8 of 23
    with torch.no_grad():
        for lin in (model.up, model.gate):
            lin.weight[dead] = 0
            lin.bias[dead] = 0
        model.down.weight[:, dead] = 0
    p = prune(model, (x,), 8 / 23)
    assert p.model.up.out_features == 15
    y = torch.randn(3, 11)
    torch.testing.assert_close(p.model(y), model(y), rtol=1e-5, atol=1e-6)


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)), inplace=True)  # in place
        h = self.bn2(self.conv2(h))
        h += x  # in-place residual: both branches are one group
        return F.relu(h)


class CNN(nn.Module):
    """Stem, a residual block, a depthwise conv, a concat of two branches, flatten, Linear."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.block = Block(c)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.left = nn.Conv2d(c, 5, 1)
        self.right = nn.Conv2d(c, 7, 1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(12 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(F.relu(self.bn(self.stem(x))))
        h = self.dw(h)
        h = torch.cat([self.left(h), F.relu(self.right(h))], dim=1)
        return self.head(torch.flatten(self.pool(h), 1))


def _realistic(model: nn.Module) -> nn.Module:
    torch.manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model.eval()


def test_cnn_groups_follow_bn_residual_depthwise_concat_and_flatten() -> None:
    model = _realistic(CNN())
    x = torch.randn(2, 3, 9, 7)  # odd spatial sizes
    groups = {g.name: g for g in dependency_groups(model, (x,))}
    trunk = next(g for g in groups.values() if "stem.weight[dim 0]" in g.tensors)
    for t in ("bn.running_var[dim 0]", "block.conv2.weight[dim 0]", "block.bn2.bias[dim 0]",
              "dw.weight[dim 0]", "left.weight[dim 1]", "right.weight[dim 1]"):  # fmt: skip
        assert t in trunk.tensors
    assert trunk.blocked is None
    assert "head.weight[dim 1]" in groups["left's output channels"].tensors
    p = prune(model, (x,), 0.5)
    m = p.model
    assert m.stem.out_channels == m.bn.num_features == m.dw.groups == 3
    assert m.block.conv1.out_channels == 3 and m.left.out_channels == 2  # round(2.5) = 2
    assert m.right.out_channels == 4 and m.head.in_features == (2 + 4) * 4
    assert m.bn.running_mean.shape == (3,)
    for batch in (1, 5):
        assert m(torch.randn(batch, 3, 9, 7)).shape == (batch, 3)
    assert sum(p.numel() for p in m.parameters()) == p.params_after < p.params_before


def test_dead_cnn_channels_are_removed_exactly() -> None:
    model = _realistic(CNN(6))
    dead = torch.tensor([1, 4])
    with torch.no_grad():  # make trunk channels 1 and 4 exactly zero everywhere they appear
        model.stem.weight[dead] = 0
        model.stem.bias[dead] = 0
        for bn in (model.bn, model.block.bn1, model.block.bn2):
            bn.bias[dead] = 0
            bn.running_mean[dead] = 0
        model.block.conv1.weight[dead] = 0
        model.block.conv2.weight[dead] = 0
        model.dw.weight[dead] = 0
        model.dw.bias[dead] = 0
        model.left.weight[:, dead] = 0
        model.right.weight[:, dead] = 0
    x = torch.randn(2, 3, 8, 8)
    p = prune(model, (x,), 1 / 3, keep=("block.conv1", "left", "right"))  # the trunk only
    assert p.model.stem.out_channels == 4
    assert p.model.block.conv1.out_channels == 6  # kept: a module in keep=
    y = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(p.model(y), model(y), rtol=1e-5, atol=1e-5)


def test_ratio_zero_is_identical_and_the_model_is_not_touched() -> None:
    model = _realistic(CNN())
    before = copy.deepcopy(model)
    p = prune(model, (torch.randn(2, 3, 8, 8),), 0.0)
    assert _same(p.model, model) and _same(model, before)
    assert p.params_after == p.params_before and p.macs_after == p.macs_before
    assert p.model is not model


def test_bn_running_statistics_are_sliced_with_their_channels() -> None:
    model = _realistic(CNN())
    p = prune(model, (torch.randn(2, 3, 8, 8),), 0.5, importance="l2")
    kept = p.model.bn.weight.detach()
    idx = [int((model.bn.weight.detach() == w).nonzero()[0]) for w in kept]
    assert torch.equal(p.model.bn.running_var, model.bn.running_var[idx])
    assert torch.equal(p.model.stem.weight, model.stem.weight[idx])


def test_round_to_keeps_multiples() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 4))
    p = prune(model, (torch.randn(2, 10),), 0.3, round_to=8)
    assert p.model[0].out_features == 32  # 35 -> 32


class SelfAttention(nn.Module):
    """BERT's attention as Hugging Face writes it: the head count and all_head_size are
    attributes the forward reads, so removing heads needs them rewritten."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size = heads, hidden // heads
        self.all_head_size = hidden
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        shape = (b, s, self.num_attention_heads, self.attention_head_size)
        q, k, v = (f(x).view(shape).transpose(1, 2) for f in (self.query, self.key, self.value))
        probs = (q @ k.transpose(-1, -2) / math.sqrt(self.attention_head_size)).softmax(-1)
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, self.all_head_size)
        return self.norm(x + self.output(ctx))


class Encoder(nn.Module):
    def __init__(self, hidden: int = 40, heads: int = 5, ffn: int = 33) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, hidden)
        self.attention = SelfAttention(hidden, heads)
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.classifier = nn.Linear(hidden, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.embed(ids))
        h = self.norm(h + self.down(F.gelu(self.up(h))))
        return self.classifier(h[:, 0])


def test_attention_heads_and_mlp_width_are_removed() -> None:
    torch.manual_seed(0)
    model = Encoder().eval()
    p = prune(model, (torch.randint(0, 50, (2, 9)),), 0.4, keep=("embed",))
    att = p.model.attention
    assert att.num_attention_heads == 3 and att.attention_head_size == 8
    assert att.all_head_size == att.query.out_features == att.output.in_features == 24
    assert att.output.out_features == 40 and p.model.up.out_features == 20
    heads = next(g for g in p.groups if g.name == "the heads of attention")
    assert (heads.kept, heads.unit) == (24, 8)
    assert p.model(torch.randint(0, 50, (3, 13))).shape == (3, 4)
    removed = 3 * 16 * 41 + 16 * 40 + 13 * 41 + 13 * 40  # q, k, v rows + output cols; up, down
    assert p.params_before - p.params_after == removed


def test_dead_heads_are_removed_exactly() -> None:
    torch.manual_seed(1)
    model = Encoder(hidden=32, heads=4).eval()
    att = model.attention
    with torch.no_grad():
        for h in (0, 2):  # heads 0 and 2 write nothing: V rows and output columns are zero
            rows = slice(8 * h, 8 * h + 8)
            for lin in (att.query, att.key, att.value):
                lin.weight[rows] = 0
                lin.bias[rows] = 0
            att.output.weight[:, rows] = 0
    p = prune(model, (torch.randint(0, 50, (2, 7)),), 0.5, keep=("embed", "up"))
    assert p.model.attention.num_attention_heads == 2
    other = torch.randint(0, 50, (2, 11))
    torch.testing.assert_close(p.model(other), model(other), rtol=1e-5, atol=1e-5)


def test_zoo_bert_keeps_heads_its_forward_hard_wires_and_prunes_the_rest() -> None:
    model, (ids,) = bert(batch=2, seq=9, hidden=48, heads=4, intermediate=40)
    p = prune(model.eval(), (ids,), 0.5, keep=("embeddings",))
    heads = [g for g in p.groups if g.name.startswith("the heads of")]
    assert len(heads) == 2 and all("fails with heads removed" in str(g.blocked) for g in heads)
    assert p.model.layers[1].ffn.up.out_features == 20 and p.model.layers[0].attention.heads == 4
    assert p.model(torch.randint(0, 1000, (3, 13))).shape == (3, 3)
    full = prune(model, (ids,), 0.5)  # the hidden width too: heads x head dim == hidden again
    assert (
        full.model.layers[0].attention.heads == 2 and full.model.embeddings.word.embedding_dim == 24
    )


def test_taylor_importance_uses_the_loss_and_leaves_no_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    p = prune(model, (data[0][0],), 0.25, importance="taylor", loss_fn=loss, batches=data)
    assert p.model[0].out_features == 12
    assert all(q.grad is None for q in model.parameters())
    assert all(q.grad is None for q in p.model.parameters())


class HardWired(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h.view(-1, 2, 4).flatten(1))  # splits the features: not followed


def test_refusals_say_why() -> None:
    p = prune(HardWired(), (torch.randn(3, 5),), 0.5)
    g = next(g for g in p.groups if g.name == "a's output features")
    assert g.kept == 8 and "splits or merges their dimension" in str(g.blocked)
    with pytest.raises(RuleError, match="ratio must be in"):
        prune(HardWired(), (torch.randn(3, 5),), 1.0)
    with pytest.raises(RuleError, match="importance must be one of"):
        prune(HardWired(), (torch.randn(3, 5),), 0.5, importance="random")  # type: ignore[arg-type]
    with pytest.raises(RuleError, match="needs loss_fn"):
        prune(HardWired(), (torch.randn(3, 5),), 0.5, importance="taylor")


class Untraceable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return x
        return -x


def test_an_untraceable_model_is_one_sentence() -> None:
    with pytest.raises(RuleError, match="traces the model with torch.fx"):
        prune(Untraceable(), (torch.randn(2, 3),), 0.5)


def test_odd_sizes_keep_at_least_one_channel() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Conv2d(3, 1, 1))
    p = prune(model, (torch.randn(1, 1, 5, 5),), 0.9)
    assert p.model[0].out_channels == 1 and math.isclose(p.ratio, 0.9)


class ShapeReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        n = h.shape[-1] + h.dim()  # reading the shape is not using the channels
        return self.b(h.relu() * (n / n))


def test_reading_a_shape_does_not_block_a_group() -> None:
    p = prune(ShapeReader(), (torch.randn(3, 6),), 0.5)
    assert p.model.a.out_features == p.model.b.in_features == 6


def test_llama_style_decoder_heads_swiglu_and_rms_norm() -> None:
    from opswap.models.zoo_transformer import gpt

    model, (ids,) = gpt(batch=2, seq=11)[:2]
    p = prune(model.eval(), (ids,), 0.5)
    layer = p.model.layers[1]
    assert layer.attn.heads == 2 and layer.attn.q_proj.out_features == layer.attn.o_proj.in_features
    assert layer.mlp.gate.out_features == layer.mlp.up.out_features == layer.mlp.down.in_features
    assert layer.mlp_norm.weight.shape == (p.model.embed.embedding_dim,)  # hand-written RMSNorm
    blocked = {g.name: g.blocked for g in p.groups}
    assert blocked["lm_head's output features"] == "it reaches the model's output"
    assert p.model(torch.randint(0, 1000, (1, 7))).shape == (1, 7, 1000)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a model on the GPU: the GPU suite")
def test_taylor_pruning_of_a_model_on_the_gpu() -> None:
    torch.manual_seed(0)
    model = _realistic(CNN()).cuda()
    data = [(torch.randn(4, 3, 8, 8, device="cuda"), torch.randint(0, 3, (4,), device="cuda"))]

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    p = prune(model, (data[0][0],), 0.5, importance="taylor", loss_fn=loss, batches=data)
    assert p.model.stem.weight.is_cuda and p.model.stem.out_channels == 3
    assert p.model(data[0][0]).shape == (4, 3)
