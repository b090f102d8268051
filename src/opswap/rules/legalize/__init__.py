"""Legalisation: rewrites that put a model into an edge delegate's op set
(targets.edge.profiles), so that the delegate takes every compute op instead of leaving
some on the runtime's portable kernels. Each rule keeps the model's function (exact: the
rounding may differ, no more) and pays only where the delegate lacks the op the model
wrote, so every rule targets "edge": the planner offers them for the edge targets
(xnnpack, vulkan, litert-xnnpack, coreml-ane, qnn-htp, ...) and never for a desktop CPU or
a GPU, where they would cost an op or two for nothing.

- legalize.mean_4d: a mean over the last dim of a 2-D or 3-D tensor -> the 4-D mean over
  the last two dims that XNNPACK runs as global average pooling (LayerNorm and RMSNorm
  written out, and what their decompositions make);
- legalize.gelu_erf: GELU written out with erf -> one GELU op (XNNPACK has no erf);
- legalize.matmul_3d: a matmul of two rank-4 tensors (attention's scores and context) ->
  a rank-3 batched matmul (XNNPACK's bmm), with no broadcast copy before it;
- legalize.masked_fill_bias: scores.masked_fill(constant mask, -inf) -> scores plus a
  constant 0 / -inf bias (XNNPACK has no where).
"""
