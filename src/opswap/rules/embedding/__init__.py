"""Chapter 18: embeddings. A lookup pooled over its bag (`emb(idx).sum(1)`, `.mean(1)`,
weighted per sample) as one EmbeddingBag; the bags of several tables looked up from one
batch as one table-batched kernel over the concatenated tables; and tables stored in
int8 or float16, dequantized as the kernel reads them.
"""
