"""Why gossip trails ddp per epoch: the optimizer's step on the replica mean, measured in-process.

Follows ddp's trajectory on the ASR recipe (model and batches of ``configs/synth.yaml``, ``--ranks``
shards of per-rank batch 8) and, at every step, also computes what ``--ranks`` gossip learners
would do from the same point with the same batches: each runs the optimizer (own state) on its
own gradient, clipped to ``--clip`` on its own, and the replicas are averaged (exact average:
the consensus error of real gossip is left out, only the optimizer's nonlinearity remains).
Per step it records

* ``ratio``: ``|mean_i u_i| / |u_ddp|`` (the gossip mean's step over ddp's step) and ``cos``;
* the pre-clip gradient norms: ddp's averaged gradient and each rank's local one.

    python -m benchmarks.perf.parity --optimizer adam --lr 3e-3 --steps 75     # epoch 0
    python -m benchmarks.perf.parity --optimizer adam --lr 3e-3 --steps 50 \
        --ckpt runs/.../epoch02-....ckpt --start-epoch 3                  # from saved weights
    python -m benchmarks.perf.parity --optimizer sgd --lr 0.1 --steps 25 --ckpt ... --start-epoch 3

Results (per 25 steps, and every step) go to ``benchmarks/results/parity/``.

With SGD (momentum, Nesterov) and no clipping the ratio is exactly 1 (the update is linear in the
gradient); with Adam it is not (each learner's second moment sees its own batch's noise).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from recipes.asr.bucketing import LengthBucketBatchSampler
from recipes.asr.datamodule import KaldiDataModule
from recipes.asr.dataset import collate_examples
from recipes.asr.recognizer import SpeechRecognizer
from recipes.asr.schedule import lr_factor

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "asr" / "configs" / "synth.yaml"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "parity"


class FlatOptimizer:
    """torch.optim.AdamW (weight decay 0) or SGD with Nesterov momentum on a flat vector."""

    def __init__(self, kind: str, size: int, momentum: float = 0.9) -> None:
        self.kind, self.momentum, self.t = kind, momentum, 0
        self.m = torch.zeros(size)
        self.v = torch.zeros(size)

    def update(self, g: torch.Tensor, lr: float) -> torch.Tensor:
        """The step to add to the weights (``-lr * direction``); advances the state."""
        self.t += 1
        if self.kind == "sgd":
            self.m.mul_(self.momentum).add_(g)
            return -lr * (g + self.momentum * self.m)
        b1, b2, eps = 0.9, 0.999, 1e-8
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        m_hat = self.m / (1 - b1**self.t)
        v_hat = self.v / (1 - b2**self.t)
        return -lr * m_hat / (v_hat.sqrt() + eps)


def clipped(g: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Lightning's ``gradient_clip_val`` (norm clipping, total 2-norm)."""
    if clip is None:
        return g
    norm = float(g.norm())
    return g * min(1.0, clip / (norm + 1e-6))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=5.0, help="gradient_clip_val; 0 disables")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", default="data/asr-synth")
    p.add_argument("--ckpt", default=None, help="start from this Lightning checkpoint's weights")
    p.add_argument("--start-epoch", type=int, default=0, help="epoch of --ckpt (schedule, data)")
    p.add_argument("--json", default=None, help="default: results/parity/<opt>_lr<lr>.json")
    return p


def _setup(a: argparse.Namespace) -> tuple[SpeechRecognizer, KaldiDataModule, dict]:
    """The recipe's model (from ``--ckpt`` if given, in training mode) and data, set up."""
    cfg = yaml.safe_load(CONFIG.read_text())
    mcfg, dcfg = dict(cfg["model"]), dict(cfg["data"])
    dcfg.update(train_dir=f"{a.data}/train", val_dir=f"{a.data}/dev", test_dir=None)
    dm = KaldiDataModule(**dcfg)
    dm.setup("fit")
    mcfg.update(optimizer=a.optimizer, lr=a.lr)
    model = SpeechRecognizer(input_dim=dm.hparams.num_mel_bins, **mcfg)
    model.model.cmvn.set_stats(*dm.cmvn_stats())
    if a.ckpt:
        model.load_state_dict(torch.load(a.ckpt, map_location="cpu")["state_dict"])
    model.train()
    return model, dm, dcfg


def _mean(key: str, rows: list[dict]) -> float:
    return sum(r[key] for r in rows) / len(rows)


def _clip_frac(rows: list[dict], key: str, clip: float | None) -> float:
    if clip is None:
        return 0.0
    vals = [v for r in rows for v in (r[key] if isinstance(r[key], list) else [r[key]])]
    return sum(v > clip for v in vals) / len(vals)


def summarise(records: list[dict], ranks: int, clip: float | None) -> list[dict]:
    """Means per 25 steps of the records."""
    summary = []
    for lo in range(0, len(records), 25):
        rows = records[lo:lo + 25]
        summary.append({
            "steps": [rows[0]["step"], rows[-1]["step"]], "ratio": _mean("ratio", rows),
            "proj": _mean("proj", rows), "ratio_noclip": _mean("ratio_noclip", rows),
            "proj_noclip": _mean("proj_noclip", rows), "cos": _mean("cos", rows),
            "grad_norm_ddp": _mean("grad_norm_ddp", rows),
            "grad_norm_local": sum(sum(r["grad_norm_local"]) for r in rows)
            / (len(rows) * ranks),
            "clipped_frac_ddp": _clip_frac(rows, "grad_norm_ddp", clip),
            "clipped_frac_local": _clip_frac(rows, "grad_norm_local", clip),
        })
    return summary


