"""``jax_nvfp4.ragged_dot``: a drop-in ``lax.ragged_dot`` (mixture-of-experts grouped GEMM) in NVFP4.

lhs x [M, K] holds the tokens sorted by expert, rhs W [G, K, N] one weight per expert, and
``group_sizes`` [G] how many consecutive rows each expert takes: rows of group g give x[r] . W[g].
The custom VJP follows ``dot_general``'s recipe, group by group:

  fprop  y  = x . W_g     x in 1x16 blocks along K (one amax for all tokens), each W_g in 16x16
                          blocks with its own amax
  dgrad  dx = dy . W_g^T  dy in 1x16 blocks along N, W_g's columnwise copy (its codes transposed)
  wgrad  dW_g = dy_g^T x_g  the columnwise copies of group g's tokens alone, blocked along the tokens

**Group boundaries in the wgrad copies.** The token blocks of the columnwise copies lie on the
global grid of 16 rows (rows 16j..16j+15). Each group is quantized as its own tensor: the rows of
the other groups are zero, so a block that a group boundary cuts holds, in group g's copy, only
g's rows (with their own block scale), and the same block in the next group's copy holds the
rest. Each group's copy has its own amax (of its transform, with the RHT), and with the RHT each
16-row chunk is transformed with the rows outside the group as zeros. So group g's copy is the
quantization of its rows padded in front by ``start_g mod 16`` zero rows, and no 16-token block
mixes two experts' tokens. dW_g contracts group g's copy over all M tokens in place (no codes
move between shards of a token-sharded batch); its blocks outside the group are zero codes, so
it equals the GEMM of the group's blocks alone wherever the float32 dot is unchanged by zero
blocks around the sum (XLA's CPU dot in the tests).

**Sharding.** Under ``jit`` with the experts (W's first axis) sharded over one mesh axis and the
tokens over another, each device multiplies its tokens by its experts: no operand moves. Each
row then takes its own expert's output from the expert shards (a float32 all-reduce of results),
and the weight gradients' sums over token shards are reduced as ``dot_general``'s are.

Rows past ``sum(group_sizes)`` give zeros (as in ``lax.ragged_dot``) and take no part in any amax.

Stochastic rounding uses ``jax.random.split(rng_key, G + 1)``: key 0 for dy's rowwise copy, key
1 + g for group g's columnwise copy.

Cost: the emulation runs each GEMM once per expert over all rows (masked), like
``lax.ragged_dot``'s own decomposition on CPU, and keeps G columnwise copies of x for the
backward pass. The per-group bytes are those of ``gemm`` on the group's rows (tested); a fused
grouped kernel is not part of this library yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jax_nvfp4._explicit import explicit_sharding, spec_of
from jax_nvfp4._frontend import quantize_batch
from jax_nvfp4.dot import _columnwise_only, _Config, check_operands, check_options, check_result
from jax_nvfp4.gemm import batched_gemm
from jax_nvfp4.ops import KERNELS
from jax_nvfp4.recipe import Recipe
from jax_nvfp4.tensor import NVFP4Tensor


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of ``rows`` rows (int32 [rows]); G for rows past the last group."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.sum(jnp.arange(rows, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _spec(recipe: Recipe, operand: str, rows: int, columnwise: bool):
    """The recipe's spec for one copy only: the rowwise one, or (``columnwise``) the columnwise one."""
    spec = recipe.spec(operand, columnwise=columnwise, tokens=rows)
    return dataclasses.replace(spec, rowwise=not columnwise)


def _rows(x: jax.Array, recipe: Recipe, operand: str, key=None) -> NVFP4Tensor:
    """The rowwise copy of x [M, L] (one amax, or one per row), as a batch of one."""
    return quantize_batch(KERNELS, x[None], _spec(recipe, operand, x.shape[0], False), rng_key=key)


def _stack(t: NVFP4Tensor) -> NVFP4Tensor:
    """A vmapped batch of one [G, 1, ...] as a batch of G [G, ...]."""
    squeeze = lambda a: None if a is None else a.reshape(a.shape[0], *a.shape[2:])  # noqa: E731
    arrays = [squeeze(a) for a in (t.data, t.scale, t.amax, t.data_t, t.scale_t, t.amax_t)]
    return NVFP4Tensor(*arrays, (arrays[2].shape[0], *t.shape[1:]), t.dtype, t.spec, batched=True)


