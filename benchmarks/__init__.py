"""The benchmark scripts (run as files: ``python3 benchmarks/<script>.py``, ``torchrun
benchmarks/<script>.py``), a package so that the tests and TorchTitan's ``--override.imports``
import their parts by name (``benchmarks.bench_dispatch_combine``, ``benchmarks.torchtitan_trainer``)."""
