"""The benchmarks, by purpose (see ``benchmarks/README.md``); run from the repository root as
modules, e.g. ``python -m benchmarks.perf.step_time``.

* :mod:`benchmarks.perf`: step time, stragglers, flat storage, wire dtypes, the emulated
  cluster and the ``plan`` cost model against it;
* :mod:`benchmarks.race`: strategies raced to a target metric on an emulated cluster;
* :mod:`benchmarks.gpu`: the one-GPU check;
* :mod:`benchmarks.common`: what the scripts share (the driver/worker harness, command line,
  meters, Trainers, workloads).

The launcher and the emulated cluster they run on are :mod:`testbed`'s.
"""
