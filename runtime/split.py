"""An exact weighted traffic split, for canaries without a service mesh.

The stable pods' runtime forwards a weighted share of its requests to the canary Service (over the
remote path ensembles already use); :class:`WeightedSplit` decides which ones. It is a credit
counter, not a coin: after any ``n`` requests the canary has had ``floor(n * percent / 100)`` of
them, so the split is exact to within one request at every moment and spread evenly (5 % is every
20th request), where a random choice drifts by ``sqrt(n)`` and a replica-proportional split can
only take the ratios replica counts allow (bench/split_accuracy.py measures both). One instance per
event loop; no lock (the loop is one thread). Pure: no I/O.
"""

from __future__ import annotations


class WeightedSplit:
    def __init__(self, percent: int) -> None:
        if not 0 <= percent <= 100:
            raise ValueError(f"percent must be from 0 to 100, got {percent}")
        self.percent = percent
        self._credit = 0

    def to_canary(self) -> bool:
        """Whether the next request goes to the canary."""
        self._credit += self.percent
        if self._credit >= 100:
            self._credit -= 100
            return True
        return False

    def reweigh(self, percent: int) -> None:
        """Move to a new weight (a canary step) without a burst: the credit carried over is kept
        below one request."""
        if not 0 <= percent <= 100:
            raise ValueError(f"percent must be from 0 to 100, got {percent}")
        self.percent = percent
        self._credit = min(self._credit, 99)
