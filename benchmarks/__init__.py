"""Benchmarks of jax_nvfp4, each run from the repository root as a module: ``python -m benchmarks.<name> --help``.

``benchmarks.timing`` holds their shared helpers (median wall time, the machine's name, the markdown report); the
ones that train or compile the example's model import it from ``examples.lm``. Recorded reports are in
``benchmarks/results/``.
"""
