"""The fits of the communication budget (``gossip_every_n_steps``) tests, and the NumPy
references they are compared with.

They run in the shared 2x2 torchrun launch (``world4`` in ``tests/shared_runs.py``): flat
4-rank cases and one hierarchical case over the 2 nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from tests.cases import DP_BASE, Case
from tests.multinode import W2

PERIOD = 3
_AD = {"final_average": False, "consensus_every_n_steps": 1, "timeout": 60}
_DP = {**DP_BASE, "gossip_every_n_steps": PERIOD}
#: overlapped rounds (the default): 10 steps, rounds at 2, 5, 8; round 11 is posted at step 9
#: and applied when the fit ends
PD_OVERLAP = Case("pd_overlap", strategy_kwargs=_DP, offset=1.0, batches=10,
                  exact_topology="random_ring")
#: blocking rounds on a deterministic time-varying topology (its cycle of 2 shares no factor
#: with 3: the rounds alternate its two hops)
PD_BLOCKING = Case("pd_blocking", offset=1.0, batches=10, exact_topology="one_peer_exponential",
                   strategy_kwargs={**_DP, "topology": "one_peer_exponential", "overlap": False})
PD_DELAY = Case("pd_delay", strategy_kwargs={**_DP, "delay_by_one": True}, offset=1.0,
                batches=10, exact_topology="random_ring", exact_delay_by_one=True)
#: every rank stops (Lightning's should_stop, as EarlyStopping does) after 7 steps, with the
#: round of steps 6-8 in flight
PD_STOP = Case("pd_stop", strategy_kwargs=_DP, offset=1.0, batches=10, stop_at=7,
               exact_topology="random_ring")
#: sharded rounds in bf16 (the mean-preserving compressed form), period 4
PD_BF16 = Case("pd_bf16", offset=1.0, batches=12, strategy_kwargs={
    **DP_BASE, "topology": "ring", "wire_dtype": "bf16", "gossip_every_n_steps": 4})
#: the smallest budget asked for: 1/32 of a bf16 replica per peer and step (2 rounds in 64 steps)
PD_BF16_32 = Case("pd_bf16_32", offset=1.0, batches=64, strategy_kwargs={
    **DP_BASE, "topology": "ring", "wire_dtype": "bf16", "gossip_every_n_steps": 32})
#: hierarchical: 2 nodes of 2, the node matrix W2 at every second step
PD_HIER = Case("pd_hier", num_nodes=2, offset=1.0, batches=7, strategy_kwargs={
    "final_average": False, "hierarchical": True, "topology": W2, "gossip_every_n_steps": 2})
#: max_staleness 0: an active rank waits for each exchange, so it exchanges exactly once
#: every PERIOD steps
#: (without the shared cursor every rank trains its own equal share: under load the cursor gave
#: an active rank 10 steps, fewer than the three periods the test counts on)
AD_PERIOD = Case("ad_period", strategy="adpsgd", offset=1.0, epochs=3, log=True,
                 strategy_kwargs={**_AD, "gossip_every_n_steps": PERIOD, "max_staleness": 0,
                                  "shared_cursor": False})
AD_PERIOD_DELAY = Case("ad_period_delay", strategy="adpsgd", offset=1.0, epochs=3, log=True,
                       strategy_kwargs={**_AD, "gossip_every_n_steps": 4, "delay_by_one": True,
                                        "pairing": "random", "seed": 3, "shared_cursor": False})
#: hierarchical AD-PSGD between the 2 nodes (each local rank gossips its slice), every 3 steps
AH_PERIOD = Case("ah_period", strategy="adpsgd", offset=1.0, epochs=3, log=True, num_nodes=2,
                 strategy_kwargs={**_AD, "hierarchical": True, "gossip_every_n_steps": PERIOD,
                                  "max_staleness": 0})
#: gossip_every_n_steps="auto" with its settings injected (AutoPeriod): a decision after 4
#: steps (1 of warm-up, 3 measured), re-checked every 4; a margin of 1e6 asks for more than
#: max_period steps whatever is measured (max_period 3), one of 1e-6 for 1 step: the periods
#: are the policy's for the recorded values, without a timing assumption
AUTO = {"warmup_steps": 1, "measure_steps": 3, "recheck_every": 4, "max_period": 3}
PD_AUTO = Case("pd_auto", strategy_kwargs=DP_BASE, offset=1.0, batches=12, log=True,
               auto_period={**AUTO, "margin": 1e6})
PD_AUTO_FAST = Case("pd_auto_fast", strategy_kwargs=DP_BASE, offset=1.0, batches=8,
                    auto_period={**AUTO, "margin": 1e-6})
#: the plain string: the default settings (a decision after 10 steps), whatever period it picks
PD_AUTO_DEFAULT = Case("pd_auto_default", offset=1.0, batches=12,
                       strategy_kwargs={**DP_BASE, "gossip_every_n_steps": "auto"})
#: hierarchical over the 2 nodes: the column exchange and the node's all-gather, max_period 2
PH_AUTO = Case("ph_auto", num_nodes=2, offset=1.0, batches=8,
               auto_period={**AUTO, "margin": 1e6, "max_period": 2},
               strategy_kwargs={"final_average": False, "hierarchical": True, "topology": W2})
#: adpsgd: each rank decides for itself; without the shared cursor every rank takes its 6
#: batches an epoch (18 steps: a rank that the shared cursor starves under load could take too
#: few to decide)
AD_AUTO = Case("ad_auto", strategy="adpsgd", offset=1.0, epochs=3, log=True,
               auto_period={**AUTO, "margin": 1e6},
               strategy_kwargs={**_AD, "shared_cursor": False})
AUTO_CASES = [PD_AUTO, PD_AUTO_FAST, PD_AUTO_DEFAULT, PH_AUTO, AD_AUTO]
DPSGD_CASES = [PD_OVERLAP, PD_BLOCKING, PD_DELAY, PD_STOP, PD_BF16, PD_BF16_32]
#: in launch order, on the launch's 2 nodes (the flat cases do not depend on them)
CASES = [replace(c, num_nodes=2)
         for c in (*DPSGD_CASES, PD_HIER, AD_PERIOD, AD_PERIOD_DELAY, AH_PERIOD, *AUTO_CASES)]


def expected_rounds(x0: np.ndarray, matrix: Callable[[int], np.ndarray], steps: int,
                    period: int, overlap: bool = True, delay_by_one: bool = False,
                    start: int = 0) -> list[np.ndarray]:
    """Replicas after each of ``steps`` steps (from step ``start``) with lr = 0, then after the
    fit's end (the rounds in flight applied): only the exchange steps ``e``
    (``(e + 1) % period == 0``) mix, with ``matrix(e)``. Overlapped, the round snapshots ``X``
    at the period's first step and adds ``(W_e - I) X_snapshot`` after step ``e``
    (``delay_by_one``: after step ``e + 1``); blocking, ``X <- W_e X`` after step ``e``."""
    eye = np.eye(len(x0))
    x, xs = x0.copy(), []
    pending: list[tuple[int, int, np.ndarray]] = []  # (apply after step, e, snapshot)
    for t in range(start, start + steps):
        if overlap and t % period == 0:
            e = t + period - 1
            pending.append((e + (1 if delay_by_one else 0), e, x.copy()))
        if not overlap and (t + 1) % period == 0:
            x = matrix(t) @ x
        while pending and pending[0][0] <= t:
            _, e, snap = pending.pop(0)
            x = x + (matrix(e) - eye) @ snap
        xs.append(x.copy())
    for _, e, snap in pending:
        x = x + (matrix(e) - eye) @ snap
    xs.append(x)
    return xs


def rounds_posted(steps: int, period: int, overlap: bool = True) -> int:
    """The rounds a rank posts in ``steps`` steps (overlapped: one per period begun)."""
    return -(-steps // period) if overlap else steps // period
