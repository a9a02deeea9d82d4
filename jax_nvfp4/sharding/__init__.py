"""Sharding beyond the primitives' own rules.

``all_gather`` (collectives on quantized tensors inside ``shard_map``), ``explicit`` (the public functions
under ``jax.set_mesh`` with Explicit axes) and ``hlo`` (what a compiled program communicates, for tests and
benchmarks).
"""
