"""R's measurement (``benchmarks/race/comm_compute.py``) on real ranks: 2 faked nodes of 1 or 2
ranks (gloo, loopback), run by ``tests/test_race_comm_compute.py``::

    torchrun --nnodes 2 --nproc-per-node P ... comm_compute_ranks.py P

Every rank must get the same figures; R is the transfer over the compute step; the replica is
2 bytes per parameter; the send with its acknowledgement takes at least the one-way time.
Prints ``OK ...`` on rank 0.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from benchmarks.race import comm_compute


def main() -> None:
    procs = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    params = 300_000
    step = 0.1 + 0.01 * rank  # this rank's compute step: the median over ranks is taken
    out = comm_compute.measure(group, rank, world, procs, world // procs, params, step)
    figures = [None] * world
    dist.all_gather_object(figures, out)
    assert all(f == figures[0] for f in figures), figures
    assert out["replica_bytes"] == 2 * params, out
    steps = sorted(0.1 + 0.01 * r for r in range(world))
    median = (steps[(world - 1) // 2] + steps[world // 2]) / 2
    assert abs(out["compute_step_s"] - median) < 1e-6, out
    assert out["replica_transfer_s"] is not None and out["replica_transfer_s"] >= 0, out
    assert out["send_and_ack_s"] >= out["replica_transfer_s"], out
    assert out["comm_compute_ratio"] == comm_compute.ratio(out["replica_transfer_s"],
                                                           out["compute_step_s"]), out
    one_node = comm_compute.measure(group, rank, world, world, 1, params, step)
    assert one_node["replica_transfer_s"] is None and one_node["comm_compute_ratio"] is None
    if rank == 0:
        print(f"OK procs={procs} {out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
