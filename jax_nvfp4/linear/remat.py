"""Rematerialization (``jax.checkpoint``, ``nn.remat``) without quantizing twice.

Under ``jax.checkpoint`` the backward pass recomputes the forward pass from the saved inputs, and with it the
recipe's quantizations: a checkpointed NVFP4 layer quantizes its weight, and its activations, once in the forward
pass and again in the backward pass. The recipe names what it makes (``checkpoint_name``): W's quantized copy
``WEIGHT``, x's quantized copies ``ACTIVATION``, and the forward GEMM's results ``OUTPUT`` (its output, and the
copy of W in the layout it read, which the backward pass reuses), so that a checkpoint policy can save them:
``remat_policy()`` saves the quantized weights (4.5 bits a value), so each weight is quantized once per step.
jax's own ``dots_saveable`` policies do not see these GEMMs (they are not ``lax.dot_general``): ``outputs=True``
saves their results as those save a dot's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

WEIGHT = "nvfp4_weight"
"""The name of a GEMM's quantized weight copy (the forward GEMM's, which the backward pass reuses)."""
ACTIVATION = "nvfp4_activation"
"""The name of a GEMM's quantized activations (x's copies; the wgrad GEMM's columnwise one is a residual)."""
OUTPUT = "nvfp4_output"
"""The name of the forward GEMM's results: its output, and the copy of W it read (the dgrad GEMM's operand)."""


def named(tree: Any, name: str) -> Any:
    """``tree`` (an ``NVFP4Tensor`` or other pytree of arrays) with every array named ``name`` for policies.

    An array that several leaves share (a tensor's amax for both copies) stays one array: one residual.
    """
    names: dict[int, jax.Array] = {}

    def one(a):
        if id(a) not in names:
            names[id(a)] = checkpoint_name(a, name)
        return names[id(a)]

    return jax.tree.map(one, tree)


def remat_policy(
    *, weights: bool = True, activations: bool = False, outputs: bool = False, base: Callable | None = None
) -> Callable:
    """A ``jax.checkpoint`` policy that saves what the recipe makes instead of recomputing it.

    Args:
      weights: save each GEMM's quantized weight (``WEIGHT``): a weight is then quantized once per step, and
        the saved copy takes 4.5 bits a value (codes and E4M3 scales).
      activations: save the quantized activations (``ACTIVATION``) too: no activation is quantized again in
        the backward pass, for 4.5 bits a value of each copy kept.
      outputs: save the forward GEMMs' results (``OUTPUT``: each output, and the copy of W it read), as
        ``jax.checkpoint_policies.dots_saveable`` saves a ``lax.dot_general``'s (it does not see these GEMMs):
        with ``activations`` too, the backward pass recomputes no NVFP4 GEMM and quantizes nothing again.
      base: another policy to combine with (``jax.checkpoint_policies.save_from_both_policies``): a value is
        saved where either saves it.

    Returns:
      The policy, for ``jax.checkpoint(f, policy=...)`` or ``flax.linen.remat(Module, policy=...)``.
    """
    chosen = ((WEIGHT, weights), (ACTIVATION, activations), (OUTPUT, outputs))
    names = [name for name, keep in chosen if keep]
    if not names:
        raise ValueError("remat_policy saves nothing with weights, activations and outputs False: pass base alone")
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    return policy if base is None else jax.checkpoint_policies.save_from_both_policies(base, policy)
