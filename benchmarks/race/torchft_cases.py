"""torchft's LocalSGD and DiLoCo as race cases (``torchft_localsgd``, ``torchft_diloco``).

torchft (``pip install 'lightning-gossip[race]'``, pinned; never a dependency of the library)
is optional: :func:`unavailable` says why the cases cannot run, and the race skips them.

Set up as torchft's own examples (``train_diloco.py``, ``local_sgd_integ_test.py``) do, with
one **replica group per emulated node**:

* the driver (``benchmarks/race/driver.py``) starts one ``torchft_lighthouse`` (:class:`Lighthouse`,
  ``--min_replicas`` = nodes) inside node 0's namespace and stops it on every exit;
* inside a node the ranks are ordinary DDP on the node's process group (Lightning's
  ``DDPStrategy(process_group=node_group)``: gradients all-reduced inside the node every step,
  nothing on the link), exactly as the race's post-local SGD cases;
* per node and case, a ``TCPStore`` of the replica group (served by the node's local rank 0 on
  the node's address), and per rank a torchft ``Manager`` (``replica_id`` ``race_node<k>``,
  ``group_rank`` = local rank, ``init_sync=False`` since every case starts from the same
  seed) with a reconfigurable ``ProcessGroupGloo``: local rank ``j`` of every node forms one
  cross-node group, which carries the full model's average every ``sync_every`` steps;
* ``LocalSGD(manager, module, optimizer, sync_every)`` or ``DiLoCo(manager, [module], inner
  optimizer, outer SGD(lr 0.7, momentum 0.9, nesterov), sync_every)`` (the DiLoCo paper's and
  torchft's example's outer optimizer; a case may give its own ``outer_lr``/``outer_momentum``:
  :func:`outer_optimizer`), entered on Lightning's optimizer: both hook the optimizer's step,
  so Lightning's own loop drives them.

torchft's manager and checkpoint servers bind IPv6 wildcard sockets (``[::]``): the
namespaces need IPv6 (on by default; ``cluster_net`` checks it, :func:`ipv6_problem`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

PIN = "torchft==0.2.0"
"""The torchft release the race was run with (the ``race`` extra of ``pyproject.toml``)."""

LIGHTHOUSE_PORT = 29510
"""torchft's default lighthouse port."""

STORE_PORT_BASE = 29610
"""A node's replica-group ``TCPStore`` for case ``i`` listens on this port + ``i``."""

HEARTBEAT_TIMEOUT_MS = 5000
"""The lighthouse's ``--heartbeat_timeout_ms`` (torchft's default). A replica that stopped
heartbeating still counts for this long: a case whose first quorum came sooner would wait for
the previous case's managers to expire (measured: 5 s at the first DiLoCo sync after a LocalSGD
case), so :meth:`TorchFTSync.close` waits it out, off the race's clock."""

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
"""DiLoCo's outer optimizer: SGD, Nesterov momentum (the DiLoCo paper, torchft's example)."""

KINDS = ("torchft_localsgd", "torchft_diloco")
"""Case kinds driven by torchft."""


def outer_optimizer(case: dict[str, Any]) -> tuple[float, float]:
    """DiLoCo's outer SGD (lr, momentum) of ``case`` (default: the paper's 0.7, Nesterov 0.9);
    Nesterov wherever the momentum is not 0. ``(1.0, 0.0)`` is the identity point: the outer
    step adds the averaged delta, which is LocalSGD.

    >>> outer_optimizer({}), outer_optimizer({"outer_lr": 1.0, "outer_momentum": 0.0})
    ((0.7, 0.9), (1.0, 0.0))
    """
    return (float(case.get("outer_lr", OUTER_LR)),
            float(case.get("outer_momentum", OUTER_MOMENTUM)))


def unavailable() -> str | None:
    """None when torchft imports here, else why not (with the install command)."""
    try:
        import torchft  # noqa: F401
    except Exception as e:  # ImportError, or a binary that does not load
        return (f"torchft is not importable ({type(e).__name__}: {e}); install the benchmark "
                f"extra: .tools/bin/uv pip install --python .venv/bin/python -c "
                f"constraints.txt -e '.[race]' (pins {PIN})")
    return None


def lighthouse_binary() -> str:
    """Path of ``torchft_lighthouse`` (next to this interpreter in a venv, else on PATH)."""
    here = Path(sys.executable).with_name("torchft_lighthouse")
    if here.exists():
        return str(here)
    found = shutil.which("torchft_lighthouse")
    if found is None:
        raise FileNotFoundError("torchft_lighthouse not found (is torchft installed?)")
    return found


