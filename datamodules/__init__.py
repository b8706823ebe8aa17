"""Data: litdata corpora, packing and sparsity-aware batching."""
