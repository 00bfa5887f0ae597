"""Performance benchmarks: step time, stragglers, flat storage, wire dtypes, the emulated
cluster, and the ``plan`` cost model against the cluster's measurements."""