def expected_ratio(steps: int, period: int, nodes: int, procs: int) -> float:
    """Link bytes per step over ddp's, for LocalSGD/DiLoCo syncing every ``period`` steps.

    gloo's ring all-reduce of ``M`` bytes over ``n`` ranks sends ``2 (n - 1) / n M`` per rank
    to its ring successor. ddp's ring over all ``W = nodes x procs`` ranks crosses each node's
    link once: ``2 (W - 1) / W M`` per node per step. torchft's group ``j`` (local rank ``j`` of
    every node) averages the whole model over ``nodes`` ranks, and every one of a node's
    ``procs`` ranks is in one: ``procs 2 (nodes - 1) / nodes M`` per node per sync, one sync
    every ``period`` steps (``steps // period`` in the run).

    >>> round(expected_ratio(160, 16, 2, 2), 4)  # 2 x 1 M / 1.5 M / 16
    0.0833
    >>> expected_ratio(64, 16, 4, 1)  # one rank per node: ddp's ring, 1/period
    0.0625
    """
    world = nodes * procs
    per_sync = procs * (nodes - 1) / nodes / ((world - 1) / world)
    return per_sync * (steps // period) / steps if steps > 0 else 0.0


class Lighthouse:
    """One ``torchft_lighthouse`` in a node's namespace, for the whole race (driver side).

    Args:
        prefix: command prefix that runs a program in the node (``cluster.exec_prefix(0)``).
        address: the node's address (the lighthouse binds ``[::]``, IPv4 reaches it too).
        replicas: ``--min_replicas``: the number of nodes (replica groups).
        log: file the lighthouse writes to.
    """

    def __init__(self, prefix: list[str], address: str, replicas: int, log: Path) -> None:
        self.url = f"http://{address}:{LIGHTHOUSE_PORT}"
        self.cmd = [*prefix, lighthouse_binary(), "--min_replicas", str(replicas),
                    "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                    "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS),
                    "--bind", f"[::]:{LIGHTHOUSE_PORT}"]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, settle_s: float = 1.0) -> Lighthouse:
        """Start it; raise if it exits within ``settle_s`` (its log tail in the message)."""
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        time.sleep(settle_s)
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"torchft_lighthouse exited ({self.proc.returncode}): {tail}")
        return self

    def stop(self) -> None:
        """Terminate it (kill after 10 s). Idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> Lighthouse:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TorchFTSync:
    """A rank's torchft part of a case: store, process group, manager, LocalSGD/DiLoCo.

    Built in ``on_fit_start`` (Lightning's optimizer exists then), closed at the fit's end or
    on an exception. The node's local rank 0 serves the replica group's ``TCPStore``.

    Args:
        case: the race case (``kind``, ``period``).
        index: the case's position in the race (its store port).
        module: the LightningModule (all its parameters are averaged).
        optimizer: Lightning's (torch) optimizer of the module.
        ctx: the rank's race context (``rank``, ``local_rank``, ``procs``, ``nodes``,
            ``node_group``, ``torchft``: lighthouse URL and node addresses, ``timeout``).
    """

    def __init__(self, case: dict[str, Any], index: int, module: Any, optimizer: Any,
                 ctx: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo, LocalSGD

        procs = int(ctx["procs"])
        node, local = ctx["rank"] // procs, ctx["local_rank"]
        address = ctx["torchft"]["addresses"][node]
        port = STORE_PORT_BASE + index
        timeout: timedelta = ctx["timeout"]
        self.node_group = ctx["node_group"]
        self.server = (TCPStore(address, port, is_master=True, wait_for_workers=False,
                                timeout=timeout) if local == 0 else None)
        dist.barrier(group=self.node_group)  # the store is up before any manager connects

        def state_dict() -> dict[str, Any]:
            return {"model": module.state_dict(), "optim": optimizer.state_dict()}

        def load_state_dict(sd: dict[str, Any]) -> None:
            module.load_state_dict(sd["model"])
            optimizer.load_state_dict(sd["optim"])

        diloco = case["kind"] == "torchft_diloco"
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=int(ctx["nodes"]), use_async_quorum=not diloco,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=local, world_size=procs, store_addr=address, store_port=port,
            lighthouse_addr=ctx["torchft"]["lighthouse"], replica_id=f"race_node{node}",
            hostname=address, init_sync=False)
        period = int(case["period"])
        if diloco:
            lr, momentum = outer_optimizer(case)
            self.outer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)
            self.wrapper: Any = DiLoCo(self.manager, [module], optimizer, self.outer,
                                       sync_every=period, backup_device=torch.device("cpu"),
                                       pin_memory=False)
        else:
            self.wrapper = LocalSGD(self.manager, module, optimizer, sync_every=period)
        self.wrapper.__enter__()
        self.closed = False

    def commits(self) -> int:
        """Syncs the manager committed (its step)."""
        return int(self.manager.current_step())

    def close(self) -> None:
        """Unhook the optimizer, stop the manager and process group, then the store, and wait
        until the lighthouse has forgotten this manager (the clock is stopped). Idempotent;
        collective on the node's group (every rank of the node calls it)."""
        if self.closed:
            return
        self.closed = True
        import torch.distributed as dist

        self.wrapper.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        self.pg.shutdown()
        dist.barrier(group=self.node_group)  # nobody uses the store any more
        self.server = None
        time.sleep(HEARTBEAT_TIMEOUT_MS / 1000 + 1.0)


def ipv6_problem(prefix: list[str]) -> str | None:
    """None when IPv6 is usable in the namespace run by ``prefix``, else what is wrong.

    torchft's manager and checkpoint servers bind ``[::]``; a namespace with IPv6 disabled
    (``net.ipv6.conf.all.disable_ipv6=1``) makes them fail at start-up.
    """
    probe = ("import socket; s = socket.socket(socket.AF_INET6); s.bind(('::', 0)); "
             "print(s.getsockname()[1])")
    p = subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=30)
    if p.returncode != 0:
        return f"cannot bind an IPv6 socket in the namespace: {p.stderr.strip()[-300:]}"
    return None
