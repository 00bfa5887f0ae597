"""The race: strategies trained to a target metric on an emulated cluster
(``python -m benchmarks.race``; the driver is :mod:`benchmarks.race.driver`)."""
