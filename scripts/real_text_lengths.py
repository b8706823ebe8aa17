"""Tokens per document of the ``installed`` real-text corpus against the shared real length distributions.

Prints a markdown table (documents, mean, quantiles, share of documents and of tokens above 8K) for the files
``data.corpus.source=installed`` picks, whole and as split at ``--max_doc_tokens`` for training, beside
``doclens_*.json`` of the shared data folder. Run from the repository root after ``python main.py convert``:

    python scripts/real_text_lengths.py --tokenizer data/smollm2-135m --data ../shared/data
"""

import argparse
import json
from pathlib import Path

import numpy as np

from sparsebalance_pl.datamodules.builder import InstalledTextSource, default_real_text_roots, read_documents
from sparsebalance_pl.datamodules.tokenizer import load_tokenizer

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
LONG = 8192


def row(name: str, lengths: np.ndarray) -> str:
    quantiles = " | ".join(f"{np.quantile(lengths, q):,.0f}" for q in QUANTILES)
    long = lengths > LONG
    return (f"| {name} | {lengths.size:,} | {lengths.mean():,.0f} | {quantiles} | {lengths.max():,} | "
            f"{long.mean():.1%} | {lengths[long].sum() / lengths.sum():.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="data/smollm2-135m", help="as data.corpus.tokenizer")
    parser.add_argument("--data", default="../shared/data", help="folder with doclens_*.json lists")
    parser.add_argument("--roots", nargs="*", default=None, help="as data.corpus.roots (default: site-packages "
                        "and /usr/share/common-licenses)")
    parser.add_argument("--max_files", type=int, default=2000)
    parser.add_argument("--max_doc_tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    source = InstalledTextSource.scan(args.roots or default_real_text_roots(), args.max_files, args.seed)
    whole = np.array([len(tokenizer.encode(text)) + 1 for file in source.files for _, text in read_documents(file)
                      if text.strip()])
    pieces = np.concatenate([np.minimum(args.max_doc_tokens, n - np.arange(0, n, args.max_doc_tokens))
                             for n in whole])
    print(f"tokens per document ({tokenizer.name}, end-of-document token included)\n")
    print("| corpus | documents | mean | " + " | ".join(f"p{round(100 * q)}" for q in QUANTILES)
          + f" | max | docs > {LONG // 1024}K | tokens in docs > {LONG // 1024}K |")
    print("|---" * (6 + len(QUANTILES)) + "|")
    print(row(f"installed, {len(source.files)} files", whole))
    print(row(f"installed, split at {args.max_doc_tokens}", pieces))
    for shared in sorted(Path(args.data).glob("doclens_*.json")):
        print(row(shared.stem.removeprefix("doclens_"), np.asarray(json.loads(shared.read_text()), dtype=np.int64)))


if __name__ == "__main__":
    main()
