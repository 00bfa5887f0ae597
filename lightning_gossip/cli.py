"""The ``lightning-gossip`` command: analyze topologies and simulate many learners on a laptop.

Commands::

    lightning-gossip topologies --world-sizes 8 16 32 64 128 --plot gaps.png
    lightning-gossip inspect random_ring -n 8 --step 3
    lightning-gossip simulate --topologies ring random_ring complete --world-sizes 16 64 \\
        --steps 300 --plot training.png

Run ``lightning-gossip COMMAND --help`` for every option. The same code is reachable from
Python as :func:`main`::

    >>> from lightning_gossip.cli import main
    >>> main(["inspect", "ring", "-n", "4"])  # doctest: +ELLIPSIS
    ring: 4 ranks, step 0 (static)
    ...
    0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lightning_gossip import topology as _topology

__all__ = ["build_parser", "main"]

_SUFFIXES = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}


class CLIError(Exception):
    """A user error: printed as ``lightning-gossip: error: ...`` with exit code 2."""


# ---------------------------------------------------------------------------------------------
# Argument types
# ---------------------------------------------------------------------------------------------


def _number_type(cast: type, accept, expected: str):
    """An argparse ``type=`` that parses with ``cast`` and checks ``accept(value)``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


_positive_int = _number_type(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _number_type(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number_type(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
_non_negative_float = _number_type(float, lambda v: v >= 0 and math.isfinite(v),
                                   "a number >= 0")
_fraction = _number_type(float, lambda v: 0.0 < v < 1.0, "a number in (0, 1)")


def _count(text: str) -> int:
    """``25.6M``, ``1e6``, ``350k``: a number of parameters."""
    raw = text.strip().lower()
    scale = 1.0
    if raw and raw[-1] in _SUFFIXES:
        scale, raw = _SUFFIXES[raw[-1]], raw[:-1]
    try:
        value = float(raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a parameter count such as 25.6M, 350k or 1e6, got {text!r}"
        ) from None
    if not value >= 1 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a parameter count >= 1, got {text!r}")
    return int(round(value))


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, int):
        return str(x)
    if x != 0 and abs(x) < 10 ** -(digits - 1):
        return f"{x:.{digits - 2}e}"
    return f"{x:.{digits}f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def _pyplot():
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


def _check_writable(path: str | None, flag: str) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"{flag} {path}: is a directory, expected a file name")
    if not p.parent.exists():
        raise CLIError(f"{flag} {path}: directory {p.parent} does not exist")
    return p


# ---------------------------------------------------------------------------------------------
# topologies
# ---------------------------------------------------------------------------------------------


def _cmd_topologies(args: argparse.Namespace) -> int:
    from lightning_gossip.analysis import analyze_all

    plot = _check_writable(args.plot, "--plot")
    out_json = _check_writable(args.json, "--json")
    if plot is not None:
        _pyplot()  # fail before the work, not after
    rows = analyze_all(
        args.topologies, args.world_sizes, progress=not args.no_progress,
        model_params=args.model_params, bytes_per_param=args.bytes_per_param,
        tolerance=args.tolerance, max_steps=args.max_steps, seed=args.seed,
        measure=not args.no_measure,
    )
    headers = ["topology", "n", "gap", "gap (closed form)", "ms_gap", "peers/step",
               "sent/rank/step", "steps (predicted)", "steps (measured)"]
    table, notes = [], []
    for r in rows:
        if r.error:
            table.append([r.topology, str(r.world_size)] + ["n/a"] * 7)
            notes.append(f"n/a: {r.topology} at n={r.world_size}: {r.error}")
            continue
        measured = "-" if args.no_measure else (
            str(r.steps_measured) if r.steps_measured is not None else f">{args.max_steps}")
        pred = r.steps_predicted
        table.append([
            r.topology, str(r.world_size), _fmt(r.gap), _fmt(r.gap_closed_form), _fmt(r.ms_gap),
            str(r.peers), _fmt_bytes(r.bytes_per_step),
            "inf" if pred is None or math.isinf(pred) else str(math.ceil(pred - 1e-9)), measured,
        ])
    print(_table(headers, table))
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
        out_json.write_text(json.dumps({"args": _jsonable(vars(args)),
                                        "rows": [r.as_dict() for r in rows]}, indent=1))
        print(f"wrote {out_json}")
    if plot is not None:
        _plot_topologies(rows, plot, args)
        print(f"wrote {plot}")
    return 0


def _plot_topologies(rows, path: Path, args: argparse.Namespace) -> None:
    from lightning_gossip.analysis import closed_form_gaps, predicted_consensus_steps

    plt = _pyplot()
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


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------


def _load_topology(spec: str, n: int | None, seed: int) -> _topology.Topology:
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


def _cmd_inspect(args: argparse.Namespace) -> int:
    topo = _load_topology(args.topology, args.n, args.seed)
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
        moduli = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
        print(f"  {'gap of W_' + str(t):<22} {1.0 - moduli[1]:.6g}  (1 - second largest |eigenvalue|)")
    print(f"  {'topology gap':<22} {topo.spectral_gap():.6g}")
    print(f"  {'mean-square gap':<22} {topo.mean_square_gap():.6g}")
    return 0 if (ds and conn and nonneg) else 1


# ---------------------------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------------------------


def _cmd_simulate(args: argparse.Namespace) -> int:
    import torch

    from lightning_gossip import sim

    plot = _check_writable(args.plot, "--plot")
    out_json = _check_writable(args.json, "--json")
    if plot is not None:
        _pyplot()
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
                        compute=compute, eval_every=args.eval_every, progress=progress))
            else:
                for pairing in args.pairings:
                    results.append(sim.run_adpsgd(
                        model, loss_fn, shards, (x, y), pairing, args.steps, args.lr,
                        momentum=args.momentum, seed=args.seed, delay=args.delay,
                        compute=compute, eval_every=args.eval_every, progress=progress))
    headers = ["algorithm", "topology", "n", "time", "steps", "loss", "accuracy", "consensus",
               f"steps to loss {args.target_loss:g}", f"time to loss {args.target_loss:g}"]
    table = []
    for r in results:
        s_hit, t_hit = r.first_below(args.target_loss, "steps"), r.first_below(args.target_loss,
                                                                                 "time")
        table.append([
            r.algorithm, r.topology, str(r.world_size), f"{r.time[-1]:g}", f"{r.steps[-1]:.1f}",
            _fmt(r.loss[-1]), _fmt(r.accuracy[-1], 3), _fmt(r.consensus[-1], 3),
            "not reached" if s_hit is None else f"{s_hit:g}",
            "not reached" if t_hit is None else f"{t_hit:g}",
        ])
    print(_table(headers, table))
    print(
        "\nloss/accuracy: the average of all replicas on the whole digits set (1,797 images); "
        "consensus: mean squared distance of the replicas to their average.\ntime: virtual "
        "time units (a learner of speed 1 takes 1 unit per step; a synchronous step lasts as "
        "long as its slowest learner); steps: local steps per learner."
    )
    if out_json is not None:
        out_json.write_text(json.dumps({"args": _jsonable(vars(args)),
                                        "runs": [r.as_dict() for r in results]}))
        print(f"wrote {out_json}")
    if plot is not None:
        _plot_simulation(results, plot, args)
        print(f"wrote {plot}")
    return 0


