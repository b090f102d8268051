"""The training side of operator replacement: modules that change a model by training it
rather than by rewriting its graph alone.

- `opswap.train.qat`: quantisation-aware training for the static int8 rules (chapter 6);
- `opswap.train.norm_swap`: BatchNorm to GroupNorm/LayerNorm with distillation (chapter 10);
- `opswap.train.distill_conv`: convolutions decomposed (low rank, CP, depthwise-separable,
  stacked 3x3), distilled layer by layer and fine-tuned on a task (chapter 11);
- `opswap.train.prune`: structured pruning over a dependency graph of the model (channels,
  attention heads, MLP width), physically smaller; `opswap.train.finetune_sparse`
  fine-tunes a pruned or 2:4-masked model with its mask kept (chapter 7).

- `opswap.train.losses`: the fused linear + cross-entropy loss, logits never held in full
  (chapter 27);
- `opswap.train.optim`: AdamW with a fused step and float32 moment estimates (chapter 27).
- `opswap.train.prepare(model, example_batch, loss_fn)`: the model and its loss rewritten
  with the rules valid in training, gradients checked against eager (chapter 27; the
  function, re-exported here, shadows its module's name: import the module's other names
  with `from opswap.train.prepare import ...`); `opswap.train.verify_grads` and
  `opswap.train.race` (the training-step race) beside it; `opswap.train.precision`:
  its bf16/fp16 autocast (softmax, norms and loss kept in float32) and fp8 Linears.
- `opswap.train.distributed`: a prepared model wrapped in DistributedDataParallel or sharded
  by FSDP2's `fully_shard`, and its trained weights gathered back (chapter 27).

The fine-tuning modules share one short loop (`train._loop`).
"""

from opswap.train.prepare import Prepared, PrepareError, PrepareReport, prepare

__all__ = ["PrepareError", "PrepareReport", "Prepared", "prepare"]
