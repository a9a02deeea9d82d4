"""The NVFP4 GEMM and the linear-layer ops built on it.

``recipe`` (the training recipe), ``gemm`` (the GEMM of two quantized tensors), ``block_sum`` (how a GEMM
sums its blocks: exact bf16 emulation or ``lax.scaled_dot``), ``dot_general`` (the drop-in
``lax.dot_general`` with the recipe's VJP, and quantized weights for inference) and ``einsum``.
"""
