"""Leaving the process with its true exit status: every thread of the library is known
(:func:`track`), stopped and joined before the interpreter finalizes (:func:`join_threads`, run
by an ``atexit`` handler), and a thread that cannot be joined never gets to abort the process.

Why: at finalization CPython (3.13 and earlier) ends any other thread that takes the GIL back;
the forced unwind through pybind11's ``gil_scoped_release`` calls ``std::terminate``, and the
process dies of ``SIGABRT`` (exit status -6 or 134, "terminate called without an active
exception") after the fit had finished. A thread waiting in a gloo ``Work.wait()`` (an exchange
abandoned on a lost peer) or in a store operation is such a thread once its wait ends, e.g.
when a peer process exits during this one's finalization.

What the ``atexit`` handler does, registered when this module is imported (so it runs after
every handler registered later: Lightning's, a logger's), and only when a tracked thread still
runs:

1. sets :data:`EXITING` (every wait of :mod:`lightning_gossip.liveness.waits` then returns) and
   calls each tracked thread's stop (the gossip threads' stop flags, the heartbeat);
2. joins them; a thread still waiting in gloo after :data:`STOP_S` seconds gets its wait ended:
   every gloo group of the process is *released* (:func:`release`: a receive with a timeout of
   1 ms on it makes gloo close that group's connections, which fails every send and receive
   waiting on it from a given peer, at once);
3. joins them again, at most :data:`JOIN_S` seconds in all;
4. when the groups had to be released and the threads then ended, after a peer was found
   frozen, killed or cut off (:func:`peer_lost`, the heartbeat's monitor), every object the
   garbage collector tracks is frozen (``gc.freeze()``): the interpreter's finalization then
   skips its collections over them (4.6-5.0 s of a survivor's exit at a load of 8,
   ``testbed.frozen_exit``); every ``atexit`` handler still runs, the modules' globals are
   still cleared, objects left in reference cycles are not finalized (memory goes back with
   the process; a file in such a cycle that was never closed keeps what it had not flushed);
5. if one still runs (a store operation on a frozen store host; a receive from any source,
   which gloo does not fail when connections close: the library posts none), the last resort:
   one line on standard error says so, standard output and error are flushed, logging is shut
   down (every handler flushed and closed), and the process leaves with :func:`os._exit` and
   the status the interpreter would have given it (:func:`exit_status`; for it ``sys.exit``
   records its status once this module is imported). Files already written and closed
   (checkpoints, a logger's files, which Lightning finalizes when the fit ends) are complete;
   the ``atexit`` handlers registered before this module's import (``logging``'s own,
   ``multiprocessing``'s) and the interpreter's finalization are skipped.

Nothing happens at exit when every tracked thread has ended (the usual case): the interpreter
finalizes as always.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch

from lightning_gossip import _compat

__all__ = ["EXITING", "JOIN_S", "STOP_S", "exit_status", "join_threads", "peer_lost", "record_exit",
           "release", "keep", "spawn", "track"]

#: set when the interpreter exits (this module's ``atexit`` handler): every library wait returns
EXITING = threading.Event()
#: seconds the ``atexit`` handler gives the tracked threads to end after their stop, before it
#: releases the process groups
STOP_S = 0.5
#: seconds the ``atexit`` handler gives the tracked threads in all, releases included
JOIN_S = 3.0
#: the tag of a release's receive (no message is ever sent with it)
RELEASE_TAG = 0x4C47_0001

_lock = threading.Lock()
#: thread -> (its stop, the groups its waits use): weak keys, so an ended thread is forgotten
_tracked: weakref.WeakKeyDictionary[threading.Thread, tuple[Callable[[], None] | None,
                                                           tuple[Any, ...]]]
_tracked = weakref.WeakKeyDictionary()
_recorded: list[int] = []
_kept: list[Any] = []  # groups whose work was abandoned (:func:`keep`)
_released = False  # the groups were released: a tracked thread waited on a peer at exit
_lost = False  # a peer was found frozen, killed or cut off (:func:`peer_lost`)


def track(thread: threading.Thread, stop: Callable[[], None] | None = None,
          groups: Iterable[Any] = ()) -> threading.Thread:
    """Make ``thread`` (a library thread that may wait in torch.distributed) known to the
    ``atexit`` handler: ``stop`` asks it to end (``None``: it ends when its wait does),
    ``groups`` are the process groups its waits use (released when it does not end; every gloo
    group registered with torch.distributed is released anyway). Returns ``thread``."""
    with _lock:
        _tracked[thread] = (stop, tuple(g for g in groups if g is not None))
    return thread


def spawn(target: Callable[..., object], name: str, stop: Callable[[], None] | None = None,
          groups: Iterable[Any] = (), args: tuple[Any, ...] = ()) -> threading.Thread:
    r"""Start ``target(*args)`` in a daemon thread called ``name``, :func:`track`\ ed with
    ``stop`` and ``groups``; returns the thread."""
    thread = track(threading.Thread(target=target, args=args, daemon=True, name=name), stop,
                   groups)
    thread.start()
    return thread


def running() -> list[threading.Thread]:
    """The tracked threads still alive (other than the calling one)."""
    with _lock:
        threads = list(_tracked.keys())
    return [t for t in threads if t.is_alive() and t is not threading.current_thread()]


def release(group: Any) -> bool:
    """Close the connections of the gloo process group ``group``, so that every send and
    receive waiting on it from a given peer fails at once: a receive with a timeout of 1 ms,
    on which gloo closes the group's connections ("Application timeout caused pair closure";
    torch 2.9.1 binds no ``Work.abort()``, and ``ProcessGroupGloo.abort()`` does not end a
    wait). The group cannot be used afterwards; its peers see closed connections, as when this
    process exits. A receive from any source is not ended so. The receive is tried from each
    peer in turn: one whose connection is closed already (it exited) fails at once and closes
    nothing. Returns whether the group was released (not: one member, not gloo, or unusable);
    never raises."""
    try:
        if group.size() < 2 or "gloo" not in _backend_name(group):
            return False
        me, size = group.rank(), group.size()
    except Exception:  # noqa: BLE001 - a group already unusable
        return False
    for peer in (r for r in range(size) if r != me):
        try:
            group.recv([torch.empty(1)], peer, RELEASE_TAG).wait(timedelta(milliseconds=1))
        except Exception as e:  # noqa: BLE001
            if "timed out" in str(e).lower():
                return True  # gloo closed every connection of the group
            # this peer's connection is closed already (it exited): it closes nothing; the next
    return True


def _backend_name(group: Any) -> str:
    try:
        return _compat.backend_name(group)
    except Exception:  # noqa: BLE001 - a group already unusable
        return ""


def keep(group: Any) -> bool:
    """Remember ``group``, one whose work was abandoned (released at exit when a thread still
    waits; :func:`~lightning_gossip.liveness.keep_alive_at_exit` also keeps it from being
    destroyed); ``False`` when it is remembered already."""
    with _lock:
        if any(g is group for g in _kept):
            return False
        _kept.append(group)
        return True


def _all_groups() -> list[Any]:
    """The groups of the tracked threads, those kept alive at exit and those torch knows."""
    groups: list[Any] = []
    with _lock:
        for _stop, own in list(_tracked.values()):
            groups += own
        groups += _kept
    try:
        groups += _compat.process_groups()
    except Exception:  # noqa: BLE001 - not initialised, or torch moved it
        pass
    unique: list[Any] = []
    for g in groups:
        if all(g is not u for u in unique):
            unique.append(g)
    return unique


def join_threads(stop_s: float = STOP_S, join_s: float = JOIN_S,
                 exiting: bool = True) -> list[threading.Thread]:
    """Stop every tracked thread and join it (see the module docstring, steps 1-3); returns
    those still running after ``join_s`` seconds. The groups are released only when a thread
    is still waiting after ``stop_s`` seconds. ``exiting=False``: :data:`EXITING` is cleared
    again at the end (a process that goes on, e.g. a test)."""
    EXITING.set()
    try:
        return _stop_and_join(stop_s, join_s)
    finally:
        if not exiting:
            EXITING.clear()


def _stop_and_join(stop_s: float, join_s: float) -> list[threading.Thread]:
    global _released
    with _lock:
        entries = [(t, stop) for t, (stop, _groups) in _tracked.items()]
    for thread, stop in entries:
        if stop is not None and thread.is_alive():
            try:
                stop()
            except Exception:  # noqa: BLE001 - a stop must not keep the others from theirs
                pass
    start = time.monotonic()
    _join(running(), start + stop_s)
    if running():
        _released = True
        for group in _all_groups():
            release(group)
    _join(running(), start + join_s)
    return running()


def _join(threads: list[threading.Thread], deadline: float) -> None:
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def peer_lost() -> None:
    """Record that a peer was found frozen, killed, cut off or gone after an error (the
    heartbeat's monitor calls it): at exit, after the groups had to be released, the
    interpreter's final collections are then skipped (the module docstring, step 4)."""
    global _lost
    _lost = True


def record_exit(error: BaseException) -> None:
    """Record the exit status ``error`` gives the process if it ends it (called by the
    strategies with the exception that ends a fit): a ``SystemExit``'s code, which the
    interpreter does not show an ``atexit`` handler (Lightning's ``SIGTERMException`` and its
    ``sys.exit(1)`` after ``Ctrl-C`` are ``SystemExit``)."""
    if isinstance(error, SystemExit):
        code = error.code
        _recorded[:] = [code if isinstance(code, int) else (0 if code is None else 1)]


def _recording_exit(status: object = None) -> None:
    """``sys.exit`` that records the status it gives the process (called from the main thread)
    first: the interpreter does not show it to an ``atexit`` handler, which the last resort
    needs (:func:`exit_status`)."""
    if threading.current_thread() is threading.main_thread():
        record_exit(SystemExit(status))
    _system_exit(status)


_system_exit = sys.exit


def exit_status() -> int:
    """The status the interpreter would give this process now that its main program ended:
    1 after an uncaught exception (it printed it: ``sys.last_value``), the code of the last
    ``SystemExit`` recorded (:func:`record_exit`: the one that ended a fit, and every
    ``sys.exit(code)`` of the main thread, which this module makes record its code), else 0.
    (``Ctrl-C`` outside a fit is -2: :func:`_leave` ends the process with ``SIGINT`` then, as
    Python does.) A ``raise SystemExit(code)`` outside a fit is not seen: 0."""
    last = getattr(sys, "last_value", None)
    if last is not None and not isinstance(last, SystemExit):
        return 1
    return _recorded[0] if _recorded else 0


def _at_exit() -> None:
    if not running():
        EXITING.set()
        return
    stuck = join_threads()
    if stuck:
        _leave(stuck)
    if _released and _lost:  # a lost peer left waits: no collections at finalization
        gc.freeze()


def _leave(stuck: list[threading.Thread]) -> None:
    """The last resort: say so, flush what the process wrote, then leave with its true status
    before the interpreter finalizes."""
    try:
        names = ", ".join(t.name for t in stuck)
        print(f"lightning_gossip: thread(s) {names} still waiting at exit; leaving with status "
              f"{exit_status()} without the interpreter's finalization (liveness.at_exit)",
              file=sys.stderr)
    except Exception:  # noqa: BLE001 - a closed stream: leave anyway
        pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream
            pass
    logging.shutdown()
    if isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(exit_status())


atexit.register(_at_exit)  # at import: after the handlers of everything imported later
sys.exit = _recording_exit
