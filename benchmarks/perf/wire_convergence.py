"""Does a compressed gossip wire cost convergence? fp32 vs bf16 vs fp16 on two real workloads.

One launch starts N CPU ranks (torchrun, gloo, one thread per rank) and trains, back to back in
the same processes and from the same initial weights and data order, every selected strategy
and wire dtype on two workloads:

* ``digits``: an MLP on scikit-learn's bundled handwritten digits (held-out accuracy);
* ``transformer``: Lightning's demo language model (``lightning.pytorch.demos.Transformer``)
  on real English text that ships with Python: the docstrings of the standard library, read
  with ``ast`` from the interpreter's own sources (no download), word-level, the most frequent
  words kept (the rest ``<unk>``); held-out loss and perplexity on the last 10% of the text.
  The demo module passes the *targets* to its decoder, which then sees the token it predicts;
  here the decoder is given the inputs, so the task is a real next-word prediction.

Per case it reports the held-out metric of the final model (gossip strategies end with the
exact average of the replicas) and the relative consensus distance just before that average
(how far the replicas were apart: what a lossy wire could spoil).

Usage::

    python -m benchmarks.perf.wire_convergence                 # 4 ranks, dpsgd fp32/bf16/fp16 + ddp
    python -m benchmarks.perf.wire_convergence --quick         # 2 ranks, a few steps (smoke)
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import re
import sysconfig
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cli_args, harness

#: case name -> (strategy, extra strategy kwargs)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "dpsgd_fp32": ("dpsgd", {"wire_dtype": "fp32"}),
    "dpsgd_bf16": ("dpsgd", {"wire_dtype": "bf16"}),
    "dpsgd_fp16": ("dpsgd", {"wire_dtype": "fp16"}),
    "adpsgd_fp32": ("adpsgd", {"wire_dtype": "fp32"}),
    "adpsgd_bf16": ("adpsgd", {"wire_dtype": "bf16"}),
}
DEFAULT_CASES = ("ddp", "dpsgd_fp32", "dpsgd_bf16", "dpsgd_fp16")
WORKLOADS = ("digits", "transformer")
DEFAULT_OUT = harness.RESULTS_DIR / "wire_convergence.json"
WORD = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")


def stdlib_text(max_words: int) -> list[str]:
    """The first ``max_words`` words of the standard library's docstrings, in sorted file order.

    >>> words = stdlib_text(50)
    >>> len(words), all(w == w.lower() for w in words)
    (50, True)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    words: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    words += WORD.findall(doc.lower()) + ["<eos>"]
                    if len(words) >= max_words:
                        return words[:max_words]
    return words


def encode(words: list[str], vocab_size: int) -> tuple[list[int], int]:
    """Word ids with the ``vocab_size - 1`` most frequent words kept, the rest ``<unk>`` (0).

    >>> encode(["a", "b", "a", "c"], 2)
    ([1, 0, 1, 0], 2)
    """
    common = [w for w, _ in collections.Counter(words).most_common(vocab_size - 1)]
    index = {w: i + 1 for i, w in enumerate(common)}
    return [index.get(w, 0) for w in words], len(common) + 1


# ----------------------------------------------------------------------------------------------
# Worker side (runs inside every torchrun rank)
# ----------------------------------------------------------------------------------------------
def _datasets(w: harness.Worker) -> dict[str, Any]:
    """The workloads' data: digits (train, x_val, y_val) and the text's blocks (train, val)."""
    import torch
    from torch.utils.data import TensorDataset

    from benchmarks.common import workloads

    data: dict[str, Any] = {"digits": workloads.digits_split(), "vocab": 0,
                            "transformer": (TensorDataset(torch.zeros(0)),) * 2}
    if "transformer" in w.spec["workloads"]:
        text = json.loads((w.out / "text.json").read_text())  # written once by the driver
        lm_train, lm_val = workloads.lm_datasets(text["ids"], w.spec["block"])
        data["transformer"], data["vocab"] = (lm_train, lm_val), text["vocab"]
        harness.progress(f"text: {len(text['ids'])} words, vocabulary {text['vocab']}, "
                         f"{len(lm_train)} training blocks of {w.spec['block']}, "
                         f"{len(lm_val)} held out")
    return data


def _strategy(case: str, spec: dict[str, Any]) -> Any | None:
    """The case's strategy; ``None`` where this version has no ``wire_dtype``."""
    from benchmarks.common import trainers

    kind, extra = CASES[case]
    if kind == "ddp":
        return trainers.make_strategy("ddp")
    if "wire_dtype" in extra and not trainers.accepts(kind, "wire_dtype"):
        return None
    return trainers.make_strategy(kind, consensus_every_n_steps=spec["consensus_every"], **extra)


