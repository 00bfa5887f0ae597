"""The benchmarks' workloads: data sets and the LightningModules trained on them.

For the ranks only (it imports torch and Lightning at once; a driver never imports it). The
classes live at module level so a worker process can pickle or re-import them. Each model is
built exactly as the scripts built their own copies before (same layers in the same order, so
the same initial weights under the same seed).

* :func:`digits_split`, :func:`digits_80_20`: scikit-learn's bundled handwritten digits;
* :class:`Classifier`: an MLP with cross-entropy and SGD (digits, synthetic data);
* :class:`FixedBatchMLP`: an MLP trained on one fixed random batch, with an optional sleep per
  step (``step_time.py``: data loading not measured, accelerator compute simulated);
* :func:`lm_datasets`, :class:`LanguageModel`: next-word prediction on a word-id sequence
  with Lightning's demo Transformer (``wire_convergence.py``);
* :func:`asr_datamodule`, :func:`asr_model`: the ASR recipe's data module (features cached)
  and recognizer (``asr_straggler.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import TensorDataset


# ----------------------------------------------------------------------------------------------
# Digits
# ----------------------------------------------------------------------------------------------
def digits_split(num_train: int = 1400) -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits scaled to [0, 1], split by a fixed permutation (seed 0): the
    first ``num_train`` images as a ``TensorDataset``, the rest as ``(x_val, y_val)``."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    xt = torch.tensor(x / 16.0, dtype=torch.float32)
    yt = torch.tensor(y)
    perm = torch.randperm(len(yt), generator=torch.Generator().manual_seed(0))
    train, val = perm[:num_train], perm[num_train:]
    return TensorDataset(xt[train], yt[train]), xt[val], yt[val]


def digits_80_20() -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """Digits scaled to [0, 1], an 80/20 stratified split (scikit-learn, ``random_state=0``):
    ``(train dataset, x_test, y_test)``."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    train = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr))
    return train, torch.from_numpy(x_te), torch.from_numpy(y_te)


# ----------------------------------------------------------------------------------------------
# MLPs
# ----------------------------------------------------------------------------------------------
def mlp(dims: Sequence[int]) -> nn.Sequential:
    """``Linear(dims[0], dims[1]), ReLU, ..., Linear(dims[-2], dims[-1])``."""
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def mlp_params(dims: Sequence[int]) -> int:
    """Parameters (weights and biases) of :func:`mlp` ``(dims)``.

    >>> mlp_params([64, 128, 10])
    9610
    """
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


class Classifier(L.LightningModule):
    """:func:`mlp` ``(dims)`` on ``(inputs, target)`` batches, cross-entropy, SGD.

    ``record_losses``: append every step's loss to :attr:`losses` (a host sync per step).
    """

    def __init__(self, dims: Sequence[int], lr: float, momentum: float = 0.9,
                 record_losses: bool = False) -> None:
        super().__init__()
        self.net = mlp(dims)
        self.lr, self.momentum, self.record_losses = lr, momentum, record_losses
        self.losses: list[float] = []

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        loss = nn.functional.cross_entropy(self.net(inputs), target)
        if self.record_losses:
            self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    @torch.no_grad()
    def accuracy(self, inputs: torch.Tensor, target: torch.Tensor) -> float:
        """Fraction of ``inputs`` classified as ``target``."""
        return (self.net(inputs).argmax(-1) == target).float().mean().item()


class FixedBatchMLP(L.LightningModule):
    """:func:`mlp` ``(dims)`` trained on one fixed random batch (data loading is not
    measured: the loader's batches only say how many rows to use); ``compute_ms``: sleep this
    long in every step (an accelerator busy, this CPU free). SGD, lr 1e-3, momentum 0.9."""

    def __init__(self, dims: Sequence[int], batch_size: int, seed: int,
                 compute_ms: float = 0.0) -> None:
        super().__init__()
        self.net = mlp(dims)
        self.compute_ms = compute_ms
        g = torch.Generator().manual_seed(seed)
        # Plain attributes, not buffers: buffers would be gossiped with the weights.
        self.x = torch.randn(batch_size, dims[0], generator=g)
        self.y = torch.randint(0, dims[-1], (batch_size,), generator=g)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        n = len(batch[0])
        if self.compute_ms:
            time.sleep(self.compute_ms / 1e3)
        return nn.functional.cross_entropy(self.net(self.x[:n]), self.y[:n])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


