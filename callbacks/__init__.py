"""Lightning callbacks of SparseBalance."""
