"""How far a convolution algorithm errs at a site, next to how far PyTorch's own conv errs
in the same dtype, both against a float64 conv: the yardstick of the `approx` algorithms
(Winograd, FFT), which a site accepts only where the first is at most a small multiple of
the second.

The error is the relative L2 norm ||y - y64|| / ||y64|| over the whole output, with the
input drawn from N(0, 1) and the weight from N(0, 1 / fan_in) (so that outputs stay near
unit size in every dtype), at the site's shapes with its batch capped at `MAX_BATCH`:
the error of a convolution does not grow with the batch, its cost does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from opswap.kernels.conv_algorithms import ConvAlgorithm, ConvAlgorithmError, ConvSite

#: the largest batch drawn to measure a site's error
MAX_BATCH = 2
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _rel_l2(y: torch.Tensor, truth: torch.Tensor) -> float:
    denom = float(truth.norm())
    return float((y.double() - truth).norm()) / denom if denom > 0 else float((y.double()).norm())


def error_against_float64(
    algorithm: ConvAlgorithm, site: ConvSite, samples: int = 1, seed: int = 0
) -> tuple[float, float]:
    """(the algorithm's relative L2 error, PyTorch's conv's relative L2 error), each in the
    site's dtype and on its device against a float64 conv of the same (rounded) inputs; the
    worst over `samples` draws. A site the algorithm refuses is refused here too."""
    why = algorithm.refuses(site)
    if why is not None:
        raise ConvAlgorithmError(f"{algorithm.name} cannot run this site: {why}.")
    if site.device == "cuda" and not torch.cuda.is_available():
        raise ConvAlgorithmError("the site is on CUDA and this machine has no CUDA device.")
    if samples < 1:
        raise ConvAlgorithmError(f"samples must be at least 1, not {samples}.")
    gen = torch.Generator().manual_seed(seed)
    shape = (min(site.input_shape[0], MAX_BATCH), *site.input_shape[1:])
    fan_in = site.weight_shape[1] * math.prod(site.kernel)
    conv = _CONV[site.dims]
    worst_alg = worst_torch = 0.0
    for _ in range(samples):
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        w = torch.randn(site.weight_shape, generator=gen, dtype=torch.float64)
        w /= math.sqrt(fan_in)
        b = torch.randn(site.weight_shape[0], generator=gen, dtype=torch.float64) * 0.1
        x, w, b = (t.to(site.device, site.dtype) for t in (x, w, b))  # round once
        args = (site.stride, site.padding, site.dilation, site.groups)
        truth = conv(x.double(), w.double(), b.double(), *args)
        with torch.inference_mode():
            y_alg = algorithm(x, w, b, site)
            y_torch = conv(x, w, b, *args)
        worst_alg = max(worst_alg, _rel_l2(y_alg, truth))
        worst_torch = max(worst_torch, _rel_l2(y_torch, truth))
    return worst_alg, worst_torch
