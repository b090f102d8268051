import pytest
import torch
from torch import nn

from opswap.api import capture
from opswap.errors import CaptureError
from opswap.graph import info


class Branchy(nn.Module):
    """Python control flow on a shape: FX cannot trace it, torch.export specialises it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        y = self.lin(x)
        if x.shape[0] > 1:  # a Python branch on a shape: FX cannot follow it, export specialises
            y = y * 2
        return y


class Hopeless(nn.Module):
    def forward(self, x):
        n = int(x.abs().sum().item() * 0) + 3  # .item() into a shape: neither path can follow
        return x.new_zeros(n) + torch.tensor(float(x.sum() > 0))


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.bn = nn.BatchNorm2d(5)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).mean((2, 3))


def test_fx_path_keeps_module_leaves_and_shapes():
    m = Small().eval()
    x = torch.randn(3, 3, 7, 9)
    c = capture(m, (x,))
    assert c.method == "fx"
    mods = [n.target for n in c.gm.graph.nodes if n.op == "call_module"]
    assert mods == ["conv", "bn"]
    conv = next(n for n in c.gm.graph.nodes if n.target == "conv")
    assert info(conv).shape == (3, 5, 7, 9)
    assert info(conv).dtype == torch.float32
    torch.testing.assert_close(c.gm(x), m(x))


def test_capture_never_shares_weights_with_the_user_model():
    m = Small().eval()
    c = capture(m, torch.randn(2, 3, 5, 5))
    with torch.no_grad():
        c.gm.conv.weight.mul_(0)
    assert m.conv.weight.abs().sum() > 0


def test_fallback_to_export_when_fx_fails():
    m = Branchy().eval()
    x = torch.randn(4, 6)
    c = capture(m, (x,))
    assert c.method == "export"
    assert any("FX symbolic tracing failed" in n for n in c.notes)
    torch.testing.assert_close(c.gm(x), m(x))
    assert any(info(n) is not None for n in c.gm.graph.nodes if n.op == "call_function")


def test_method_fx_only_raises_with_the_line():
    with pytest.raises(CaptureError, match="test_capture.py"):
        capture(Branchy().eval(), (torch.randn(2, 6),), method="fx")


def test_neither_path_names_the_untraceable_line():
    with pytest.raises(CaptureError) as e:
        capture(Hopeless(), (torch.randn(2, 2),))
    msg = str(e.value)
    assert "FX symbolic tracing failed" in msg and "torch.export failed" in msg
    assert "test_capture.py:" in msg


def test_not_a_module():
    with pytest.raises(CaptureError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2),))


def test_training_mode_is_noted_not_changed():
    m = Small().train()
    c = capture(m, (torch.randn(2, 3, 4, 4),))
    assert m.training
    assert any("training mode" in n for n in c.notes)


def test_a_whisper_model_at_batch_1_is_captured_without_a_printed_traceback(capfd):
    transformers = pytest.importorskip("transformers")
    from opswap.graph.keywords import keyword_call

    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=96,
        num_mel_bins=12,
        encoder_layers=1,
        decoder_layers=1,
        d_model=24,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=40,
        decoder_ffn_dim=40,
        max_source_positions=14,
        max_target_positions=12,
        use_cache=False,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        decoder_start_token_id=2,
        attn_implementation="eager",
    )
    model = transformers.WhisperModel(config).eval()
    # whisper takes exactly 2 * max_source_positions frames; batch 1, 5 decoder tokens
    inputs = {
        "input_features": torch.randn(1, 12, 28),
        "decoder_input_ids": torch.randint(0, 96, (1, 5)),
    }
    capfd.readouterr()
    c = capture(*keyword_call(model, inputs))
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    said = [n for n in c.notes if n.startswith("batch kept static")]
    assert len(said) == 1 and "\n" not in said[0] and "ShapeProp" not in said[0]
    assert "batch" not in [a.name for a in c.dynamic.axes]
