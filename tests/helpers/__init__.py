"""What the test files share (no test file imports another): ``from helpers import ...``.

tests/ is on sys.path because tests/conftest.py lives there. The modules:

- ``core``: example counts, dtypes and implementations, random inputs, byte-exact comparisons, what a
  program runs, the CUDA binary tools (cuobjdump, nvdisasm);
- ``kernel_cases``: the cases that compare kernels with the reference and with each other (random tensors
  and options, the row-scaled and 4over6 option table, the recipe's options, the jitted reference);
- ``golden``: the golden files (tests/golden/) and the check against one, and the stochastic-rounding vectors;
- ``sr_place``: a slice's place in the whole tensor for stochastic rounding, and the parts it must reproduce;
- ``gemm``: the GEMM's float64 oracle, hand-built operands, the dense layer's problem and gradients;
- ``training``: a few Adam steps of an NNX model (the Flax tests' training loop);
- ``cuda_host``: the CUDA kernels on the CPU through the host model (``from helpers import cuda_host``; not
  imported here: only the CUDA tests load the host model's module and, under pytest-xdist, its thread setting).
"""

from .core import (
    CPUS,
    DTYPES,
    FIELDS,
    IMPLEMENTATIONS,
    IMPLS,
    KERNEL_CASES_ONLY,
    SPECIAL_VALUES,
    assert_same_bytes,
    assert_same_tensor,
    assert_same_tree,
    canonical_zero_codes,
    columnwise_as_rowwise,
    cuda_tool,
    dequantized_blocks,
    eqns_named,
    examples,
    needs_8_cpus,
    needs_8_devices,
    normal,
    quantized_shapes,
    random_normal,
    random_tensor,
    raw_bytes,
    stablehlo_functions,
    unpack,
)
from .gemm import DENSE, E2M1, dense_grads, dense_problem, rel_err, tensor_of_codes, values64
from .golden import (
    GOLDEN_DIR,
    assert_golden,
    assert_sr_vector,
    cases,
    load,
    load_sr,
    one_per_family,
    option_cases,
    sr_cases,
    sr_vector_run,
)
from .kernel_cases import (
    COMBINATION_IDS,
    COMBINATIONS,
    LAYOUTS,
    MODES,
    OPTION_DTYPES,
    RECIPE_OPTIONS,
    SEED,
    kernel_options,
    option_entries,
    option_quantize_cases,
    quantize_options,
    quantize_with_options,
    reference_amax,
    reference_quantize,
    tensors,
)
from .training import nnx_adam_losses

__all__ = [
    "COMBINATIONS",
    "COMBINATION_IDS",
    "CPUS",
    "DENSE",
    "DTYPES",
    "E2M1",
    "FIELDS",
    "GOLDEN_DIR",
    "IMPLEMENTATIONS",
    "IMPLS",
    "KERNEL_CASES_ONLY",
    "LAYOUTS",
    "MODES",
    "OPTION_DTYPES",
    "RECIPE_OPTIONS",
    "SEED",
    "SPECIAL_VALUES",
    "assert_golden",
    "assert_same_bytes",
    "assert_same_tensor",
    "assert_same_tree",
    "assert_sr_vector",
    "canonical_zero_codes",
    "cases",
    "columnwise_as_rowwise",
    "cuda_tool",
    "dense_grads",
    "dense_problem",
    "dequantized_blocks",
    "eqns_named",
    "examples",
    "kernel_options",
    "load",
    "load_sr",
    "needs_8_cpus",
    "needs_8_devices",
    "nnx_adam_losses",
    "normal",
    "one_per_family",
    "option_cases",
    "option_entries",
    "option_quantize_cases",
    "quantize_options",
    "quantize_with_options",
    "quantized_shapes",
    "random_normal",
    "random_tensor",
    "raw_bytes",
    "reference_amax",
    "reference_quantize",
    "rel_err",
    "sr_cases",
    "sr_vector_run",
    "stablehlo_functions",
    "tensor_of_codes",
    "tensors",
    "unpack",
    "values64",
]
