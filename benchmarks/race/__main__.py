"""``python -m benchmarks.race``: runs the race's driver, :mod:`benchmarks.race.driver`, as
``python -m benchmarks.race.driver`` would."""

import runpy

runpy.run_module("benchmarks.race.driver", run_name="__main__", alter_sys=True)
