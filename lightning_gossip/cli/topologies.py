"""``lightning-gossip topologies``: spectral gap, cost and consensus speed of every topology."""

from __future__ import annotations

import argparse
import json
import math

from lightning_gossip import topology as _topology
from lightning_gossip.cli.common import (
    check_writable,
    count,
    fmt,
    fmt_bytes,
    fraction,
    jsonable,
    positive_int,
    table,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``topologies`` sub-command to ``sub``."""
    names = list(_topology.TOPOLOGIES)
    p = sub.add_parser(
        "topologies", help="spectral gap, cost and consensus speed of every topology",
        description="For every topology and world size: spectral gap (numerical and closed "
                    "form), peers and bytes sent per rank per step, and the number of mixing "
                    "steps for the consensus error to fall by --tolerance, predicted from the "
                    "gap and measured by running x <- W_t x from random vectors.",
    )
    p.add_argument("--world-sizes", "-n", nargs="+", type=positive_int,
                   default=[8, 16, 32, 64, 128], metavar="N", help="default: 8 16 32 64 128")
    p.add_argument("--topologies", "-t", nargs="+", choices=names, default=names,
                   metavar="NAME", help=f"any of {', '.join(names)} (default: all)")
    p.add_argument("--model-params", type=count, default=25_557_032, metavar="COUNT",
                   help="model size for the bytes column, e.g. 25.6M, 350k (default: 25.6M, "
                        "ResNet-50)")
    p.add_argument("--bytes-per-param", type=positive_int, default=4,
                   help="4 for fp32 (default), 2 for bf16/fp16")
    p.add_argument("--tolerance", type=fraction, default=1e-3,
                   help="consensus error reduction factor (default 1e-3)")
    p.add_argument("--max-steps", type=positive_int, default=100_000,
                   help="give up measuring after this many mixing steps (default 100000)")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the measured steps (only eigenvalues and closed forms)")
    p.add_argument("--seed", type=int, default=0, help="seeds random_ring and the vectors")
    p.add_argument("--plot", metavar="FILE.png", help="draw gap and steps vs world size")
    p.add_argument("--json", metavar="FILE.json", help="also write the rows as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``lightning-gossip topologies``; returns the exit code."""
    from lightning_gossip.analysis import analyze_all
    from lightning_gossip.cli.plotting import plot_topologies, pyplot

    plot = check_writable(args.plot, "--plot")
    out_json = check_writable(args.json, "--json")
    if plot is not None:
        pyplot()  # fail before the work, not after
    rows = analyze_all(
        args.topologies, args.world_sizes, progress=not args.no_progress,
        model_params=args.model_params, bytes_per_param=args.bytes_per_param,
        tolerance=args.tolerance, max_steps=args.max_steps, seed=args.seed,
        measure=not args.no_measure,
    )
    headers = ["topology", "n", "gap", "gap (closed form)", "ms_gap", "peers/step",
               "sent/rank/step", "steps (predicted)", "steps (measured)"]
    cells, notes = [], []
    for r in rows:
        if r.error:
            cells.append([r.topology, str(r.world_size)] + ["n/a"] * 7)
            notes.append(f"n/a: {r.topology} at n={r.world_size}: {r.error}")
            continue
        measured = "-" if args.no_measure else (
            str(r.steps_measured) if r.steps_measured is not None else f">{args.max_steps}")
        pred = r.steps_predicted
        cells.append([
            r.topology, str(r.world_size), fmt(r.gap), fmt(r.gap_closed_form), fmt(r.ms_gap),
            str(r.peers), fmt_bytes(r.bytes_per_step),
            "inf" if pred is None or math.isinf(pred) else str(math.ceil(pred - 1e-9)), measured,
        ])
    print(table(headers, cells))
    for note in dict.fromkeys(notes):
        print(note)
    print(
        f"\ngap: 1 - |lambda_2(W)| (fixed W) or 1 - lambda_2(E[W^T W]) (time-varying); ms_gap: "
        f"1 - lambda_2(E[W^T W]) for all.\nsteps: mixing steps x <- W_t x until the RMS "
        f"consensus error falls by {args.tolerance:g}; predicted = 2 ln(1/tol) / -ln(1 - ms_gap), "
        f"measured from 4 random vectors (seed {args.seed}).\nsent/rank/step: peers x "
        f"{args.model_params:,} parameters x {args.bytes_per_param} bytes (complete: point to "
        "point; an all-reduce sends about 2 models per rank)."
    )
    if out_json is not None:
        out_json.write_text(json.dumps({"args": jsonable(vars(args)),
                                        "rows": [r.as_dict() for r in rows]}, indent=1))
        print(f"wrote {out_json}")
    if plot is not None:
        plot_topologies(rows, plot, args)
        print(f"wrote {plot}")
    return 0