def _fit(w: harness.Worker, data: dict[str, Any], workload: str,
         case: str) -> dict[str, Any] | None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.common import trainers, workloads

    spec = w.spec
    strategy = _strategy(case, spec)
    if strategy is None:
        return None
    torch.manual_seed(spec["seed"])
    if workload == "digits":
        model: Any = workloads.Classifier([64, 128, 128, 10], lr=spec["digits_lr"])
        train, epochs, batch = data["digits"][0], spec["digits_epochs"], 32
    else:
        model = workloads.LanguageModel(data["vocab"], spec["width"], spec["lm_lr"])
        train, epochs, batch = data["transformer"][0], spec["lm_epochs"], spec["lm_batch"]
    loader = DataLoader(train, batch_size=batch, shuffle=True,
                        generator=torch.Generator().manual_seed(spec["seed"]))
    trainer = L.Trainer(devices=w.world, strategy=strategy, **trainers.trainer_kwargs(
        w.out, max_epochs=epochs, limit_train_batches=spec["limit_batches"],
        gradient_clip_val=1.0))
    start = time.perf_counter()
    trainer.fit(model, loader)
    result = {"seconds": time.perf_counter() - start, "steps": trainer.global_step,
              "consensus_distance": getattr(strategy, "last_consensus_distance", None)}
    if workload == "digits":
        result["val_acc"] = model.accuracy(*data["digits"][1:])
    else:
        result.update(model.held_out(data["transformer"][1]))
    return result


def _worker(spec_path: Path) -> None:
    import torch.distributed as dist

    with harness.worker_session(spec_path) as w:
        data = _datasets(w)
        results: dict[str, dict[str, Any]] = {}
        for workload in w.spec["workloads"]:
            for case in w.spec["cases"]:
                dist.barrier()
                harness.progress(f"{workload} / {case}")
                res = _fit(w, data, workload, case)
                if res is None:
                    harness.progress(f"  skipped: {CASES[case][0]} has no wire_dtype in this "
                                     "version")
                    continue
                results[f"{workload}/{case}"] = res
                harness.progress("  " + ", ".join(f"{k} {v:.4g}" for k, v in res.items()
                                             if isinstance(v, float)))
        w.write({"rank": w.rank, "results": results})


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = cli_args.parser(__doc__.splitlines()[0])
    cli_args.add_ranks(p)
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--digits-epochs", type=int, default=10)
    p.add_argument("--digits-lr", type=float, default=0.05)
    p.add_argument("--lm-epochs", type=int, default=2)
    p.add_argument("--lm-lr", type=float, default=0.1)
    p.add_argument("--lm-batch", type=int, default=16, help="blocks per batch and rank")
    p.add_argument("--words", type=int, default=200_000, help="words of text")
    p.add_argument("--vocab", type=int, default=5000, help="words kept (the rest <unk>)")
    p.add_argument("--block", type=int, default=35, help="tokens per training sequence")
    p.add_argument("--width", type=int, default=128, help="Transformer width")
    p.add_argument("--limit-batches", type=float, default=1.0,
                   help="Trainer(limit_train_batches=...): fraction or count per epoch")
    p.add_argument("--consensus-every", type=int, default=10,
                   help="consensus_every_n_steps of the gossip strategies")
    p.add_argument("--seed", type=int, default=1234)
    cli_args.add_run_options(p, timeout=3600, out=DEFAULT_OUT,
                             quick="2 ranks, a few steps (smoke test)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, launch the ranks, print and save the table."""
    args = cli_args.parse(_parser(), argv, _worker)
    if args is None:
        return 0
    if args.quick:
        args.ranks, args.digits_epochs, args.lm_epochs = 2, 1, 1
        args.words, args.limit_batches = 20_000, 5
    spec = {k: v for k, v in vars(args).items() if k not in ("out", "worker", "quick")}
    info = harness.machine_info()
    print(f"wire_convergence: {args.ranks} ranks, cases {args.cases}, workloads "
          f"{args.workloads}; load average {info['loadavg_1_5_15']}", flush=True)
    work = args.out.parent / f".{args.out.stem}_work"
    if "transformer" in args.workloads:
        ids, vocab = encode(stdlib_text(args.words), args.vocab)
        work.mkdir(parents=True, exist_ok=True)
        (work / "text.json").write_text(json.dumps({"ids": ids, "vocab": vocab}))
    results = harness.launch_workers("benchmarks.perf.wire_convergence", spec, args.ranks, work,
                                     args.timeout)[0]["results"]
    rows = []
    for key, res in results.items():
        workload, case = key.split("/")
        metric = (f"{100 * res['val_acc']:.1f}% acc" if workload == "digits"
                  else f"loss {res['val_loss']:.3f}, ppl {res['val_ppl']:.1f}")
        cd = res.get("consensus_distance")
        rows.append([workload, case, metric, "-" if cd is None else f"{cd:.2e}", res["steps"],
                     round(res["seconds"], 1)])
    print(harness.markdown_table(["workload", "case", "held-out", "consensus distance (last)",
                                  "steps", "s"], rows))
    print(harness.describe_machine(info))
    harness.write_json(args.out, {"machine": info, "spec": spec, "results": results})
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
