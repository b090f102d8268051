"""Chapter 7: sparsity. Weights with zeros only pay where a kernel skips them: 2:4
semi-structured weights on NVIDIA's sparse tensor cores (`sparsity.semi_structured`,
cuSPARSELt or CUTLASS through `torch.sparse.to_sparse_semi_structured`), and weights
pruned to 90% and more stored as CSR/BSR and multiplied by torch.sparse
(`sparsity.unstructured`). Both are lossy (pruning changes the function), both are
raced against the dense layer at the site's own shape and kept only where they win.
Structured pruning, which makes the layers physically smaller instead, is
`opswap.train.prune`; fine-tuning with the mask kept is `opswap.train.finetune_sparse`.
"""
