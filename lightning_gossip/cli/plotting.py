"""The figures of ``lightning-gossip topologies --plot`` and ``simulate --plot``.

matplotlib (and numpy) are imported when a figure is drawn, not when this module is.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_gossip.cli.common import CLIError

__all__ = ["plot_simulation", "plot_topologies", "pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; a :class:`CLIError` if it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError(
            "--plot needs matplotlib, which is not installed: "
            "pip install matplotlib (or lightning-gossip[plot])"
        ) from None
    return plt


def plot_topologies(rows: Sequence[Any], path: Path, args: argparse.Namespace) -> None:
    """Spectral gap and consensus steps vs world size, per topology (``TopologyRow`` rows)."""
    import numpy as np

    from lightning_gossip.analysis import closed_form_gaps, predicted_consensus_steps

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, name in enumerate(args.topologies):
        rs = [r for r in rows if r.topology == name and r.error is None]
        if not rs:
            continue
        c = colors[k % len(colors)]
        lo, hi = min(r.world_size for r in rs), max(r.world_size for r in rs)
        grid, gaps, preds = [], [], []
        # a dense grid where the closed form is smooth in n; the requested sizes elsewhere
        # (tori and exponential graphs jump between neighbouring n)
        dense = name in ("ring", "random_ring", "complete")
        sizes = np.geomspace(lo, hi, 200) if dense else [r.world_size for r in rs]
        for n in sorted({int(round(v)) for v in sizes}):
            try:
                closed = closed_form_gaps(name, n)
            except ValueError:  # e.g. a torus on a prime number
                continue
            if closed is not None:
                grid.append(n)
                gaps.append(closed[0])
                preds.append(predicted_consensus_steps(closed[1], args.tolerance))
        ax1.plot(grid, gaps, "-", color=c, alpha=0.5, lw=1)
        ax1.plot([r.world_size for r in rs], [r.gap for r in rs], "o", color=c, label=name)
        ax2.plot(grid, preds, "-", color=c, alpha=0.5, lw=1)
        meas = [(r.world_size, r.steps_measured) for r in rs if r.steps_measured is not None]
        if meas:
            ax2.plot(*zip(*meas), "o", color=c, label=name)
    ax1.set(xscale="log", yscale="log", xlabel="learners n", ylabel="spectral gap",
            title="Spectral gap (markers: eigensolver on W, lines: closed form)")
    ax1.set_xscale("log", base=2)
    ax2.set_xscale("log", base=2)
    ax2.set(yscale="log", xlabel="learners n", ylabel="mixing steps",
            title=f"Steps to shrink consensus error by {args.tolerance:g}\n"
                  "(markers: measured, lines: predicted from ms_gap)")
    if not args.no_measure:
        ax2.axhline(args.max_steps, color="grey", ls=":", lw=1)
        ax2.text(min(args.world_sizes), args.max_steps, f" cap {args.max_steps}",
                 va="bottom", fontsize=8, color="grey")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_simulation(results: Sequence[Any], path: Path, args: argparse.Namespace) -> None:
    """Loss and absolute consensus distance curves, one column per world size (``SimResult``)."""
    import numpy as np

    plt = pyplot()
    sizes = list(dict.fromkeys(r.world_size for r in results))
    axis = args.x_axis
    if axis == "auto":
        axis = "time" if ("adpsgd" in args.algorithms or args.slow or args.jitter) else "steps"
    fig, axes = plt.subplots(2, len(sizes), figsize=(max(4.6 * len(sizes), 7), 7), squeeze=False,
                             sharex="col")
    for col, n in enumerate(sizes):
        for r in (r for r in results if r.world_size == n):
            xs = r.time if axis == "time" else r.steps
            label = f"{r.algorithm} {r.topology}"
            axes[0, col].plot(xs, r.loss, label=label)
            cons = np.asarray(r.absolute_consensus_distance, dtype=float)
            # exact consensus (all-reduce) leaves only rounding noise: not drawn
            axes[1, col].plot(xs, np.where(cons > 1e-9, cons, np.nan), label=label)
        axes[0, col].axhline(args.target_loss, color="grey", ls=":", lw=1)
        axes[0, col].set(title=f"{n} learners", yscale="log",
                         ylabel="loss of the averaged model" if col == 0 else None)
        axes[1, col].set(yscale="log", xlabel="virtual time" if axis == "time" else "step",
                         ylabel="absolute consensus distance" if col == 0 else None)
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
        axes[0, col].legend(fontsize=8)
    fig.suptitle(
        f"digits MLP (hidden {args.hidden}), batch {args.batch_size}/learner, lr {args.lr:g}, "
        f"{args.partition} data, seed {args.seed}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
