"""The registry of convolution algorithms: sites, names, one-sentence errors."""

from __future__ import annotations

import pytest
import torch

from opswap.kernels import conv_algorithms as ca


def test_site_output_sizes_follow_pytorch() -> None:
    x = torch.randn(2, 6, 13, 9)
    w = torch.randn(4, 3, 3, 5)
    site = ca.site_of(x, w, (2, 1), (1, 2), (1, 2), 2)
    y = torch.nn.functional.conv2d(x, w, None, (2, 1), (1, 2), (1, 2), 2)
    assert site.output_spatial == tuple(y.shape[2:])
    assert site.dims == 2 and site.kernel == (3, 5)
    assert site.direct_multiplications() == 2 * 4 * y.shape[2] * y.shape[3] * 3 * 15


def test_unknown_algorithm_is_one_sentence() -> None:
    with pytest.raises(ca.ConvAlgorithmError, match="no convolution algorithm called 'nope'"):
        ca.get("nope")


def test_every_registered_algorithm_names_a_registered_op() -> None:
    for algorithm in ca.algorithms():
        assert str(algorithm.op).startswith("opswap."), algorithm.name