def _broadcast(t: NVFP4Tensor, groups: int) -> NVFP4Tensor:
    """A batch of one as a batch of ``groups`` (the same codes for every expert's GEMM)."""
    t = jax.tree.map(lambda a: jnp.broadcast_to(a, (groups, *a.shape[1:])), t)
    return dataclasses.replace(t, shape=(groups, *t.shape[1:]))


def _experts(w: jax.Array, recipe: Recipe, columnwise: bool) -> NVFP4Tensor:
    """W^T [G, N, K], each expert quantized on its own (own amax): [G, N, K], with the columnwise copy if asked."""
    spec = recipe.spec("w", columnwise=columnwise, tokens=w.shape[1])
    return _stack(jax.vmap(lambda wg: quantize_batch(KERNELS, wg[None], spec))(w))


def _group_copies(v: jax.Array, ids: jax.Array, groups: int, recipe: Recipe, operand: str, keys) -> NVFP4Tensor:
    """Group g's rows of v [M, L] (the other rows zero) quantized columnwise, one tensor per group: [G, M, L]."""
    spec = _spec(recipe, operand, v.shape[0], columnwise=True)

    def one(g, key):
        vg = jnp.where((ids == g)[:, None], v, jnp.zeros((), v.dtype))
        return quantize_batch(KERNELS, vg[None], spec, rng_key=key)

    return _stack(jax.vmap(one)(jnp.arange(groups), keys))


def _pick(y: jax.Array, ids: jax.Array) -> jax.Array:
    """Row r of expert ids[r]'s output y [G, M, n]; zeros for rows past the last group."""
    groups = y.shape[0]
    picked = jnp.take_along_axis(y, jnp.minimum(ids, groups - 1)[None, :, None], axis=0)[0]
    return jnp.where((ids < groups)[:, None], picked, jnp.zeros((), y.dtype))


def _keys(key, groups: int):
    """(dy's rowwise key, the G group keys) from the backward pass's key; Nones without one."""
    if key is None:
        return None, None
    keys = jax.random.split(key, groups + 1)
    return keys[0], keys[1:]


def _masked(v: jax.Array, ids: jax.Array, groups: int) -> jax.Array:
    """v [M, L] with the rows past the last group zero."""
    return jnp.where((ids < groups)[:, None], v, jnp.zeros((), v.dtype))


def _fprop(x, qw: NVFP4Tensor, ids, config: _Config) -> jax.Array:
    groups = qw.shape[0]
    qx = _rows(_masked(x, ids, groups), config.recipe, "x")
    return _pick(batched_gemm(_broadcast(qx, groups), qw, config.out_dtype, impl=config.recipe.impl), ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array, key, config: _Config) -> jax.Array:
    """x [M, K], W^T [G, N, K], group_sizes [G] -> y [M, N]."""
    del key
    return _fprop(x, _experts(w, config.recipe, columnwise=False), group_ids(group_sizes, x.shape[0]), config)


def _ragged_fwd(x, w, group_sizes, key, config: _Config):
    ids = group_ids(group_sizes, x.shape[0])
    qw = _experts(w, config.recipe, columnwise=True)
    y = _fprop(x, qw, ids, config)
    qx_t = _group_copies(x, ids, w.shape[0], config.recipe, "x", None)
    return y, (_columnwise_only(qx_t), _columnwise_only(qw), group_sizes, key)


def _ragged_bwd(config: _Config, residuals, dy):
    qx_t, qw, group_sizes, key = residuals
    recipe, groups = config.recipe, qw.shape[0]
    recipe.check_rng_key(key)
    row_key, group_keys = _keys(key, groups)
    ids = group_ids(group_sizes, dy.shape[0])
    dy = _masked(dy, ids, groups)
    qdy = _rows(dy, recipe, "dy", key=row_key)
    # [G, M, N] . [G, K, N] -> [G, M, K]: each expert's dgrad, of which each row keeps its own expert's.
    dx = _pick(batched_gemm(_broadcast(qdy, groups), qw, config.x_dtype, c_columnwise=True, impl=recipe.impl), ids)
    qdy_t = _group_copies(dy, ids, groups, recipe, "dy", group_keys)
    # [G, N, M] . [G, K, M] -> [G, N, K], each contracting its group's tokens (the others are zero codes).
    dw = batched_gemm(qdy_t, qx_t, config.w_dtype, a_columnwise=True, c_columnwise=True, impl=recipe.impl)
    return dx, dw, None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)

