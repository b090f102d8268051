"""hf_small.shrink: small configs whose dependent sizes still agree, so the model runs."""

from __future__ import annotations

import pytest
import torch

from opswap.models import load
from opswap.models.hf import hf_config

pytestmark = pytest.mark.hf

# Vision types transformers builds from a config whose sizes depend on one another:
# efficientnet's last width is round_filters(1280) under its width coefficient,
# hgnet_v2's per-stage channel lists must follow hidden_sizes, bit's GroupNorm groups
# must divide every width, textnet's stem feeds its first stage, mobilevitv2 needs an
# image its 32x downsampling leaves a patch of, hiera a fixed image its mask units tile.
DEPENDENT = ["efficientnet", "hgnet_v2", "bit", "textnet", "mobilevitv2", "hiera"]


@pytest.mark.parametrize("model_type", DEPENDENT)
def test_a_shrunk_vision_config_runs_on_its_own_example_and_another_batch(model_type):
    loaded = load(f"hf:{model_type}")
    assert sum(p.numel() for p in loaded.module.parameters()) < 2_000_000
    (pixels,) = loaded.example_inputs
    other = torch.randn(3, *pixels.shape[1:])
    with torch.no_grad():
        for x in (pixels, other):
            out = loaded.module(x)
            assert out[0].shape == (x.shape[0], loaded.module.config.num_labels), model_type
            assert all(torch.isfinite(o).all() for o in out)


def test_efficientnet_keeps_its_last_width_with_the_width_coefficient():
    config = hf_config("efficientnet")
    assert config.width_coefficient < 2.0
    assert (
        config.hidden_dim == 1280 * config.width_coefficient
    )  # round_filters(1280), a multiple of 8


def test_group_counts_divide_every_shrunk_width():
    config = hf_config("bit")
    for width in (config.embedding_size, *config.hidden_sizes):
        assert width % config.num_groups == 0
