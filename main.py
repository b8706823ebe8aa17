"""Train, validate or test a sparse-attention Qwen2 with SparseBalance: ``python main.py fit --config configs/demo.yaml``."""

from sparsebalance_pl.cli import main

if __name__ == "__main__":
    main()
