"""The zoo: small reference models that contain, on purpose, what the rules look for.

Every zoo model is FX-symbolically traceable, in eval mode, built from a seed
(same weights and inputs on every load) and runs one forward in milliseconds on
a CPU. Builders live in zoo_cnn.py, zoo_transformer.py, zoo_misc.py and zoo_digits.py;
their keyword arguments are the overrides `--set key=value` accepts, and their
docstrings list the patterns each model holds. The digits models are trained on a real
task (scikit-learn's digits, cached after the first load) and come with it: a builder
may return (module, inputs, task), and the task is the LoadedModel's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opswap.errors import SpecError
from opswap.models._common import LoadedModel, builder_defaults, resolve_kwargs
from opswap.models.zoo_cnn import largekernel, longconv, mobilenet, resnet
from opswap.models.zoo_digits import digits_cnn, digits_mlp
from opswap.models.zoo_misc import recsys, seq_model
from opswap.models.zoo_transformer import bert, gpt


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: its name, a one-line description, and the chapters it exercises."""

    name: str
    description: str
    chapters: tuple[int, ...]
    builder: Callable[..., tuple]

    @property
    def defaults(self) -> dict[str, Any]:
        """The overridable builder arguments and their default values."""
        return builder_defaults(self.builder)

    @property
    def patterns(self) -> str:
        """The builder's docstring: the patterns the model holds, in words."""
        return (self.builder.__doc__ or "").strip()


_ENTRIES = (
    ZooEntry(
        "resnet",
        "ResNet-style CNN: Conv+BN+ReLU, residual blocks, Linear+BatchNorm1d head",
        (4, 9, 11, 13),
        resnet,
    ),
    ZooEntry(
        "mobilenet",
        "MobileNetV2/V3-style CNN: inverted residuals, depthwise conv, "
        "squeeze-excitation, ReLU6/hardswish/hardsigmoid",
        (4, 9, 11, 13),
        mobilenet,
    ),
    ZooEntry(
        "bert",
        "BERT-style encoder with hand-written attention, LayerNorm and GELU",
        (4, 8, 9, 10, 14, 16),
        bert,
    ),
    ZooEntry(
        "gpt",
        "LLaMA-style decoder: hand-written RMSNorm, rotary, causal attention, SiLU-gated MLP",
        (8, 9, 10, 16, 29),
        gpt,
    ),
    ZooEntry(
        "seq", "Recurrent classifier: LSTM then GRU, Linear head on the last step", (19,), seq_model
    ),
    ZooEntry(
        "recsys",
        "DLRM-style recommender: embedding tables, bag pooling, MLPs, sigmoid",
        (18,),
        recsys,
    ),
    ZooEntry(
        "largekernel",
        "CNN with 7x7/11x11/13x13 and 5x5 convs, max/avg/adaptive pooling",
        (5, 11, 13),
        largekernel,
    ),
    ZooEntry(
        "longconv",
        "Long-convolution 1-D sequence model: kernel-127 Conv1d+ReLU token mixing, "
        "pointwise mixing, residuals",
        (4, 11, 25),
        longconv,
    ),
    ZooEntry(
        "digits_mlp",
        "MLP trained on scikit-learn's 8x8 digits, with its top-1 task (needs scikit-learn)",
        (6,),
        digits_mlp,
    ),
    ZooEntry(
        "digits_cnn",
        "Small Conv+BN+ReLU CNN trained on scikit-learn's 8x8 digits, with its top-1 task "
        "(needs scikit-learn)",
        (6,),
        digits_cnn,
    ),
)
ZOO: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}


def list_zoo() -> list[ZooEntry]:
    """Every zoo model, in a stable order."""
    return list(_ENTRIES)


def load_zoo(name: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """Build zoo model `name` with `overrides` (already parsed) applied to its builder."""
    entry = ZOO.get(name)
    if entry is None:
        raise SpecError(f"Unknown zoo model '{name}'; the zoo has: {', '.join(ZOO)}.")
    kwargs = resolve_kwargs(entry.builder, overrides, f"zoo:{name}")
    module, inputs, *task = entry.builder(**kwargs)
    return LoadedModel(
        name=name,
        spec=spec,
        source="zoo",
        module=module,
        example_inputs=inputs,
        description=entry.description,
        settings=kwargs,
        task=task[0] if task else None,
    )
