"""The store thread: c10d store operations bounded in time (a frozen store host never answers,
and a ``TCPStore`` client has no deadline against it)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_gossip.liveness.at_exit import track

__all__ = ["bounded", "store_clients"]


def bounded(operation: Callable[[], Any], limit_s: float, what: str) -> Any:
    """``operation()`` on this process's store thread, waited for at most ``limit_s`` seconds
    (``TimeoutError`` naming ``what`` after that).

    A c10d ``TCPStore`` client has no deadline against a host that is frozen rather than
    dead (SIGSTOP: its connections stay open and nothing answers; measured, torch 2.9.1: a
    rank read the heartbeats of a frozen store host for over 10 minutes). One daemon thread
    runs the operations in turn (a hand-off, not a new thread per call: the shared samplers
    claim every batch here); while it is stuck on a frozen host, later operations time out
    too, and it ends when the host answers or the process exits.
    """
    global _store_thread
    with _store_lock:
        if _store_thread is None or not _store_thread.is_alive():  # first use, or after fork
            _store_thread = threading.Thread(target=_serve_store_jobs, daemon=True,
                                             name="lightning-gossip-store")
            # ended before the interpreter finalizes (liveness.at_exit): in a store operation
            # then, its return into Python would abort the process
            track(_store_thread, stop=lambda: _store_jobs.put(None))
            _store_thread.start()
    box: dict[str, Any] = {}
    done = threading.Event()
    _store_jobs.put((operation, box, done))
    if not done.wait(limit_s):
        raise TimeoutError(f"{what}: no answer from the store within {limit_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


_store_jobs: queue.SimpleQueue = queue.SimpleQueue()
_store_lock = threading.Lock()
_store_thread: threading.Thread | None = None


def _serve_store_jobs() -> None:
    while True:
        job = _store_jobs.get()
        if job is None:  # the interpreter exits
            return
        operation, box, done = job
        try:
            box["value"] = operation()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()


def store_clients(world_size: int, timeout: float,
                  fallback: dist.Store | None) -> tuple[list[dist.Store], int | None]:
    """Two dedicated clients of the rendezvous store (``MASTER_ADDR/PORT``) whose operations
    time out after ``timeout`` seconds, and the rank that hosts the store (``None``: torchrun's
    agent). Without ``MASTER_ADDR``/``MASTER_PORT`` (or when the connection fails)
    ``fallback`` twice (``RuntimeError`` without one)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    # torchrun's agent hosts the store unless it is not shared with the workers
    # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as restarts need): then rank 0 does
    host = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
    clients: list[dist.Store] = []
    if addr and port:
        try:
            for _ in range(2):
                clients.append(dist.TCPStore(
                    addr, int(port), world_size, is_master=False,
                    timeout=timedelta(seconds=timeout), wait_for_workers=False))
        except Exception:  # noqa: BLE001 - fall back to the shared client
            clients = []
    if not clients:
        if fallback is None:
            raise RuntimeError("Heartbeat.connect: no MASTER_ADDR/MASTER_PORT and no store")
        clients = [fallback, fallback]
    return clients, host
