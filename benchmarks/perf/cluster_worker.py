"""One rank of an emulated-cluster case (started by ``benchmarks/perf/cluster.py`` through
torchrun).

Usage (inside a node's namespace, by torchrun)::

    python -m benchmarks.perf.cluster_worker SPEC.json

For every case of the spec, in order, in the same processes (start-up is paid once), it trains
an MLP of about ``model_mb`` MB on scikit-learn's digits (80/20 split, fixed seed) with the
case's strategy for ``epochs`` epochs, then averages the replicas exactly and measures held-out
accuracy. Local rank 0 of every node reads its node's link counters
(``/sys/class/net/<GLOO_SOCKET_IFNAME>/statistics``, this namespace's view) when training
starts and after every rank has finished training, so the bytes counted are those of the
training steps (plus one barrier), not of start-up or of the evaluation. Every rank writes
``<case>/rank<r>.json`` next to the spec when the case is done.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from testbed.cluster_net import read_counters


@dataclasses.dataclass
class _Rank:
    """This rank: the spec, its folder, the process-group timeout, rank, node, link."""

    spec: dict[str, Any]
    out: Path
    timeout: timedelta
    rank: int
    world: int
    local_rank: int
    node: int
    iface: str


def _strategy(case: dict[str, Any], timeout: timedelta) -> Any:
    from benchmarks.common import trainers

    if case["strategy"] == "ddp":
        return trainers.make_strategy("ddp", timeout=timeout)
    # Replicas are averaged after the fit, once the counters are read, so the bytes counted
    # are those of the training steps only.
    return trainers.make_strategy(case["strategy"], timeout=timeout, **{
        **case["kwargs"], "final_average": False, "consensus_every_n_steps": None})


def _average_replicas(model: Any, world: int) -> None:
    """The exact average of the replicas (what ``final_average=True`` gives)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def _run_case(me: _Rank, case: dict[str, Any], data: tuple[Any, Any, Any]) -> None:
    """Train ``case``, average, evaluate; write ``<case>/rank<r>.json``."""
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from benchmarks.common import meters, trainers, workloads

    spec, (train, x_te, y_te) = me.spec, data
    case_dir = me.out / case["name"]
    strategy = _strategy(case, me.timeout)
    L.seed_everything(0, workers=True, verbose=False)
    model = workloads.Classifier([64, int(spec["width"]), int(spec["width"]), 10], lr=spec["lr"])
    meter = meters.EpochMeter((lambda: read_counters(me.iface)) if me.local_rank == 0 else None)
    trainer = L.Trainer(devices=int(spec["procs"]), num_nodes=int(spec["nodes"]),
                        strategy=strategy, **trainers.trainer_kwargs(
                            case_dir, max_epochs=int(spec["epochs"]),
                            max_steps=int(spec["max_steps"]), callbacks=[meter]))
    loader = DataLoader(train, batch_size=int(spec["batch_size"]), shuffle=True)
    fit_t0 = time.perf_counter()
    trainer.fit(model, loader)
    fit_end = time.perf_counter()
    dist.barrier()  # every rank has finished training (and gossip has quiesced)
    all_done = time.perf_counter()
    counters_end = read_counters(me.iface) if me.local_rank == 0 else None
    local_acc = model.accuracy(x_te, y_te)
    _average_replicas(model, me.world)
    result = {
        "rank": me.rank, "node": me.node, "local_rank": me.local_rank,
        "steps": int(trainer.global_step), "epoch_s": meter.epoch_s, "samples": meter.samples,
        "train_s": all_done - (meter.train_start or fit_t0), "fit_s": fit_end - fit_t0,
        "counters_start": meter.counters_start, "counters_end": counters_end,
        "accuracy": model.accuracy(x_te, y_te), "local_accuracy": local_acc,
        "train_samples": len(train), "test_samples": len(y_te),
        "params": sum(p.numel() for p in model.parameters()),
    }
    case_dir.mkdir(parents=True, exist_ok=True)
    tmp = case_dir / f".rank{me.rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(case_dir / f"rank{me.rank}.json")  # the driver sees whole files only


def main(spec_path: Path) -> None:
    """Run the cases listed in ``spec_path``, in order, on this rank; one result file each."""
    import torch
    import torch.distributed as dist

    from benchmarks.common import workloads

    spec = json.loads(spec_path.read_text())
    me = _Rank(spec, spec_path.parent, timedelta(seconds=float(spec["pg_timeout_s"])),
               int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
               int(os.environ["LOCAL_RANK"]), int(os.environ["GROUP_RANK"]),
               os.environ["GLOO_SOCKET_IFNAME"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=me.timeout)  # Lightning reuses it
    data = workloads.digits_80_20()
    for case in spec["cases"]:
        dist.barrier()
        print(f"[worker rank {me.rank}] case {case['name']}", flush=True)
        _run_case(me, case, data)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
