"""Mixture of experts in NVFP4.

``ragged_dot`` (the drop-in ``lax.ragged_dot``), ``grouped`` (its grouped quantization), ``dispatch`` (the
routing and the two dispatches the Flax MoE layers share) and ``expert_parallel`` (all-to-alls that move
NVFP4 codes between expert shards).
"""
