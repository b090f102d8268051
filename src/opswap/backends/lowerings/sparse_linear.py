"""opswap::sparse_linear has no lowering: ONNX has no sparse matrix product, and writing
the weight out dense would undo what the layer is for."""

from __future__ import annotations

from opswap.backends.lowerings._registry import no_lowering

no_lowering(
    "opswap::sparse_linear",
    "a CSR/BSR sparse product, which ONNX has no operator for; export the model planned "
    "without sparsity.unstructured (its weights written dense)",
    __name__,
)