def _plot_simulation(results, path: Path, args: argparse.Namespace) -> None:
    plt = _pyplot()
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
            cons = np.asarray(r.consensus, dtype=float)
            # exact consensus (all-reduce) leaves only rounding noise: not drawn
            axes[1, col].plot(xs, np.where(cons > 1e-9, cons, np.nan), label=label)
        axes[0, col].axhline(args.target_loss, color="grey", ls=":", lw=1)
        axes[0, col].set(title=f"{n} learners", yscale="log",
                         ylabel="loss of the averaged model" if col == 0 else None)
        axes[1, col].set(yscale="log", xlabel="virtual time" if axis == "time" else "step",
                         ylabel="consensus distance" if col == 0 else None)
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
        axes[0, col].legend(fontsize=8)
    fig.suptitle(
        f"digits MLP (hidden {args.hidden}), batch {args.batch_size}/learner, lr {args.lr:g}, "
        f"{args.partition} data, seed {args.seed}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------


def _jsonable(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "func"}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``lightning-gossip`` (all sub-commands)."""
    names = list(_topology.TOPOLOGIES)
    parser = argparse.ArgumentParser(
        prog="lightning-gossip",
        description="Analyze gossip topologies and simulate decentralized training "
                    "(D-PSGD, AD-PSGD, RAND-PSGD) with many learners in one process.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "topologies", help="spectral gap, cost and consensus speed of every topology",
        description="For every topology and world size: spectral gap (numerical and closed "
                    "form), peers and bytes sent per rank per step, and the number of mixing "
                    "steps for the consensus error to fall by --tolerance, predicted from the "
                    "gap and measured by running x <- W_t x from random vectors.",
    )
    p.add_argument("--world-sizes", "-n", nargs="+", type=_positive_int,
                   default=[8, 16, 32, 64, 128], metavar="N", help="default: 8 16 32 64 128")
    p.add_argument("--topologies", "-t", nargs="+", choices=names, default=names,
                   metavar="NAME", help=f"any of {', '.join(names)} (default: all)")
    p.add_argument("--model-params", type=_count, default=25_557_032, metavar="COUNT",
                   help="model size for the bytes column, e.g. 25.6M, 350k (default: 25.6M, "
                        "ResNet-50)")
    p.add_argument("--bytes-per-param", type=_positive_int, default=4,
                   help="4 for fp32 (default), 2 for bf16/fp16")
    p.add_argument("--tolerance", type=_fraction, default=1e-3,
                   help="consensus error reduction factor (default 1e-3)")
    p.add_argument("--max-steps", type=_positive_int, default=100_000,
                   help="give up measuring after this many mixing steps (default 100000)")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the measured steps (only eigenvalues and closed forms)")
    p.add_argument("--seed", type=int, default=0, help="seeds random_ring and the vectors")
    p.add_argument("--plot", metavar="FILE.png", help="draw gap and steps vs world size")
    p.add_argument("--json", metavar="FILE.json", help="also write the rows as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_topologies)

    p = sub.add_parser(
        "inspect", help="a topology's mixing matrix, peers and checks",
        description="Show the mixing matrix W_t a topology applies at one step, each rank's "
                    "peers and the checks it passes. Exit code 1 if the matrix is not a valid "
                    "(non-negative, doubly stochastic, connected) mixing matrix.",
    )
    p.add_argument("topology", metavar="TOPOLOGY",
                   help=f"one of {', '.join(names)}, or a matrix file (.npy, .txt, .csv)")
    p.add_argument("-n", "--world-size", dest="n", type=_positive_int, metavar="N",
                   help="number of ranks (required for a named topology)")
    p.add_argument("--step", type=_non_negative_int, default=0, help="optimizer step t")
    p.add_argument("--seed", type=int, default=0, help="seed of time-varying topologies")
    p.add_argument("--precision", type=_positive_int, default=3, help="digits printed")
    p.add_argument("--max-print", type=_positive_int, default=16,
                   help="print the matrix and all peers up to this many ranks (default 16)")
    p.add_argument("--full", action="store_true", help="print everything however large")
    p.set_defaults(func=_cmd_inspect)

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
    p.add_argument("--pairings", nargs="+", choices=["ring", "random"], default=["random"],
                   help="AD-PSGD partner choice (default: random)")
    p.add_argument("--world-sizes", "-n", nargs="+", type=_positive_int, default=[16],
                   metavar="N", help="numbers of learners (default: 16)")
    p.add_argument("--steps", type=_positive_float, default=200,
                   help="run length in virtual time units = steps of a speed-1 learner "
                        "(default 200)")
    p.add_argument("--lr", type=_non_negative_float, default=0.1, help="default 0.1")
    p.add_argument("--momentum", type=_non_negative_float, default=0.0, help="default 0")
    p.add_argument("--batch-size", type=_positive_int, default=16,
                   help="samples per learner per step (default 16)")
    p.add_argument("--hidden", type=_positive_int, default=32, help="MLP width (default 32)")
    p.add_argument("--partition", choices=["iid", "sorted"], default="iid",
                   help="iid shards, or shards sorted by label (default iid)")
    p.add_argument("--no-overlap", action="store_true",
                   help="D-PSGD: mix after the local step (x <- W x') instead of overlapped")
    p.add_argument("--slow", type=_non_negative_int, default=0,
                   help="number of slow learners (default 0)")
    p.add_argument("--slow-factor", type=_positive_float, default=4.0,
                   help="a slow learner's time per step (default 4)")
    p.add_argument("--jitter", type=_non_negative_float, default=0.0,
                   help="log-normal noise (sigma) on every step time (default 0)")
    p.add_argument("--delay", type=_non_negative_int, default=1,
                   help="AD-PSGD: steps an exchange stays in flight (default 1)")
    p.add_argument("--target-loss", type=_positive_float, default=0.5,
                   help="report steps/time until the averaged model's loss is below this")
    p.add_argument("--eval-every", type=_positive_float, default=5.0,
                   help="evaluate every this many time units (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's)")
    p.add_argument("--plot", metavar="FILE.png", help="loss and consensus curves")
    p.add_argument("--x-axis", choices=["auto", "steps", "time"], default="auto",
                   help="plot against steps or virtual time (auto: time when learners differ)")
    p.add_argument("--json", metavar="FILE.json", help="also write all curves as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_simulate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightning-gossip`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CLIError as e:
        parser.exit(2, f"lightning-gossip {args.command}: error: {e}\n")
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