def _write(a: argparse.Namespace, records: list[dict], steps_per_epoch: int,
           size: int) -> list[dict]:
    """Summaries per 25 steps; writes the JSON (also every 25 steps: partial runs count)."""
    summary = summarise(records, a.ranks, a.clip or None)
    name = f"{a.optimizer}_lr{a.lr:g}_clip{a.clip:g}_from{a.start_epoch}.json"
    out = Path(a.json) if a.json else RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "steps_per_epoch": steps_per_epoch,
                               "params": size, "summary": summary, "records": records},
                              indent=1))
    return summary


class _Learners:
    """ddp's optimizer and the gossip learners' (clipped and not), over flat vectors."""

    def __init__(self, kind: str, size: int, momentum: float, ranks: int,
                 clip: float | None) -> None:
        self.clip = clip
        self.ddp = FlatOptimizer(kind, size, momentum)
        self.local = [FlatOptimizer(kind, size, momentum) for _ in range(ranks)]
        self.noclip = [FlatOptimizer(kind, size, momentum) for _ in range(ranks)]

    def step(self, grads: list[torch.Tensor], lr: float) -> tuple[torch.Tensor, dict]:
        """ddp's update (to follow) and the record of how the gossip mean's compares."""
        g_mean = torch.stack(grads).mean(0)
        u_ddp = self.ddp.update(clipped(g_mean, self.clip), lr)
        u_gossip = torch.stack([o.update(clipped(g, self.clip), lr)
                                for o, g in zip(self.local, grads)]).mean(0)
        u_noclip = torch.stack([o.update(g, lr) for o, g in zip(self.noclip, grads)]).mean(0)
        nd = float(u_ddp.norm())
        return u_ddp, {
            "grad_norm_ddp": float(g_mean.norm()),
            "grad_norm_local": [float(g.norm()) for g in grads],
            "ratio": float(u_gossip.norm()) / nd,
            "cos": float(torch.nn.functional.cosine_similarity(u_gossip, u_ddp, dim=0)),
            "ratio_noclip": float(u_noclip.norm()) / nd,
            "proj_noclip": float(u_noclip @ u_ddp) / nd**2,
            "proj": float(u_gossip @ u_ddp) / nd**2,
        }


def _local_grads(model: SpeechRecognizer, params: list[torch.Tensor], data: Any,
                 batches: tuple) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's gradient on its batch (flat), and the last loss."""
    grads = []
    for idx in batches:
        batch = collate_examples([data[i] for i in idx])
        model.zero_grad(set_to_none=True)
        loss, _, _ = model._loss(batch)
        loss.backward()
        grads.append(torch.cat([q.grad.reshape(-1) for q in params]))
    return grads, loss


def _follow(params: list[torch.Tensor], update: torch.Tensor) -> None:
    """Add ``update`` to the parameters (follow ddp's trajectory)."""
    with torch.no_grad():
        offset = 0
        for q in params:
            q.add_(update[offset:offset + q.numel()].view_as(q))
            offset += q.numel()


def main() -> None:
    a = _parser().parse_args()
    torch.manual_seed(a.seed)
    model, dm, dcfg = _setup(a)
    params = [q for q in model.parameters() if q.requires_grad]
    size = sum(q.numel() for q in params)
    data, hp = dm.datasets["train"], model.hparams
    learners = _Learners(a.optimizer, size, hp.momentum, a.ranks, a.clip or None)
    samplers = [LengthBucketBatchSampler(data.num_frames(), dcfg["batch_size"],
                                         num_replicas=a.ranks, rank=r, seed=dcfg["seed"])
                for r in range(a.ranks)]
    steps_per_epoch = len(samplers[0])
    records: list[dict] = []
    first = step = a.start_epoch * steps_per_epoch
    started = time.monotonic()
    while step < first + a.steps:
        epoch = step // steps_per_epoch
        for s in samplers:
            s.set_epoch(epoch)
        for batches in zip(*(iter(s) for s in samplers)):
            if step >= first + a.steps:
                break
            grads, loss = _local_grads(model, params, data, batches)
            lr = a.lr * lr_factor(step, epoch, warmup_steps=hp.warmup_steps,
                                  warmup_start=hp.warmup_start,
                                  anneal_start_epoch=hp.anneal_start_epoch,
                                  anneal_factor=hp.anneal_factor)
            u_ddp, compared = learners.step(grads, lr)
            records.append({"step": step, "epoch": epoch, "lr": lr,
                            "loss": float(loss.detach()), **compared})
            _follow(params, u_ddp)
            if step % 25 == 0:
                r = records[-1]
                print(f"step {step} loss {r['loss']:.3f} |g_ddp| {r['grad_norm_ddp']:.2f} "
                      f"|g_i| {sum(r['grad_norm_local']) / a.ranks:.2f} ratio {r['ratio']:.3f} "
                      f"(no clip {r['ratio_noclip']:.3f}) cos {r['cos']:.3f} "
                      f"[{time.monotonic() - started:.0f}s]", flush=True)
                _write(a, records, steps_per_epoch, size)
            step += 1

    for row in _write(a, records, steps_per_epoch, size):
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                          for k, v in row.items()}))


if __name__ == "__main__":
    main()
