"""Chapter 11: convolution. A dense convolution replaced by cheaper ones that compute
(nearly) the same map: the lossy decompositions here (low-rank SVD splits, CP,
depthwise-separable, large kernel to stacked 3x3), fitted from the trained weight."""
