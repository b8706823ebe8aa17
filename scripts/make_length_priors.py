"""Summarise the shared document-length samples into the small quantile tables shipped with the package.

The synthetic corpus draws document lengths from these tables (inverse-CDF sampling), so the package needs
no copy of the full samples. Run from the repository root:

    python scripts/make_length_priors.py --data ../shared/data
"""

import argparse
import json
from pathlib import Path

import numpy as np

NUM_QUANTILES = 1001


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data", help="folder with doclens_*.json lists")
    parser.add_argument("--out", default="sparsebalance_pl/resources")
    args = parser.parse_args()
    for source in sorted(Path(args.data).glob("doclens_*.json")):
        lengths = np.asarray(json.loads(source.read_text()), dtype=np.float64)
        quantiles = np.quantile(lengths, np.linspace(0.0, 1.0, NUM_QUANTILES))
        table = {
            "source": source.name,
            "documents": int(lengths.size),
            "mean": float(lengths.mean()),
            "quantiles": [round(float(q), 1) for q in quantiles],
        }
        out = Path(args.out) / f"{source.stem}_quantiles.json"
        out.write_text(json.dumps(table) + "\n")
        print(f"{source.name}: {lengths.size} documents -> {out}")


if __name__ == "__main__":
    main()
