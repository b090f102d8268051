"""opswap's ONNX rules, one per module, in the order a plan runs them: clean-ups first
(folding, transposes, Conv+BN), then the norms and activations, attention, and the
fusions that take what those leave behind (embeddings into EmbedLayerNormalization, a residual into SkipLayerNormalization, a bias
into BiasGelu or Gemm)."""

from __future__ import annotations

from opswap.onnx.rule import OnnxRule
from opswap.onnx.rules.attention import Attention
from opswap.onnx.rules.bias_gelu import BiasGelu
from opswap.onnx.rules.constant_fold import ConstantFold
from opswap.onnx.rules.conv_bn import ConvBn
from opswap.onnx.rules.embed_layer_norm import EmbedLayerNorm
from opswap.onnx.rules.fast_gelu import FastGelu
from opswap.onnx.rules.gelu import Gelu
from opswap.onnx.rules.layer_norm import LayerNorm
from opswap.onnx.rules.matmul_bias import MatMulBias
from opswap.onnx.rules.rms_norm import RmsNorm
from opswap.onnx.rules.skip_layer_norm import SkipLayerNorm
from opswap.onnx.rules.transpose_pair import TransposePair

#: the rules in the order a plan applies them
ORDER: tuple[type[OnnxRule], ...] = (
    ConstantFold,
    TransposePair,
    ConvBn,
    LayerNorm,
    RmsNorm,
    Gelu,
    FastGelu,
    Attention,
    EmbedLayerNorm,
    SkipLayerNorm,
    BiasGelu,
    MatMulBias,
)


def onnx_rules() -> list[OnnxRule]:
    return [r() for r in ORDER]


def rule_named(name: str) -> OnnxRule:
    for r in ORDER:
        if r.name == name:
            return r()
    raise KeyError(name)
