"""What the benchmark scripts share: the driver/worker harness, the command line, the meters,
the Trainers and the workloads."""
