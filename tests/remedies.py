"""The cases of ``tests/test_remedies.py`` (the outer optimizer on the global average and the
overlapped node all-reduce), run in the shared launch ``remedies2x2`` (2 torchrun nodes of 2
processes, ``tests/scripts/remedy_cases.py``), and the NumPy reference of the outer step.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from testbed.launch import read_rank_results
from tests.cases import Case

SCRIPT = Path(__file__).parent / "scripts" / "remedy_cases.py"
NODES, DEVICES = 2, 2
WORLD = NODES * DEVICES
EVERY = 3  # global_average_every_n_steps of the dpsgd outer cases

# -- node_allreduce: the same gradients, overlapped or after backward ---------------------------
_HIER = {"final_average": False, "hierarchical": True, "consensus_every_n_steps": None}
_TRAIN = dict(lr=0.5, batchnorm=True, width=8, batches=6, num_nodes=NODES, offset=0.5)
#: 40-byte buckets: every parameter of the tiny model is a bucket of its own (several launches)
_SMALL = {"_bucket_bytes": 40}
OV_DP_AFTER = Case("ov_dp_after", strategy_kwargs=_HIER, **_TRAIN)
OV_DP = Case("ov_dp", strategy_kwargs={**_HIER, **_SMALL, "node_allreduce": "overlapped"},
             **_TRAIN)
OV_DP_ACC_AFTER = replace(OV_DP_AFTER, name="ov_dp_acc_after", accumulate=2, batches=8)
OV_DP_ACC = replace(OV_DP, name="ov_dp_acc", accumulate=2, batches=8)
OV_DP_MANUAL_AFTER = replace(OV_DP_AFTER, name="ov_dp_manual_after", manual=True)
OV_DP_MANUAL = replace(OV_DP, name="ov_dp_manual", manual=True)
#: the default bucket size: the tiny model is one bucket, started when backward is done
OV_DP_ONE_BUCKET = Case("ov_dp_one_bucket",
                        strategy_kwargs={**_HIER, "node_allreduce": "overlapped"}, **_TRAIN)
_AD = {**_HIER, "timeout": 60, "node_allreduce": "overlapped", **_SMALL}
OV_AD = Case("ov_ad", strategy="adpsgd", strategy_kwargs=_AD, epochs=2, **_TRAIN)
OV_AD_ACC = replace(OV_AD, name="ov_ad_acc", accumulate=2, batches=8)
OVERLAP_PAIRS = [(OV_DP_AFTER, OV_DP), (OV_DP_ACC_AFTER, OV_DP_ACC),
                 (OV_DP_MANUAL_AFTER, OV_DP_MANUAL), (OV_DP_AFTER, OV_DP_ONE_BUCKET)]
OVERLAP_CASES = [OV_DP_AFTER, OV_DP, OV_DP_ACC_AFTER, OV_DP_ACC, OV_DP_MANUAL_AFTER,
                 OV_DP_MANUAL, OV_DP_ONE_BUCKET, OV_AD, OV_AD_ACC]

# -- the outer optimizer ------------------------------------------------------------------------
_GA = {"final_average": False, "global_average_every_n_steps": EVERY, "topology": "ring",
       "consensus_every_n_steps": None}
_GA_TRAIN = dict(lr=0.5, batches=7, num_nodes=NODES, offset=1.0, width=4)
GA_PLAIN = Case("ga_plain", strategy_kwargs=_GA, **_GA_TRAIN)
GA_OUTER_ID = Case("ga_outer_id", strategy_kwargs={**_GA, "outer_lr": 1.0}, **_GA_TRAIN)
_MOM = {"outer_lr": 0.7, "outer_momentum": 0.9}
GA_OUTER_MOM = Case("ga_outer_mom", strategy_kwargs={**_GA, **_MOM}, save_checkpoint=True,
                    **_GA_TRAIN)
GA_OUTER_HB = Case("ga_outer_hb", strategy_kwargs={**_GA, **_MOM, "outer_nesterov": False},
                   **_GA_TRAIN)
GA_OUTER_RESUME = replace(GA_OUTER_MOM, name="ga_outer_resume", epochs=2, offset=0.0,
                          save_checkpoint=False, resume_case=GA_OUTER_MOM.name)
#: hierarchical, overlapped node all-reduce and the outer optimizer together
GA_OUTER_HIER = Case("ga_outer_hier", strategy_kwargs={
    **_GA, **_MOM, "hierarchical": True, "node_allreduce": "overlapped", **_SMALL},
    **_GA_TRAIN)
_AD_GA = {"final_average": False, "global_average_every_n_steps": 2, "timeout": 60,
          "consensus_every_n_steps": None}
_AD_TRAIN = dict(strategy="adpsgd", lr=0.3, batches=6, epochs=2, num_nodes=NODES, offset=1.0,
                 width=4)
AD_OUTER_ID = Case("ad_outer_id", strategy_kwargs={**_AD_GA, "outer_lr": 1.0}, **_AD_TRAIN)
AD_OUTER_MOM = Case("ad_outer_mom", strategy_kwargs={**_AD_GA, **_MOM}, **_AD_TRAIN)
OUTER_CASES = [GA_PLAIN, GA_OUTER_ID, GA_OUTER_MOM, GA_OUTER_HB, GA_OUTER_RESUME, GA_OUTER_HIER,
               AD_OUTER_ID, AD_OUTER_MOM]

CASES = [*OVERLAP_CASES, *OUTER_CASES]


def results(folder: Path, case: Case) -> list[dict]:
    """Every rank's JSON of ``case``, in global-rank order."""
    return read_rank_results(folder / case.name, WORLD)


def outer_reference(anchor: np.ndarray, averages: list[np.ndarray], lr: float, momentum: float,
                    nesterov: bool = True, buffer: np.ndarray | None = None
                    ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The points the outer optimizer goes to from ``anchor`` given the exact ``averages`` of
    successive global averages (fp64), the last anchor and the momentum buffer.

    >>> pts, anchor, m = outer_reference(np.zeros(1), [np.ones(1), np.ones(1)], 0.5, 0.5)
    >>> [float(p[0]) for p in pts]  # m=-1: 0-0.5*(-1-0.5); then d=-0.25, m=-0.75
    [0.75, 1.0625]
    """
    x = np.asarray(anchor, dtype=np.float64)
    m = np.zeros_like(x) if buffer is None else np.asarray(buffer, dtype=np.float64)
    points = []
    for avg in averages:
        delta = x - avg
        m = momentum * m + delta
        x = x - lr * ((delta + momentum * m) if nesterov else m)
        points.append(x)
    return points, x, m
