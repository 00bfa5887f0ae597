"""What the one-GPU check checks and times (shared by its driver, :mod:`benchmarks.gpu.check`,
and its Lightning checks, :mod:`benchmarks.gpu.cases`; standard library only)."""

REQUIREMENTS = ("torch", "lightning", "numpy")
CHECKS = ("dpsgd_exact", "adpsgd_sum", "adpsgd_stream", "bf16_dpsgd", "bf16_adpsgd")
TIMED = ("ddp", "dpsgd_overlap", "dpsgd_delay1", "adpsgd")
WORLD = 2
