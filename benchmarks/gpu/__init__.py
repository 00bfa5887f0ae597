"""The one-GPU check (``python -m benchmarks.gpu.check``): exactness and step times of the
gossip strategies with two ranks sharing one device."""
