"""Suite-wide settings, read before any test module imports numpy.

OpenBLAS's default thread pool (one thread per core) spins against whatever else the machine runs: on this
2-core machine, under load, an ARIMA(1,1,1) fit took 149-580 ms median and 4-5.5 s at worst with the default
against 30 ms and under 50 ms with one thread (testbed/benchmarks/bench_forecast.py measures both side by side). The
forecast tests fit dozens of models, so the suite runs OpenBLAS single-threaded unless told otherwise.
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
