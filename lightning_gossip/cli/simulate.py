"""``lightning-gossip simulate``: N learners training a small MLP on the digits data, in one
process (:mod:`lightning_gossip.sim`)."""

from __future__ import annotations

import argparse
import json

from lightning_gossip import topology as _topology
from lightning_gossip.cli.common import (
    CLIError,
    check_writable,
    fmt,
    jsonable,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    table,
)
from lightning_gossip.pairing import PAIRINGS

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``simulate`` sub-command to ``sub``."""
    names = list(_topology.TOPOLOGIES)
    p = sub.add_parser(
        "simulate", help="simulate N learners training a small MLP on the digits data",
        description="Run the in-process simulator (lightning_gossip.sim): N virtual learners "
                    "train an MLP on scikit-learn's bundled digits, mixing with the same "
                    "topology objects as the strategies. Prints loss, accuracy and consensus "
                    "distance per run, and the steps/time to reach --target-loss.",
    )
    p.add_argument("--algorithms", "-a", nargs="+", choices=["dpsgd", "adpsgd"],
                   default=["dpsgd"], help="default: dpsgd")
    p.add_argument("--topologies", "-t", nargs="+", choices=names,
                   default=["ring", "random_ring", "complete"], metavar="NAME",
                   help=f"D-PSGD topologies, any of {', '.join(names)} "
                        "(default: ring random_ring complete)")
    p.add_argument("--pairings", nargs="+", choices=list(PAIRINGS), default=["ring"],
                   help="AD-PSGD pairings (partner choice; default: ring, as ADPSGDStrategy)")
    p.add_argument("--world-sizes", "-n", nargs="+", type=positive_int, default=[16],
                   metavar="N", help="numbers of learners (default: 16)")
    p.add_argument("--steps", type=positive_float, default=200,
                   help="run length in virtual time units = steps of a speed-1 learner "
                        "(default 200)")
    p.add_argument("--lr", type=non_negative_float, default=0.1, help="default 0.1")
    p.add_argument("--momentum", type=non_negative_float, default=0.0, help="default 0")
    p.add_argument("--batch-size", type=positive_int, default=16,
                   help="samples per learner per step (default 16)")
    p.add_argument("--hidden", type=positive_int, default=32, help="MLP width (default 32)")
    p.add_argument("--partition", choices=["iid", "sorted"], default="iid",
                   help="iid shards, or shards sorted by label (default iid)")
    p.add_argument("--no-overlap", action="store_true",
                   help="D-PSGD: mix after the local step (x <- W x') instead of overlapped")
    p.add_argument("--adpsgd-no-overlap", action="store_true",
                   help="AD-PSGD: average atomically right after each step instead of "
                        "overlapping the exchange with the next step (an idealisation)")
    p.add_argument("--delay-by-one", action="store_true",
                   help="apply each exchange one step later, as the strategies' delay_by_one "
                        "(D-PSGD and AD-PSGD)")
    p.add_argument("--slow", type=non_negative_int, default=0,
                   help="number of slow learners (default 0)")
    p.add_argument("--slow-factor", type=positive_float, default=4.0,
                   help="a slow learner's time per step (default 4)")
    p.add_argument("--jitter", type=non_negative_float, default=0.0,
                   help="log-normal noise (sigma) on every step time (default 0)")
    p.add_argument("--target-loss", type=positive_float, default=0.5,
                   help="report steps/time until the averaged model's loss is below this")
    p.add_argument("--eval-every", type=positive_float, default=5.0,
                   help="evaluate every this many time units (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    p.add_argument("--plot", metavar="FILE.png", help="loss and consensus curves")
    p.add_argument("--x-axis", choices=["auto", "steps", "time"], default="auto",
                   help="plot against steps or virtual time (auto: time when learners differ)")
    p.add_argument("--json", metavar="FILE.json", help="also write all curves as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _check(args: argparse.Namespace) -> None:
    """Every user error that can be found before the first run."""
    if "adpsgd" in args.algorithms and min(args.world_sizes) < 2:
        raise CLIError("adpsgd needs at least 2 learners (--world-sizes)")
    if args.slow > min(args.world_sizes):
        raise CLIError(f"--slow {args.slow} is more than the smallest world size "
                       f"{min(args.world_sizes)}")
    if "dpsgd" in args.algorithms:  # check every run before starting the first
        for n in args.world_sizes:
            for topo in args.topologies:
                try:
                    _topology.build(topo, n, args.seed)
                except ValueError as e:
                    raise CLIError(f"{topo} with {n} learners: {e}") from None


def run(args: argparse.Namespace) -> int:
    """Run ``lightning-gossip simulate``; returns the exit code."""
    from lightning_gossip.cli.plotting import plot_simulation, pyplot

    plot = check_writable(args.plot, "--plot")
    out_json = check_writable(args.json, "--json")
    if plot is not None:
        pyplot()
    _check(args)

    import torch

    from lightning_gossip import sim

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, loss_fn, x, y = sim.digits_problem(hidden=args.hidden, seed=args.seed)
    except RuntimeError as e:
        raise CLIError(str(e)) from None
    if max(args.world_sizes) > len(x):
        raise CLIError(f"the digits task has {len(x)} samples; at most {len(x)} learners")
    results: list[sim.SimResult] = []
    progress = not args.no_progress
    for n in args.world_sizes:
        shards = sim.DataShards(x, y, n, args.batch_size, partition=args.partition, seed=args.seed)
        compute = sim.ComputeModel.with_slow(n, args.slow, args.slow_factor, args.jitter,
                                             seed=args.seed)
        for algo in args.algorithms:
            if algo == "dpsgd":
                for topo in args.topologies:
                    results.append(sim.run_dpsgd(
                        model, loss_fn, shards, (x, y), topo, args.steps, args.lr,
                        momentum=args.momentum, seed=args.seed, overlap=not args.no_overlap,
                        delay_by_one=args.delay_by_one, compute=compute,
                        eval_every=args.eval_every, progress=progress))
            else:
                for pairing in args.pairings:
                    results.append(sim.run_adpsgd(
                        model, loss_fn, shards, (x, y), pairing, args.steps, args.lr,
                        momentum=args.momentum, seed=args.seed,
                        overlap=not args.adpsgd_no_overlap, delay_by_one=args.delay_by_one,
                        compute=compute, eval_every=args.eval_every, progress=progress))
    headers = ["algorithm", "topology", "n", "time", "steps", "loss", "accuracy", "consensus",
               f"steps to loss {args.target_loss:g}", f"time to loss {args.target_loss:g}"]
    cells = []
    for r in results:
        s_hit = r.first_below(args.target_loss, "steps")
        t_hit = r.first_below(args.target_loss, "time")
        cells.append([
            r.algorithm, r.topology, str(r.world_size), f"{r.time[-1]:g}", f"{r.steps[-1]:.1f}",
            fmt(r.loss[-1]), fmt(r.accuracy[-1], 3), fmt(r.absolute_consensus_distance[-1], 3),
            "not reached" if s_hit is None else f"{s_hit:g}",
            "not reached" if t_hit is None else f"{t_hit:g}",
        ])
    print(table(headers, cells))
    print(
        "\nloss/accuracy: the average of all replicas on the whole digits set (1,797 images); "
        "consensus: mean squared distance of the replicas to their average.\ntime: virtual "
        "time units (a learner of speed 1 takes 1 unit per step; a synchronous step lasts as "
        "long as its slowest learner); steps: local steps per learner."
    )
    if out_json is not None:
        out_json.write_text(json.dumps({"args": jsonable(vars(args)),
                                        "runs": [r.as_dict() for r in results]}))
        print(f"wrote {out_json}")
    if plot is not None:
        plot_simulation(results, plot, args)
        print(f"wrote {plot}")
    return 0
