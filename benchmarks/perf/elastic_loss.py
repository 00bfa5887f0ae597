"""What a lost rank costs an elastic ``adpsgd`` (or ``dpsgd``) fit: detection, recovery, the
survivors' stall, the data and the final loss, against the same fit without a loss.

Each repeat runs ``testbed.elastic_fit`` twice on 4 ranks started as ``srun`` starts tasks
(gloo, loopback, ``heartbeat_timeout=3``), once with rank 2 killed (``SIGKILL``) at the start of
its 7th batch of epoch 0 and once without a loss, in alternating order. Measured per loss run,
from the ranks' wall clocks (one machine):

* ``detect_s``: the kill to the first survivor's recovery (the heartbeat's finding);
* ``recover_s``: the longest survivor recovery (gather in the store, new groups, batches back
  to the cursor, a new gossip engine);
* ``stall_s``: the longest time any survivor went without finishing a batch, from the kill on
  (the goal: at most ``heartbeat_timeout + 5`` s); ``step_s``: the survivors' median batch
  interval before the kill, for scale;
* ``once``: every sample of every epoch trained exactly once (the victim's trained batches
  counted);
* ``val_loss``: the final validation loss of the averaged model, and the same without a loss.

Usage::

    python -m benchmarks.perf.elastic_loss                 # 3 repeats, about 6 minutes idle
    python -m benchmarks.perf.elastic_loss --repeats 1 --out /tmp/elastic.json
    python -m benchmarks.perf.elastic_loss --strategy dpsgd   # loss_dpsgd.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.harness import describe_machine, machine_info, median, spread, write_json
from testbed.elastic_fit import outcome
from testbed.launch import ROOT, run_fake_slurm_each

RANKS, VICTIM, BATCH = 4, 2, 6
OUTS = {"adpsgd": ROOT / "benchmarks" / "results" / "elastic" / "loss.json",
        "dpsgd": ROOT / "benchmarks" / "results" / "elastic" / "loss_dpsgd.json"}


def measure(out: Path, victim: int, strategy: str = "adpsgd") -> dict[str, Any]:
    """One fit (``victim`` -1: no loss) and what it cost (:func:`testbed.elastic_fit.outcome`)."""
    t0 = time.time()
    launched = run_fake_slurm_each("testbed.elastic_fit", str(out), str(victim), str(BATCH),
                                   ntasks=RANKS, timeout=600,
                                   env={"ELASTIC_FIT_STRATEGY": strategy})
    wall = time.time() - t0
    codes = launched.returncodes
    if any(codes[r] != 0 for r in range(RANKS) if r != victim):
        raise RuntimeError(f"a survivor failed ({codes}):\n{launched.stdout[-4000:]}")
    return dict(outcome(out, RANKS, victim), victim=victim, wall_s=round(wall, 1))


def main() -> None:
    """Run the repeats and write the record (``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategy", choices=sorted(OUTS), default="adpsgd")
    parser.add_argument("--out", type=Path, default=None, help="default: by the strategy")
    args = parser.parse_args()
    out = args.out or OUTS[args.strategy]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = (VICTIM, -1) if i % 2 == 0 else (-1, VICTIM)
            for victim in order:
                folder = Path(tmp) / f"r{i}_{'loss' if victim >= 0 else 'none'}"
                folder.mkdir()
                runs.append(dict(measure(folder, victim, args.strategy), repeat=i))
                print(json.dumps(runs[-1]), flush=True)
    lost = [r for r in runs if r["victim"] >= 0]
    summary: dict[str, Any] = spread(lost, ("detect_s", "recover_s", "stall_s", "wall_s",
                                            "val_loss"))
    summary["val_loss_no_loss"] = median([r["val_loss"] for r in runs if r["victim"] < 0])
    summary["once"] = all(r["once"] for r in runs)
    info = machine_info()
    write_json(out, {"what": __doc__.split("\n\n")[0], "strategy": args.strategy, "ranks": RANKS,
                          "heartbeat_timeout_s": 3.0, "machine": info,
                          "machine_text": describe_machine(info), "runs": runs,
                          "summary": summary})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
