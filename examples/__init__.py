"""Examples of jax_nvfp4, run from the repository root as modules.

    python -m examples.train_lm [flags]         train a small byte-level transformer in NVFP4 and bf16
    python -m examples.generate DIR [flags]      sample text from a model that train_lm --save wrote
    python -m examples.quantize_tensor [flags]   quantize real tensors to NVFP4 and report the error

The training example's model, data and training loop are the package ``examples.lm``, which the benchmarks and
tests import.
"""
