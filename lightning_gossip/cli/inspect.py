"""``lightning-gossip inspect``: a topology's mixing matrix, peers and checks at one step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from lightning_gossip import topology as _topology
from lightning_gossip.cli.common import CLIError, non_negative_int, positive_int

__all__ = ["add_parser", "load_topology", "run"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``inspect`` sub-command to ``sub``."""
    names = list(_topology.TOPOLOGIES)
    p = sub.add_parser(
        "inspect", help="a topology's mixing matrix, peers and checks",
        description="Show the mixing matrix W_t a topology applies at one step, each rank's "
                    "peers and the checks it passes. Exit code 1 if the matrix is not a valid "
                    "(non-negative, doubly stochastic, connected) mixing matrix.",
    )
    p.add_argument("topology", metavar="TOPOLOGY",
                   help=f"one of {', '.join(names)}, or a matrix file (.npy, .txt, .csv)")
    p.add_argument("-n", "--world-size", dest="n", type=positive_int, metavar="N",
                   help="number of ranks (required for a named topology)")
    p.add_argument("--step", type=non_negative_int, default=0, help="optimizer step t")
    p.add_argument("--seed", type=int, default=0, help="seed of time-varying topologies")
    p.add_argument("--precision", type=positive_int, default=3, help="digits printed")
    p.add_argument("--max-print", type=positive_int, default=16,
                   help="print the matrix and all peers up to this many ranks (default 16)")
    p.add_argument("--full", action="store_true", help="print everything however large")
    p.set_defaults(func=run)
    return p


def load_topology(spec: str, n: int | None, seed: int) -> _topology.Topology:
    """A named topology for ``n`` ranks, or a :class:`MatrixTopology` read from a file."""
    if spec in _topology.TOPOLOGIES:
        if n is None:
            raise CLIError(f"inspect {spec}: the number of ranks is required (-n N)")
        try:
            return _topology.build(spec, n, seed)
        except ValueError as e:
            raise CLIError(str(e)) from None
    path = Path(spec)
    if path.suffix in (".npy", ".txt", ".csv") or path.exists():
        if not path.exists():
            raise CLIError(f"no such matrix file: {spec}")
        try:
            w = np.load(path) if path.suffix == ".npy" else np.loadtxt(
                path, delimiter="," if path.suffix == ".csv" else None, ndmin=2)
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read a matrix from {spec}: {e}") from None
        try:
            topo = _topology.MatrixTopology(w, name=path.name)
        except ValueError as e:
            raise CLIError(f"{spec}: {e}") from None
        if n is not None and n != topo.world_size:
            raise CLIError(f"{spec} is a {topo.world_size}x{topo.world_size} matrix but -n is {n}")
        return topo
    raise CLIError(
        f"unknown topology {spec!r}; valid choices: {', '.join(_topology.TOPOLOGIES)}, "
        "or a matrix file (.npy, .txt, .csv)"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``lightning-gossip inspect``; 0 for a valid mixing matrix, 1 otherwise."""
    topo = load_topology(args.topology, args.n, args.seed)
    n, t = topo.world_size, args.step
    w = topo.mixing_matrix(t)
    kind = "time-varying" if topo.is_time_varying else "static"
    seed = f", seed {args.seed}" if topo.is_time_varying else ""
    print(f"{topo.name}: {n} ranks, step {t} ({kind}{seed})")
    print()
    if n <= args.max_print or args.full:
        print(f"mixing matrix W_{t} (row i: the weights rank i applies):")
        with np.printoptions(precision=args.precision, suppress=True, linewidth=160,
                             threshold=sys.maxsize):
            print(w)
    else:
        print(f"mixing matrix W_{t}: {n}x{n}, {int((w > 0).sum())} non-zeros "
              f"(printed up to {args.max_print} ranks; --full to print it anyway)")
    print()
    print("peers:")
    shown = range(n) if (n <= args.max_print or args.full) else range(args.max_print)
    for r in shown:
        p = topo.peers(r, t)
        recv = ", ".join(f"{j} ({wt:.{args.precision}g})" for j, wt in p.recv_from) or "-"
        send = ", ".join(map(str, p.send_to)) or "-"
        print(f"  rank {r:>{len(str(n - 1))}}: self {p.self_weight:.{args.precision}g}; "
              f"receives from {recv}; sends to {send}")
    if len(shown) < n:
        print(f"  ... ({n - len(shown)} more ranks)")
    print()
    ds = _topology.is_doubly_stochastic(w)
    sym = bool(np.allclose(w, w.T, atol=1e-12))
    conn = _topology.is_connected(w)
    nonneg = bool(np.all(w >= 0))
    print("checks:")
    for label, ok in (("non-negative", nonneg), ("doubly stochastic", ds),
                      ("symmetric", sym), ("connected (strongly)", conn)):
        print(f"  {label:<22} {'yes' if ok else 'NO'}")
    print(f"  {'peers per step':<22} {topo.degree(t)}")
    if n > 1:
        gap = _topology.static_spectral_gap(w)
        print(f"  {'gap of W_' + str(t):<22} {gap:.6g}  (1 - second largest |eigenvalue|)")
    print(f"  {'topology gap':<22} {topo.spectral_gap():.6g}")
    print(f"  {'mean-square gap':<22} {topo.mean_square_gap():.6g}")
    return 0 if (ds and conn and nonneg) else 1
