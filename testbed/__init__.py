"""What the tests and the benchmarks both run on (not part of the installed package).

* :mod:`testbed.launch`: the one launcher of real multi-process runs (torchrun, SLURM-style
  tasks, Lightning's popen launcher), with stack dumps on timeout and no process left behind;
* :mod:`testbed.cluster_net`: an emulated cluster of network namespaces joined by rate-limited
  links (needs root);
* :mod:`testbed.slurm_cluster`: a real SLURM (slurmctld, one slurmd per emulated node) on it;
* :mod:`testbed.fuzz`, :mod:`testbed.emergency_fuzz`, :mod:`testbed.elastic_fuzz`,
  :mod:`testbed.exit_soak`: seeded fault campaigns over the rank scripts of ``tests/scripts/``
  (the last one checks every process's exit status).

Nothing here imports :mod:`benchmarks`; the library imports nothing from here.
"""
