"""What recall a move of attention density costs or buys, by the length of the documents moved.

Dynamic sparsity tuning's adaptive anchor trades a straggler's recall for step time: it needs the price of a
unit of density cut from (or raised on) a rank's pack. That price depends on the documents: a cut of a long
document costs more recall per unit of density than a price pooled over packs of mostly short documents, and a
pooled price would let the anchor take stragglers' recall it predicted free. So prices are kept per length class
of the pack: the octave of the length where its causal tiles lie (``length_class``), since that is where a cut of
its tiles falls.

A price is per unit of ``log_move``, rho0 ln(rho / rho0) for a move from density rho0 to rho, not per unit of
density: recall is concave in density, so a unit of density cut costs more the deeper the cut and a unit raised
buys less the larger the raise, and per unit of density DST's larger raises would be priced too high from the
probes' 2x raises. Near rho0 the two units agree.

Each report prices the moves it measured against its own base budget (``SparsityReport.priced_moves``: DST's
move, and the price probes' cut and raise where recall is measured), so a class is priced on the first pack of
its length, before DST moves one: the density calibration's forwards price every length before the first step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def log_move(base: float, density: float) -> float:
    """The size of a move of density from ``base`` to ``density`` that prices are kept per: base x ln(density /
    base), the density moved where the move is small (module docstring)."""
    return base * float(np.log(density / base))


def length_class(lengths: Sequence[int]) -> int:
    """The octave of the tile-weighted length of a pack (sum n^3 / sum n^2): a document of n tokens holds about
    n^2 / 2 causal tiles, so the pack's tiles, and the cuts of them, lie mostly in its longest documents."""
    n = np.asarray([x for x in lengths if x > 0], dtype=np.float64)
    if not n.size:
        return 0
    return int(np.floor(np.log2(max((n**3).sum() / (n**2).sum(), 1.0))))


class RecallPrices:
    """Recall lost per unit cut and gained per unit raised (units of ``log_move``), per length class of the pack.

    Cuts and raises are priced apart: a straggler's cut drops the blocks of least mass across its layer, a fast
    rank's raise adds the next blocks of its rows, and where attention is sharp the two prices differ. Each class
    keeps exponentially weighted sums of the size moved (``log_move``) and the recall it cost or bought,
    forgotten only as that class is measured again (a length seen once an epoch keeps its price).

    A class's price is shrunk by ``prior_weight`` units toward the price pooled over every class, and the pool
    toward ``prior``: the calibration's probes measure a fraction of a unit on lengths few of its packs hold, so a
    class's own price shrunk toward the prior would stay mostly the prior's, while the pool is measured on every
    length. A class never measured is priced at the pool; before anything is measured, at the prior, 1.0: recall
    following density, as in the near-uniform regime.
    """

    #: Moves smaller than this (in density) teach nothing: rounding of the kept tiles, not a budget's change.
    MIN_MOVE = 1e-3

    def __init__(self, prior: float = 1.0, decay: float = 0.95, prior_weight: float = 0.05) -> None:
        self.prior, self.decay, self.prior_weight = prior, decay, prior_weight
        self.moments: dict[int, np.ndarray] = {}  # class -> rows cut, raise; columns size moved, recall

    def observe(self, packs: Sequence[tuple[Sequence[int], Sequence[tuple[float, float, float]]]]) -> None:
        """Learn from one step's packs: each one's lengths and its moves, (base density, density moved, recall
        gained) against its base budget."""
        steps: dict[int, np.ndarray] = {}
        for lengths, moves in packs:
            taught = [(base, moved, recall) for base, moved, recall in moves
                      if abs(moved) >= self.MIN_MOVE and base > 0 and base + moved > 0]
            if taught:
                step = steps.setdefault(length_class(lengths), np.zeros((2, 2)))
                for base, moved, recall in taught:
                    step[int(moved > 0)] += [abs(log_move(base, base + moved)), recall * np.sign(moved)]
        for key, step in steps.items():
            self.moments[key] = self.decay * self.moments.get(key, np.zeros((2, 2))) + step

    def prices(self, lengths: Sequence[int]) -> tuple[float, float]:
        """(recall lost per unit cut, recall gained per unit raised; units of ``log_move``) for a pack of
        ``lengths``, each at least 0."""
        return self._prices(length_class(lengths))

    def by_class(self) -> dict[int, tuple[float, float]]:
        """The prices of every length class measured so far (``length_class``), in class order."""
        return {key: self._prices(key) for key in sorted(self.moments)}

    def evidence(self) -> dict[int, tuple[float, float]]:
        """The units of ``log_move`` (cut, raised) that each measured class's prices rest on, decayed as learned,
        in class order: against ``prior_weight`` they say how much of a price is the pool's."""
        return {key: (float(self.moments[key][0, 0]), float(self.moments[key][1, 0])) for key in sorted(self.moments)}

    def _prices(self, key: int) -> tuple[float, float]:
        pool = self._shrunk(sum(self.moments.values(), np.zeros((2, 2))), np.full(2, self.prior))
        cut, raised = np.maximum(self._shrunk(self.moments.get(key, np.zeros((2, 2))), pool), 0.0)
        return float(cut), float(raised)

    def _shrunk(self, moments: np.ndarray, toward: np.ndarray) -> np.ndarray:
        """(cut, raise) prices of ``moments`` with ``prior_weight`` units more at the prices ``toward``."""
        return (moments[:, 1] + toward * self.prior_weight) / (moments[:, 0] + self.prior_weight)

    def state_dict(self) -> dict[str, Any]:
        return {str(key): moments.tolist() for key, moments in sorted(self.moments.items())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.moments = {int(key): np.asarray(moments, dtype=np.float64) for key, moments in state.items()}
