"""Chapter 13: pooling. Exact rewrites first: AdaptiveAvgPool(1) is a mean over the
spatial dims (and folds the flatten after it), and an average pool after a 1x1 conv runs
before it (linear maps commute), so the conv sees k*k fewer pixels. Then the lossy ones,
each with accuracy on the digits task before and after fine-tuning
(opswap.train.finetune_pooling): MaxPool -> AvgPool, AvgPool -> a depthwise strided
conv (exact at its initialisation, then trainable), and flatten + Linear -> global
average pooling + a C-wide Linear.
"""
