"""The accuracy test every approximate convolution algorithm passes before it is raced.

An algorithm that rounds differently from the direct convolution (Winograd's transforms,
the FFT's) is judged against a float64 direct convolution of the same inputs, beside
PyTorch's own convolution in the same dtype: rule `conv.algorithm` accepts it at a site
only where its error is at most twice PyTorch's. Inputs and weights are random (drawn
in float64, rounded to the site's dtype, and that rounded value is what every route
sees), at the site's shapes and settings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opswap.kernels.conv_algorithms import ConvAlgorithm, ConvSite

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


def error_against_float64(
    algorithm: ConvAlgorithm, site: ConvSite, samples: int = 1, seed: int = 0
) -> tuple[float, float]:
    """(relative L2 error of `algorithm` in the site's dtype, that of PyTorch's conv in the
    same dtype), both against a float64 direct convolution of the same rounded inputs;
    the largest over `samples` draws."""
    gen = torch.Generator().manual_seed(seed)
    conv = _CONV[site.dims]
    mine = theirs = 0.0
    for _ in range(samples):
        x = torch.randn(site.input_shape, generator=gen, dtype=torch.float64)
        w = torch.randn(site.weight_shape, generator=gen, dtype=torch.float64)
        b = torch.randn(site.weight_shape[0], generator=gen, dtype=torch.float64)
        x, w, b = (t.to(site.dtype).to(site.device) for t in (x, w, b))
        settings = (site.stride, site.padding, site.dilation, site.groups)
        with torch.no_grad():
            want = conv(x.double(), w.double(), b.double(), *settings)
            got = algorithm(x, w, b, site)
            ref = conv(x, w, b, *settings)
        mine = max(mine, _rel_l2(got, want))
        theirs = max(theirs, _rel_l2(ref, want))
    return mine, theirs
