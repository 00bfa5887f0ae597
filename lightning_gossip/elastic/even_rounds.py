"""Leaving an epoch after the same number of synchronous gossip rounds: :class:`EvenRounds`.

With a shared cursor (an elastic ``dpsgd`` fit) the ranks claim an epoch's batches one at a time,
so they may end the epoch after different numbers of steps, and a synchronous round needs every
rank whose peer it is. Before anything collective (validation, a checkpoint, the next epoch),
each rank therefore *settles*: it posts the next round it would start, and while some live rank
has not posted yet it runs gossip-only rounds (its replica mixed, no gradient), announcing each
before it starts it. The rank whose post completes the set closes it at the largest round
announced, and every rank pads up to that round: all leave at the same step, and every round any
rank started is run by every rank. One key in the c10d store holds the meeting, updated by
compare-and-set, so announcing and closing never interleave.

A rank lost during the meeting ends it for the survivors (a round fails with
:class:`~lightning_gossip.errors.PeerSilent`); after their recovery they meet again under a new
name (the membership's generation is part of it).

>>> import torch.distributed as dist
>>> rounds = EvenRounds(dist.HashStore(), "doc", rank=0, live=lambda: (0,), timeout_s=5)
>>> rounds.settle("epoch0", step=12, pad=lambda step: step + 1)  # alone: nothing to wait for
12
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from lightning_gossip.liveness.heartbeat import store_call

__all__ = ["EvenRounds"]


class EvenRounds:
    """The meeting at which the ranks agree on the step they leave an epoch at.

    Args:
        store: the store every rank reaches (the rendezvous store).
        key: the fit's prefix of the meetings' keys (the same on every rank).
        rank: this rank.
        live: the live ranks (every one of them must settle).
        timeout_s: how long a meeting may take before :class:`TimeoutError` names the ranks
            that did not come.
    """

    def __init__(self, store: dist.Store, key: str, rank: int,
                 live: Callable[[], Sequence[int]], timeout_s: float) -> None:
        self.store, self.key, self.rank = store, key, int(rank)
        self.live, self.timeout_s = live, float(timeout_s)

    def settle(self, name: str, step: int, pad: Callable[[int], int]) -> int:
        """Meet the other live ranks under ``name`` (the same on every rank, new for every
        meeting) with ``step``, this rank's next round; ``pad(step)`` runs a gossip-only round
        at ``step`` and returns the next one. Returns the step every rank leaves at.

        Raises:
            TimeoutError: the meeting did not close within ``timeout_s``, naming the live ranks
                that had not come.
        """
        key = f"{self.key}/{name}"
        deadline = time.monotonic() + self.timeout_s
        closed = self._post(key, step)
        while closed is None:
            if time.monotonic() > deadline:
                state = self._read(key)
                missing = [r for r in self.live() if str(r) not in state["steps"]]
                raise TimeoutError(
                    f"rank {self.rank}: rank(s) {', '.join(map(str, missing))} did not come to "
                    f"the end of the epoch ({name}) within {self.timeout_s:g} s")
            closed = self._post(key, step + 1)  # announce the round first, then run it
            if closed is None:
                step = pad(step)
        while step < closed:
            step = pad(step)
        return step

    def _read(self, key: str) -> dict:
        raw = store_call(lambda: self.store.compare_set(key, "", ""), "reading a meeting")
        return json.loads(raw) if raw else {"steps": {}, "closed": None}

    def _post(self, key: str, step: int) -> int | None:
        """Raise this rank's announced round to ``step`` unless the meeting closed; close it
        when every live rank has come. The closing round, or ``None`` while open."""
        what = "posting this rank's round at the end of an epoch"
        old = store_call(lambda: self.store.compare_set(key, "", ""), what)
        while True:
            state = json.loads(old) if old else {"steps": {}, "closed": None}
            if state["closed"] is not None:
                return int(state["closed"])
            steps = state["steps"]
            steps[str(self.rank)] = max(int(steps.get(str(self.rank), step)), step)
            live = [str(r) for r in self.live()]
            if all(r in steps for r in live):
                state["closed"] = max(int(steps[r]) for r in live)
            new = json.dumps(state, sort_keys=True)
            seen = store_call(lambda o=old, n=new: self.store.compare_set(key, o or "", n), what)
            if seen == new.encode():
                return state["closed"]
            old = seen