# ----------------------------------------------------------------------------------------------
# Language model
# ----------------------------------------------------------------------------------------------
def lm_blocks(tokens: torch.Tensor, block: int) -> TensorDataset:
    """``(inputs, next words)`` pairs of ``block`` tokens each, cut from ``tokens``."""
    n = (len(tokens) - 1) // block
    return TensorDataset(tokens[: n * block].view(n, block),
                         tokens[1: n * block + 1].view(n, block))


def lm_datasets(ids: Sequence[int], block: int,
                train_fraction: float = 0.9) -> tuple[TensorDataset, TensorDataset]:
    """Training and held-out :func:`lm_blocks`: the first ``train_fraction`` of the words,
    and the rest."""
    tokens = torch.tensor(ids)
    split = int(len(tokens) * train_fraction)
    return lm_blocks(tokens[:split], block), lm_blocks(tokens[split:], block)


class LanguageModel(L.LightningModule):
    """Lightning's demo Transformer as a next-word model (the decoder is given the inputs,
    not the targets it predicts); NLL loss, SGD with momentum 0.9."""

    def __init__(self, vocab: int, width: int, lr: float) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.vocab, self.lr = vocab, lr
        self.model = Transformer(vocab_size=vocab, ninp=width, nhead=2, nhid=width, nlayers=2,
                                 dropout=0.1)

    def loss(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = self.model(inputs, inputs)  # the decoder sees the inputs, not the targets
        return nn.functional.nll_loss(out.reshape(-1, self.vocab), target.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    @torch.no_grad()
    def held_out(self, data: TensorDataset, chunk: int = 64) -> dict[str, float]:
        """Mean loss and perplexity on ``data`` (evaluation mode)."""
        self.eval()
        inputs, target = data.tensors
        losses = [self.loss(inputs[i:i + chunk], target[i:i + chunk]).item()
                  * len(inputs[i:i + chunk]) for i in range(0, len(inputs), chunk)]
        loss = sum(losses) / len(inputs)
        return {"val_loss": loss, "val_ppl": math.exp(loss)}


# ----------------------------------------------------------------------------------------------
# ASR recipe
# ----------------------------------------------------------------------------------------------
def asr_datamodule(corpus: Path, batch_size: int, seed: int) -> Any:
    """The recipe's ``KaldiDataModule`` on ``corpus/train`` and ``corpus/test``, set up, with
    every utterance's features computed (and cached) now, before any timing."""
    from recipes.asr.datamodule import KaldiDataModule

    data = KaldiDataModule(train_dir=str(corpus / "train"), test_dir=str(corpus / "test"),
                           batch_size=batch_size, eval_batch_size=32, cache_features=True,
                           cmvn_utterances=300, seed=seed)
    data.setup("fit")
    data.setup("test")
    for split in ("train", "test"):
        dataset = data.datasets[split]
        for i in range(len(dataset)):
            dataset.features(i)
    return data


def asr_model(spec: dict[str, Any], report_dir: Path) -> Any:
    """The recipe's BLSTM-CTC ``SpeechRecognizer``, seeded with ``spec["seed"]``."""
    from recipes.asr.recognizer import SpeechRecognizer

    torch.manual_seed(spec["seed"])
    return SpeechRecognizer(
        num_layers=spec["layers"], hidden_size=spec["hidden"], frame_stacking=3, lr=spec["lr"],
        warmup_steps=spec["warmup_steps"], anneal_start_epoch=spec["anneal_start_epoch"],
        anneal_factor=spec["anneal_factor"], report_dir=str(report_dir))
