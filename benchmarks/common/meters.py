"""What the benchmarks measure inside a fit: Lightning callbacks and clocks.

For the ranks only (it imports torch and Lightning at once; a driver never imports it).

* :class:`StepTimer`: the wall time of every step (between two ``on_train_batch_end`` calls),
  optionally the training thread's time in gossip (:class:`GossipClock`) and the CPU time of
  every thread (:func:`thread_cpu`) at two chosen steps;
* :class:`ThroughputMeter`: the wall-clock window, samples and steps of one rank's fit, with an
  optional sleep after every step (a straggler);
* :class:`EpochMeter`: epoch times and samples, with an optional reading (link counters) when
  training starts.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback


def intervals(ends: list[float], skip: int = 0) -> list[float]:
    """Differences of consecutive times in ``ends``, the first ``skip`` dropped."""
    return [b - a for a, b in zip(ends[:-1], ends[1:])][skip:]


# ----------------------------------------------------------------------------------------------
# CPU time per thread
# ----------------------------------------------------------------------------------------------
def thread_cpu() -> dict[str, float] | None:
    """CPU seconds used so far by this process's threads, grouped: ``training`` (the main
    thread), Python threads by name without their trailing number, ``native`` for the
    threads Python does not know (gloo's, torch's). ``None`` where ``/proc`` has no tasks."""
    task = Path("/proc/self/task")
    if not task.is_dir():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    named = {th.native_id: th.name for th in threading.enumerate()}
    main = threading.main_thread().native_id
    groups: dict[str, float] = {}
    for d in task.iterdir():
        try:  # schedstat: nanoseconds on the CPU; stat: user + system in clock ticks
            seconds = int((d / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            try:
                stat = (d / "stat").read_text()
            except OSError:  # the thread ended meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick
        tid = int(d.name)
        group = ("training" if tid == main else
                 re.sub(r"[-_]?\d+$", "", named[tid]) if tid in named else "native")
        groups[group] = groups.get(group, 0.0) + seconds
    return groups


def cpu_per_step(start: dict[str, float] | None, end: dict[str, float] | None,
                 steps: int) -> dict[str, float]:
    """CPU seconds per step and group between two :func:`thread_cpu` readings."""
    if not start or not end or steps <= 0:
        return {}
    return {g: (end[g] - start.get(g, 0.0)) / steps for g in end}


# ----------------------------------------------------------------------------------------------
# Step time
# ----------------------------------------------------------------------------------------------
class GossipClock:
    """Seconds the calling threads spent in the methods :meth:`wrap` has wrapped (summed)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, owner: type, names: Iterable[str]) -> None:
        """Replace ``owner.<name>`` for every name by a wrapper that adds its time here.

        Works on any version of the package that has these methods, so before/after figures
        come from the same script."""
        for name in names:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


class StepTimer(Callback):
    """``time.perf_counter()`` at every ``on_train_batch_end`` (in :attr:`ends`).

    ``sync_cuda``: after a ``torch.cuda.synchronize()``. ``clock``: also record its reading
    (in :attr:`gossip`). ``cpu_at``: the batch ends (0-based) at which :func:`thread_cpu` is
    read (into :attr:`cpu`).
    """

    def __init__(self, sync_cuda: bool = False, clock: GossipClock | None = None,
                 cpu_at: tuple[int, ...] = ()) -> None:
        self.sync_cuda, self.clock, self.cpu_at = sync_cuda, clock, cpu_at
        self.ends: list[float] = []
        self.gossip: list[float] = []
        self.cpu: list[dict[str, float] | None] = []

    def on_train_batch_end(self, *args: Any) -> None:
        if self.sync_cuda:
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        if self.clock is not None:
            self.gossip.append(self.clock.seconds)
        if len(self.ends) - 1 in self.cpu_at:
            self.cpu.append(thread_cpu())


# ----------------------------------------------------------------------------------------------
# Throughput and epochs
# ----------------------------------------------------------------------------------------------
def first_len(batch: Any) -> int:
    """Samples of an ``(inputs, target)`` batch."""
    return len(batch[0])


class ThroughputMeter(Callback):
    """Wall-clock window, samples, steps (per epoch too) and step ends of this rank; optional
    per-step sleep.

    ``factor > 0``: after every step sleep ``factor x`` the time that step took (from
    ``on_train_batch_start`` to ``on_train_batch_end``); else sleep ``sleep_s``.
    ``samples_of(batch)``: how many samples a batch holds.
    """

    def __init__(self, sleep_s: float = 0.0, factor: float = 0.0,
                 samples_of: Callable[[Any], int] = first_len) -> None:
        self.sleep_s, self.factor, self.samples_of = sleep_s, factor, samples_of
        self.t_start = self.t_end = float("nan")
        self.samples = self.steps = 0
        self.slept = 0.0
        self.ends: list[float] = []
        self.epoch_steps: list[int] = []
        self._batch_start = 0.0

    def on_train_start(self, *args: Any) -> None:
        self.t_start = time.time()

    def on_train_epoch_start(self, *args: Any) -> None:
        self.epoch_steps.append(0)

    def on_train_batch_start(self, *args: Any) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pause = self.sleep_s
        if self.factor > 0:
            pause = self.factor * (time.perf_counter() - self._batch_start)
        if pause > 0:
            time.sleep(pause)
            self.slept += pause
        self.samples += self.samples_of(batch)
        self.steps += 1
        self.epoch_steps[-1] += 1
        self.t_end = time.time()
        self.ends.append(time.perf_counter())

    def median_step_s(self) -> float:
        """Median step time, the first two steps dropped when there are more."""
        steps = intervals(self.ends)
        steps = steps[2:] or steps
        return float(statistics.median(steps)) if steps else float("nan")

    def window(self) -> dict[str, Any]:
        """``t_start``, ``t_end``, ``samples``, ``steps`` and ``median_step_s``."""
        return {"t_start": self.t_start, "t_end": self.t_end, "samples": self.samples,
                "steps": self.steps, "median_step_s": self.median_step_s()}


class EpochMeter(Callback):
    """Epoch times and samples on this rank; ``read_at_start()`` (e.g. link counters) is
    called when training starts, its result kept in :attr:`counters_start`."""

    def __init__(self, read_at_start: Callable[[], Any] | None = None) -> None:
        self.read_at_start = read_at_start
        self.epoch_s: list[float] = []
        self.start: float | None = None
        self.train_start: float | None = None
        self.counters_start: Any = None
        self.samples = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.train_start = time.perf_counter()
        if self.read_at_start is not None:
            self.counters_start = self.read_at_start()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.samples += len(batch[0])

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        assert self.start is not None
        self.epoch_s.append(time.perf_counter() - self.start)
