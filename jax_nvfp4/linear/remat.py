"""Rematerialization (``jax.checkpoint``, ``nn.remat``) without quantizing twice.

Under ``jax.checkpoint`` the backward pass recomputes the forward pass from the saved inputs, and with it the
recipe's quantizations. A weight's quantized copy is the exception: ``saved`` marks it as a value every
checkpoint policy saves (a partial-evaluation rule of its own, as ``checkpoint_name``'s values are saved when
a policy names them), so a checkpointed layer quantizes its weight once per step under any policy, plain
``jax.checkpoint`` included, for 4.5 bits a value kept (codes and E4M3 scales). The recipe also names what
it makes (``checkpoint_name``): W's quantized copy ``WEIGHT``, x's quantized copies ``ACTIVATION``, and the
forward GEMM's results ``OUTPUT`` (its output, and the copy of W in the layout it read, which the backward
pass reuses), so that a policy can save them, or offload them (``WEIGHT`` too): ``remat_policy()`` saves the
quantized activations. jax's own ``dots_saveable`` policies do not see these GEMMs (they are not
``lax.dot_general``): ``outputs=True`` saves their results as those save a dot's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

WEIGHT = "nvfp4_weight"
"""The name of a GEMM's quantized weight copy (the forward GEMM's, which the backward pass reuses)."""
ACTIVATION = "nvfp4_activation"
"""The name of a GEMM's quantized activations (x's copies; the wgrad GEMM's columnwise one is a residual)."""
OUTPUT = "nvfp4_output"
"""The name of the forward GEMM's results: its output, and the copy of W it read (the dgrad GEMM's operand)."""


def _saved_under_remat(saveable, unknowns, instantiated, eqn):
    """``partial_eval_jaxpr_custom``'s rule: a known value stays on the known side (the forward pass) and reaches
    the backward pass as a residual, whatever ``saveable`` (the policy) says; an unknown one is staged."""
    del saveable
    if unknowns[0]:
        residuals = [v for v, inst in zip(eqn.invars, instantiated, strict=True) if not inst]
        return None, eqn, [True], [True], residuals
    return eqn, None, [False], [False], []


saved_p = Primitive("nvfp4_saved_under_remat")
"""The identity, whose result ``jax.checkpoint`` saves under every policy instead of recomputing it."""
saved_p.def_impl(lambda x: x)
saved_p.def_abstract_eval(lambda aval: aval)
mlir.register_lowering(saved_p, lambda ctx, x: [x])
batching.primitive_batchers[saved_p] = lambda args, dims: (saved_p.bind(*args), dims[0])
ad.primitive_jvps[saved_p] = lambda primals, tangents: (saved_p.bind(*primals), tangents[0])
pe.partial_eval_jaxpr_custom_rules[saved_p] = _saved_under_remat


def saved(tree: Any) -> Any:
    """``tree``'s arrays, which the backward pass of a ``jax.checkpoint`` reads as saved, under any policy.

    For what costs a pass to remake and little to keep: a weight's quantized copy (4.5 bits a value, beside the
    weight itself, 16 or 32 bits a value, which the checkpoint keeps anyway).
    """
    return _each_array_once(tree, saved_p.bind)


def named(tree: Any, name: str) -> Any:
    """``tree`` (an ``NVFP4Tensor`` or other pytree of arrays) with every array named ``name`` for policies."""
    return _each_array_once(tree, lambda a: checkpoint_name(a, name))


def saved_weight(tree: Any) -> Any:
    """A weight's quantized copies as the recipe's forward pass makes them: saved under any checkpoint policy,
    and named ``WEIGHT`` (for a policy that offloads them)."""
    return named(saved(tree), WEIGHT)


def _each_array_once(tree: Any, fn: Callable[[jax.Array], jax.Array]) -> Any:
    """``fn`` on each array of ``tree``; an array that several leaves share (a tensor's amax for both copies)
    stays one array: one residual."""
    done: dict[int, jax.Array] = {}

    def one(a):
        if id(a) not in done:
            done[id(a)] = fn(a)
        return done[id(a)]

    return jax.tree.map(one, tree)


def remat_policy(*, activations: bool = True, outputs: bool = False, base: Callable | None = None) -> Callable:
    """A ``jax.checkpoint`` policy that saves what the recipe makes instead of recomputing it.

    The weights' quantized copies need no policy: every policy saves them (``saved``), so a weight is quantized
    once per step under any.

    Args:
      activations: save the quantized activations (``ACTIVATION``): no activation is quantized again in the
        backward pass, for 4.5 bits a value of each copy kept.
      outputs: save the forward GEMMs' results (``OUTPUT``: each output, and the copy of W it read), as
        ``jax.checkpoint_policies.dots_saveable`` saves a ``lax.dot_general``'s (it does not see these GEMMs):
        with ``activations`` too, the backward pass recomputes no NVFP4 GEMM and quantizes nothing again.
      base: another policy to combine with (``jax.checkpoint_policies.save_from_both_policies``): a value is
        saved where either saves it.

    Returns:
      The policy, for ``jax.checkpoint(f, policy=...)`` or ``flax.linen.remat(Module, policy=...)``.
    """
    names = [name for name, keep in ((ACTIVATION, activations), (OUTPUT, outputs)) if keep]
    if not names:
        raise ValueError("remat_policy saves nothing with activations and outputs False: pass base alone")
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    return policy if base is None else jax.checkpoint_policies.save_from_both_policies(base, policy)