_jitted_ragged = jax.jit(_ragged, static_argnums=4)


def _explicit_sharding(result, lhs, rhs, group_sizes, *args, **kwargs) -> PartitionSpec:
    """The result's type on Explicit axes, which lax has no rule for (it asks for an out_sharding): the one
    ``lax.dot_general`` gives lhs [M, K] times one group's rhs [K, N], tokens as lhs's rows and N as rhs's."""
    del result, group_sizes, args, kwargs
    rhs = jnp.asarray(rhs)
    mesh = jax.sharding.get_abstract_mesh()
    one = jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec_of(rhs)[1:])))
    dense = functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())))
    return jax.eval_shape(dense, jnp.asarray(lhs), one).sharding.spec


@explicit_sharding(_explicit_sharding)
def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision: lax.PrecisionLike = None,
    preferred_element_type: DTypeLike | None = None,
    group_offset: jax.Array | None = None,
    *,
    recipe: Recipe | None = None,
    rng_key: jax.Array | None = None,
) -> jax.Array:
    """``lax.ragged_dot`` with NVFP4 GEMMs in the forward and backward pass (mixture of experts).

    Args:
      lhs: [M, K] bfloat16, float16 or float32: the tokens, sorted by group (expert).
      rhs: [G, K, N] of the same dtypes: one weight per group.
      group_sizes: int [G]: the rows of each group, in order; they may be zero. Rows past their
        sum give zeros; a sum past M cuts the last groups at M.
      precision: ignored; the GEMMs are NVFP4 with float32 accumulation.
      preferred_element_type: the output dtype (bfloat16, float16 or float32).
      group_offset: not supported (as in ``lax.ragged_dot`` on CPU and GPU).
      recipe: the NVFP4 recipe options (``Recipe()`` by default), as in ``dot_general``.
      rng_key: the key of the gradients' stochastic rounding (needed for the backward pass with
        the default recipe; a fresh one each step).

    Returns [M, N] of ``lax.ragged_dot``'s dtype. The module docstring has the recipe, how the
    weight-gradient copies treat group boundaries inside a 16-token block, and the cost.
    Gradients flow to ``lhs`` and ``rhs`` (not ``group_sizes``); forward-mode autodiff is not defined.

    Under ``jax.set_mesh`` with Explicit axes, where ``lax.ragged_dot`` asks for an ``out_sharding``, the
    result's type is the sharding ``lax.dot_general`` gives lhs times one group's rhs [K, N] (the tokens as
    lhs's rows, N as rhs's last axis; an expert axis of rhs does not show in it), and each gradient has
    its operand's. The GEMMs run with those axes Auto, as ``dot_general``'s do.
    """
    del precision
    recipe = check_options("NVFP4 ragged_dot", recipe, rng_key, preferred_element_type)
    if group_offset is not None:
        raise NotImplementedError("NVFP4 ragged_dot does not support group_offset")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    check_operands("NVFP4 ragged_dot", lhs=lhs, rhs=rhs)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != rhs.shape[:1]:
        raise ValueError(
            "NVFP4 ragged_dot takes lhs [M, K], rhs [G, K, N] and group_sizes [G], got shapes "
            f"{lhs.shape}, {rhs.shape} and {group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers, got {group_sizes.dtype}")
    # lax's own shape rule checks K and gives the result type.
    ragged = functools.partial(lax.ragged_dot, preferred_element_type=preferred_element_type)
    out = jax.eval_shape(ragged, lhs, rhs, group_sizes)
    check_result("NVFP4 ragged_dot", out)
    if out.size == 0 or lhs.size == 0 or rhs.size == 0:
        return ragged(lhs, rhs, group_sizes)
    config = _Config(recipe, out.dtype, lhs.dtype, rhs.dtype)
    return _jitted_ragged(lhs, rhs.transpose(0, 2, 1), group_sizes.astype(jnp.int32), rng_key, config)
