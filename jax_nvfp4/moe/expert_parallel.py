"""Expert parallelism for the capacity-dispatch MoE: all-to-alls that move NVFP4 codes (GShard / MaxText layout).

Layout. The tokens [T, d] are sharded over ``(*data_axes, expert_axis)`` (S shards of T / S tokens, shard
s = a * D + i for data index a and expert-axis index i, D the expert axis' size), the experts' kernels
[E, d, h] and [E, h, d] over ``expert_axis`` on E (E / D experts a shard, replicated over ``data_axes``).
Under ``jax.shard_map`` each shard

1. routes its own tokens (each token's top-k experts and gates as ``dispatch.route`` computes them, on the
   whole batch's logits outside the shard_map; the sort by expert within the shard) and gives each
   expert C_local = ``expert_capacity(T / S, k, E, capacity_factor)`` slots (R = C_local rounded up to
   16 rows in NVFP4): capacity per source shard, as MaxText does; a pair beyond its expert's C_local
   slots *on its shard* is dropped;
2. scatters its tokens into its dispatch buffer [E, R, d];
3. all-to-all over ``expert_axis``: shard i sends experts [j E/D, (j+1) E/D)'s slots to shard j, which
   holds [E/D, D R, d], source shard i's slots at rows [i R, (i+1) R);
4. runs the experts' two GEMMs locally (GELU between, empty slots zeroed);
5. all-to-all back: [E/D, D R, d] -> [E, R, d], each shard its own slots;
6. combines its tokens' outputs with their gates in float32, as ``dispatch.capacity_mlp`` does.

Semantics (exact). The result is that of the unsharded capacity layer (``dispatch.capacity_mlp``'s batched
``jax_nvfp4.dot_general``) applied to the global buffer [E, S R, d] whose expert e holds, at rows
[s R, (s+1) R), shard s's slots of expert e: ``reference_mlp`` computes it so, unsharded. With
``Recipe(stochastic_rounding=False)`` the output and the gradients of x and of both kernels are equal to
it bit for bit (without ``data_axes``; with them each kernel's gradient is a float32 sum over the data
shards, in another order than one GEMM's, then rounded to the kernel's dtype once). The gates' softmax is
a float32 computation that XLA compiles for the shapes at hand (the reference's [T, k] and the shards'
[T / S, k] can round an ulp apart on CPU), and the float32 combination sums the k weighted outputs in
order (products, then adds), where ``dispatch.combine`` runs an einsum: with one shard (S = 1) the reference
is the unsharded layer's computation up to that float32 order; with top_k = 1 (every gate exactly 1) the
sharded layer equals the reference byte for byte (tested). With stochastic rounding the random bits
differ: each shard rounds dy with its own key (``jax.random.fold_in(key, s)``), the shard's elements at other positions
than in the global buffer, so the rounding is as unbiased as the unsharded layer's but not the same.
The load-balancing loss and the dropped count are those of the global batch (sums over the shards).

What travels in which dtype (the compiled program's all-to-alls, see ``tests/moe/test_expert_parallel.py``):

- forward, tokens -> experts: the buffer quantized at the token side BEFORE the exchange, with the
  amax of the whole global buffer (the pmax of the shards' amaxes: the unsharded dot_general quantizes
  its batched operand with one amax for all experts): the rowwise copy (1x16 blocks along d, the fprop
  operand), and, when differentiating, the columnwise copy (1x16 blocks along the slots, Random
  Hadamard Transform of each 16 slots: the wgrad operand). Codes and E4M3 scales as uint8. The
  columnwise copy can be made before the exchange because R is a multiple of 16: every 16-slot block
  and transform chunk lies within one source shard's slots, and its amax is again the pmax. (1.125
  bytes a value for both copies, 0.5625 for the forward alone, instead of 2 in bfloat16.)
- forward, experts -> tokens: the second GEMM's output, in x's dtype (bfloat16; the CPU backend widens
  bfloat16 all-to-alls to float32 in the compiled program): it is the layer's value, which the unsharded
  layer does not quantize either.
- backward, tokens -> experts: the down projection's dy (the cotangent of the buffer of outputs),
  quantized at the token side with the global amax, both copies (rowwise along d for dgrad,
  columnwise along the slots for wgrad), as uint8: codes and scales. Exact as the forward's; only
  the stochastic rounding's random bits are the shard's own (see above).
- backward, experts -> tokens: the up projection's dgrad output dx, in x's dtype (a GEMM output, as
  the unsharded layer's, not quantized).
- a small int32 all-to-all of each source shard's filled slot counts ([E] -> [E/D, D]), so that each
  expert shard zeroes the empty slots of the hidden layer.

The amaxes are reduced with ``pmax`` (all-reduces of scalars: the int32 bits of the float32 amaxes); W's
amax over all experts, as the unsharded batched GEMM's. With ``data_axes`` the kernels' gradients are
summed over them in float32 (``psum``; shard_map's transpose then adds the other data shards' zeros, a
second float32 all-reduce of the kernels' size). Not supported: ``Recipe(row_scaled_activations=True)`` /
``row_scaled_gradients=True`` and ``amax_mesh_axes`` (ValueError).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jax_nvfp4.core.pipeline import max_entry
from jax_nvfp4.core.tensor import NVFP4Tensor
from jax_nvfp4.linear.dot_general import columnwise_only, dgrad, transposed_weight, weight_residual
from jax_nvfp4.linear.gemm import batched_gemm
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.linear.remat import saved_weight
from jax_nvfp4.moe.dispatch import (
    BATCHED_DIMS,
    Routing,
    buffer_rows,
    capacity_slots,
    expert_capacity,
    nvfp4_or_bf16_dot,
)
from jax_nvfp4.ops import KERNELS

# ---- Quantizing with amaxes reduced over the mesh, and moving the codes.


def _pmax_bits(a: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The max over the local entries and the mesh ``axes`` of non-negative float32 amaxes, on their int32 bits
    (exact, NaN wins as in ``max_entry``)."""
    bits = lax.bitcast_convert_type(max_entry(a), jnp.int32)
    return lax.bitcast_convert_type(lax.pmax(bits, axes), jnp.float32)


def _quantize(
    x: jax.Array, recipe: Recipe, operand: str, columnwise: bool, axes: tuple[str, ...], key=None, *, rowwise=True
) -> NVFP4Tensor:
    """``dot._quantize`` of a shard x [B, *R, L] of a tensor sharded over ``axes`` (B or R): one amax (and
    transform amax) for the whole global tensor, the pmax of the shards', as the unsharded operand's."""
    spec = recipe.spec(operand, columnwise=columnwise, tokens=math.prod(x.shape[1:-1]))
    spec = spec if rowwise else dataclasses.replace(spec, rowwise=False)
    spec.check_rows(math.prod(x.shape[1:-1]))
    b = x.shape[0]
    if spec.draws_random:
        recipe.check_rng_key(key)
    seed = spec.seed(key)
    outs = KERNELS.amax(x, amax_mesh_axes=None, rht_amax=spec.measures_rht_amax, per_row=False)
    outs = [jnp.broadcast_to(_pmax_bits(a, axes), (b,)) for a in outs]
    amax, amax_t = outs[0], spec.columnwise_amax(outs[-1])
    q = list(KERNELS.quantize(x, amax, amax_t, seed, spec=spec))
    data, scale = (q.pop(0), q.pop(0)) if rowwise else (None, None)
    data_t, scale_t = (q[0], q[1]) if columnwise else (None, None)
    return NVFP4Tensor(
        data, scale, amax, data_t, scale_t, amax_t if columnwise else None, x.shape, x.dtype, spec, batched=True
    )


def _weight(w: jax.Array, recipe: Recipe, columnwise: bool, axes: tuple[str, ...]) -> NVFP4Tensor:
    """The shard's W [E/D, K, N], quantized as it is stored, as the GEMMs' W^T [E/D, N, K]: its rowwise copy and,
    where asked, its columnwise one (``dot_general``'s ``weight_copies``)."""
    return transposed_weight(_quantize(w, recipe, "w", True, axes, rowwise=columnwise))


def _exchange(a: jax.Array, axis: str, split: int, concat: int) -> jax.Array:
    """``lax.all_to_all`` (tiled) of the raw bytes: E4M3 scales as uint8, as ``jax_nvfp4.all_gather`` moves them."""
    if a.dtype == jnp.uint8 or not jnp.issubdtype(a.dtype, jnp.floating) or jnp.dtype(a.dtype).itemsize != 1:
        return lax.all_to_all(a, axis, split, concat, tiled=True)
    moved = lax.all_to_all(lax.bitcast_convert_type(a, jnp.uint8), axis, split, concat, tiled=True)
    return lax.bitcast_convert_type(moved, a.dtype)


def _to_experts(t: NVFP4Tensor, axis: str, world: int) -> NVFP4Tensor:
    """A token-side buffer [E, R, L], quantized, sent to the experts' shards: [E/D, D R, L], codes and scales.

    The rowwise copy [E, R, L/2] is split on E and concatenated along the slots; the columnwise copy
    [E, L, R/2] (R whole 16-slot blocks) along its packed slots, which is the columnwise copy of the
    concatenated slots."""
    experts, rows, cols = t.shape
    local = experts // world

    def each(a, concat):
        return None if a is None else _exchange(a, axis, 0, concat)

    return NVFP4Tensor(
        each(t.data, 1),
        each(t.scale, 1),
        t.amax[:local],  # (the one global amax, each entry alike)
        each(t.data_t, 2),
        each(t.scale_t, 2),
        None if t.amax_t is None else t.amax_t[:local],
        (local, rows * world, cols),
        t.dtype,
        t.spec,
        batched=True,
    )


def _to_tokens(y: jax.Array, axis: str) -> jax.Array:
    """An expert-side [E/D, D R, L] sent back to the token side: [E, R, L] (each shard its own slots)."""
    return lax.all_to_all(y, axis, 1, 0, tiled=True)


class _Mesh(NamedTuple):
    """The shard_map's axes: the expert axis, its size, and all the token axes (data axes, then experts)."""

    expert: str
    world: int
    tokens: tuple[str, ...]
    data: tuple[str, ...]


def _shard_key(key: jax.Array | None, mesh: _Mesh) -> jax.Array | None:
    """Each token shard's own stochastic-rounding key: ``fold_in(key, s)``, s = its index over the token axes."""
    if key is None:
        return None
    index = 0
    for name in mesh.tokens:
        index = index * lax.axis_size(name) + lax.axis_index(name)
    return jax.random.fold_in(key, index)


def _weight_grad(qdy: NVFP4Tensor, qx: NVFP4Tensor, dtype, recipe: Recipe, mesh: _Mesh) -> jax.Array:
    """dW = x^T dy [E/D, K, N] over this shard's slots, summed over the data axes in float32, then rounded once.

    shard_map's transpose sums the kernels' cotangents over the data axes (they are replicated there), after
    the cast back to the kernels' dtype: so the sum is taken here, in float32, and only the first data shard
    returns it (the others return zeros, which that sum adds exactly)."""
    if not mesh.data:
        return batched_gemm(qx, qdy, dtype, a_columnwise=True, c_columnwise=True, impl=recipe.impl)
    dw = batched_gemm(qx, qdy, jnp.float32, a_columnwise=True, c_columnwise=True, impl=recipe.impl)
    first = functools.reduce(jnp.logical_and, [lax.axis_index(name) == 0 for name in mesh.data])
    return jnp.where(first, lax.psum(dw, mesh.data), 0).astype(dtype)


def _combine(out: jax.Array, gates: jax.Array) -> jax.Array:
    """Each token's expert outputs [T, k, d] weighted by its gates [T, k] and summed over k in order: float32
    [T, d]. (``dispatch.combine``'s einsum as products and adds, each rounded to float32 in every program.)"""
    # The barrier keeps the products rounded: XLA may fuse a product and an add into one FMA in one program
    # and not in another.
    products = lax.optimization_barrier(out.astype(jnp.float32) * gates[:, :, None])
    return functools.reduce(jnp.add, [products[:, j] for j in range(gates.shape[1])])


# ---- The two projections, each one custom_vjp: the exchange and the GEMMs of the recipe.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dispatch_dot(buffer, w, key, recipe: Recipe, mesh: _Mesh):
    """Token-side buffer [E, R, K], the shard's W [E/D, K, N] -> expert-side y [E/D, D R, N]: the buffer
    quantized (global amax) and moved as codes, then the fprop GEMM."""
    del key
    qx = _to_experts(_quantize(buffer, recipe, "x", False, mesh.tokens), mesh.expert, mesh.world)
    return batched_gemm(qx, _weight(w, recipe, False, mesh.tokens), buffer.dtype, impl=recipe.impl)


def _dispatch_fwd(buffer, w, key, recipe: Recipe, mesh: _Mesh):
    qx = _to_experts(_quantize(buffer, recipe, "x", True, mesh.tokens), mesh.expert, mesh.world)
    qw = saved_weight(_weight(w, recipe, not recipe.weight_block_2d, mesh.tokens))  # 16x16: one copy
    y = batched_gemm(qx, qw, buffer.dtype, impl=recipe.impl)
    return y, (columnwise_only(qx), weight_residual(qw), key, jnp.zeros((0,), w.dtype))


def _dispatch_bwd(recipe: Recipe, mesh: _Mesh, residuals, dy):
    qx, qw, key, w_like = residuals
    recipe.check_rng_key(key)
    # dy [E/D, D R, N] is made at the experts' side: quantized there (global amax).
    qdy = _quantize(dy, recipe, "dy", True, mesh.tokens, _shard_key(key, mesh))
    dx = dgrad(qdy, qw, qx.dtype, recipe.impl)
    dw = _weight_grad(qdy, qx, w_like.dtype, recipe, mesh)
    return _to_tokens(dx, mesh.expert), dw, None


_dispatch_dot.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _combine_dot(h, w, key, recipe: Recipe, mesh: _Mesh):
    """Expert-side h [E/D, D R, K], the shard's W [E/D, K, N] -> token-side out [E, R, N]: the GEMM at the
    experts, its output moved back in h's dtype."""
    del key
    y = batched_gemm(
        _quantize(h, recipe, "x", False, mesh.tokens),
        _weight(w, recipe, False, mesh.tokens),
        h.dtype,
        impl=recipe.impl,
    )
    return _to_tokens(y, mesh.expert)


def _combine_fwd(h, w, key, recipe: Recipe, mesh: _Mesh):
    qh = _quantize(h, recipe, "x", True, mesh.tokens)
    qw = saved_weight(_weight(w, recipe, not recipe.weight_block_2d, mesh.tokens))  # 16x16: one copy
    y = batched_gemm(qh, qw, h.dtype, impl=recipe.impl)
    return _to_tokens(y, mesh.expert), (columnwise_only(qh), weight_residual(qw), key, jnp.zeros((0,), w.dtype))


def _combine_bwd(recipe: Recipe, mesh: _Mesh, residuals, dout):
    qh, qw, key, w_like = residuals
    recipe.check_rng_key(key)
    # dout [E, R, N] is at the token side: quantized there (global amax, both copies), moved as codes.
    qdy = _to_experts(_quantize(dout, recipe, "dy", True, mesh.tokens, _shard_key(key, mesh)), mesh.expert, mesh.world)
    dh = dgrad(qdy, qw, qh.dtype, recipe.impl)
    return dh, _weight_grad(qdy, qh, w_like.dtype, recipe, mesh), None


_combine_dot.defvjp(_combine_fwd, _combine_bwd)


# ---- The layer's computation.


def _global_balance(routing: Routing, logits: jax.Array, mesh: _Mesh) -> jax.Array:
    """Switch Transformer's load-balancing loss of the whole batch, from the shards' counts and probabilities."""
    experts = logits.shape[-1]
    pairs = lax.psum(routing.order.size, mesh.tokens)
    share = lax.psum(routing.group_sizes, mesh.tokens).astype(jnp.float32) / pairs
    tokens = lax.psum(logits.shape[0], mesh.tokens)
    mean_prob = lax.psum(jnp.sum(jax.nn.softmax(logits, axis=-1), axis=0), mesh.tokens) / tokens
    return experts * jnp.sum(share * mean_prob)


def _choices(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Each token's experts int32 [T, k] and gates float32 [T, k], as ``dispatch.route`` computes them."""
    top, chosen = lax.top_k(logits, top_k)
    return chosen.astype(jnp.int32), jax.nn.softmax(top, axis=-1)


def _shard_routing(chosen: jax.Array, gates: jax.Array, num_experts: int) -> Routing:
    """The routing of a shard's tokens from their chosen experts [T', k] and gates [T', k] (``route``'s, of
    the whole batch: each token's own), its rows sorted by expert within the shard. No load-balancing loss."""
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Routing(order, group_sizes, gates, jnp.zeros((), jnp.float32), chosen)


def _local_mlp(x, logits, chosen, gates, up, down, keys, *, top_k, recipe, activation, capacity_factor, mesh: _Mesh):
    """One shard's part (inside shard_map): its tokens x [T/S, d], logits [T/S, E], chosen experts and gates
    [T/S, k]; up [E/D, d, h]."""
    tokens, d = x.shape
    num_experts = logits.shape[-1]
    routing = _shard_routing(chosen, gates, num_experts)
    capacity = expert_capacity(tokens, top_k, num_experts, capacity_factor)
    rows = buffer_rows(capacity, recipe)
    slots = capacity_slots(routing, capacity, rows)
    pairs = jnp.repeat(x, top_k, axis=0)
    buffer = jnp.zeros((num_experts * rows, d), x.dtype).at[slots.index].add(pairs, mode="drop")
    buffer = buffer.reshape(num_experts, rows, d)
    # Each source shard's filled slots of this shard's experts: [E/D, D].
    filled = lax.all_to_all(slots.filled[:, None], mesh.expert, 0, 1, tiled=True)
    mask = (jnp.arange(rows)[None, None, :] < filled[:, :, None]).reshape(filled.shape[0], -1, 1)
    if recipe is None:  # the bf16 baseline: plain exchanges and GEMMs
        h = lax.all_to_all(buffer, mesh.expert, 0, 1, tiled=True)
        h = activation(lax.dot_general(h, up.astype(x.dtype), BATCHED_DIMS))
        h = jnp.where(mask, h, 0)
        out = _to_tokens(lax.dot_general(h, down.astype(x.dtype), BATCHED_DIMS), mesh.expert)
    else:
        h = activation(_dispatch_dot(buffer, up.astype(x.dtype), keys[0], recipe, mesh))
        h = jnp.where(mask, h, 0)  # empty slots stay zero whatever activation(0) is
        out = _combine_dot(h, down.astype(x.dtype), keys[1], recipe, mesh)
    out = out.reshape(num_experts * rows, d).at[slots.index].get(mode="fill", fill_value=0)
    y = _combine(out.reshape(tokens, top_k, d), routing.gates)
    dropped = lax.psum(slots.dropped, mesh.tokens)
    return y, dropped, _global_balance(routing, logits, mesh)


def _check_recipe(recipe: Recipe | None) -> None:
    if recipe is None:
        return
    if recipe.row_scaled_activations or recipe.row_scaled_gradients:
        raise ValueError(
            "expert parallelism quantizes with one amax per tensor: Recipe(row_scaled_activations=True / "
            "row_scaled_gradients=True) is not supported"
        )
    if recipe.amax_mesh_axes is not None:
        raise ValueError(
            "expert parallelism reduces every amax over the whole mesh (as the unsharded layer quantizes): "
            "Recipe(amax_mesh_axes=...) is not supported"
        )


def check_expert_parallel(
    mesh, expert_axis: str, data_axes: tuple[str, ...], tokens: int, num_experts: int
) -> tuple[str, tuple[str, ...]]:
    """The axes checked against ``mesh`` and the shapes: ValueError naming what does not fit."""
    if not isinstance(expert_axis, str):
        raise TypeError(f"expert_axis must be a mesh axis name (str), got {expert_axis!r}")
    data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if mesh is None or mesh.empty:
        raise ValueError(f"expert_axis={expert_axis!r} needs a mesh: call under jax.set_mesh(mesh) (or pass mesh=)")
    for name in (expert_axis, *data_axes):
        if name not in mesh.axis_names:
            raise ValueError(f"mesh axis {name!r} is not in the mesh's axes {tuple(mesh.axis_names)}")
    if expert_axis in data_axes or len(set(data_axes)) != len(data_axes):
        raise ValueError(f"expert_axis {expert_axis!r} and data_axes {data_axes} must be distinct axes")
    world = mesh.shape[expert_axis]
    if num_experts % world:
        raise ValueError(
            f"num_experts={num_experts} must be a multiple of the size of mesh axis {expert_axis!r} ({world})"
        )
    shards = world * math.prod(mesh.shape[name] for name in data_axes)
    if tokens % shards:
        raise ValueError(
            f"the tokens ({tokens}) must be a multiple of the token shards ({shards}: mesh axes "
            f"{(*data_axes, expert_axis)})"
        )
    return expert_axis, data_axes


def expert_parallel_mlp(
    x: jax.Array,
    logits: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    top_k: int,
    recipe: Recipe | None,
    keys: tuple[jax.Array | None, jax.Array | None],
    activation: Callable[[jax.Array], jax.Array],
    capacity_factor: float,
    expert_axis: str,
    data_axes: tuple[str, ...] = (),
    mesh=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Capacity-dispatch MoE with the experts sharded over ``expert_axis`` (see the module's docstring).

    Args:
      x: the tokens [T, d] (bfloat16 or the layer's dtype); sharded over ``(*data_axes, expert_axis)``
        inside (T a multiple of the shards).
      logits: the router's float32 logits [T, E].
      up, down: the experts' kernels [E, d, h] and [E, h, d] (E a multiple of the expert axis' size).
      top_k, activation, capacity_factor: as ``moe.MoEMLP``'s; the capacity is per token shard:
        C_local = ``expert_capacity(T / S, top_k, E, capacity_factor)``.
      recipe: the NVFP4 recipe of the GEMMs, or None (the bf16 baseline, exchanging bf16).
      keys: the stochastic-rounding keys of the two projections (None: none).
      expert_axis, data_axes: the mesh axes of the experts, and the other axes the tokens are sharded on.
      mesh: the mesh (default: the current one, ``jax.sharding.get_abstract_mesh()``, from ``jax.set_mesh``).

    Returns the float32 combination [T, d], the dropped (token, choice) pairs of the whole batch (int32)
    and the load-balancing loss of the whole batch.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if not 1 <= top_k <= up.shape[0]:
        raise ValueError(f"top_k must be in [1, num_experts={up.shape[0]}], got {top_k}")
    expert_axis, data_axes = check_expert_parallel(mesh, expert_axis, data_axes, x.shape[0], up.shape[0])
    _check_recipe(recipe)
    spec = _Mesh(expert_axis, mesh.shape[expert_axis], (*data_axes, expert_axis), data_axes)
    local = functools.partial(
        _local_mlp, top_k=top_k, recipe=recipe, activation=activation, capacity_factor=capacity_factor, mesh=spec
    )
    tokens, experts = PartitionSpec(spec.tokens, None), PartitionSpec(expert_axis, None, None)
    specs = (tokens, tokens, tokens, tokens, experts, experts)
    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(*specs, PartitionSpec()),
        out_specs=(tokens, PartitionSpec(), PartitionSpec()),
        check_vma=False,
    )
    # Each token's choice and gates as the unsharded layer's ``route`` computes them (per token, on the whole
    # batch's logits: the same float32 ops on the same shapes).
    chosen, gates = _choices(logits, top_k)
    args = (x, logits, chosen, gates, up, down)
    explicit = jax.sharding.AxisType.Explicit
    if any(mesh._name_to_type[name] == explicit for name in spec.tokens):
        # On Explicit axes shard_map takes its operands typed as its in_specs.
        args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, specs, strict=True))
    return run(*args, tuple(keys))


# ---- The unsharded computation with the same semantics: the specification the tests compare with.


def reference_mlp(
    x: jax.Array,
    logits: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    shards: int,
    top_k: int,
    recipe: Recipe | None,
    keys: tuple[jax.Array | None, jax.Array | None],
    activation: Callable[[jax.Array], jax.Array],
    capacity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """Unsharded: the capacity layer's two batched ``dot_general``s on the buffer [E, S R, d] that expert
    parallelism over ``shards`` = S token shards builds (each shard of T / S consecutive tokens routed on its
    own, C_local slots per expert, shard s's slots at rows [s R, (s+1) R)). Returns the float32 combination
    [T, d] and the dropped pairs. ``shards=1`` is ``dispatch.capacity_mlp``."""
    tokens, d = x.shape
    num_experts = up.shape[0]
    local = tokens // shards
    capacity = expert_capacity(local, top_k, num_experts, capacity_factor)
    rows = buffer_rows(capacity, recipe)
    chosen, gates = _choices(logits, top_k)
    index, filled, dropped = [], [], 0
    for s in range(shards):
        part = slice(s * local, (s + 1) * local)
        slots = capacity_slots(_shard_routing(chosen[part], gates[part], num_experts), capacity, rows)
        expert, position = slots.index // rows, slots.index % rows
        kept = slots.index < num_experts * rows
        index.append(jnp.where(kept, expert * shards * rows + s * rows + position, num_experts * shards * rows))
        filled.append(slots.filled)
        dropped = dropped + slots.dropped
    index = jnp.concatenate(index)
    filled = jnp.stack(filled, axis=1)  # [E, S]
    pairs = jnp.repeat(x, top_k, axis=0)
    buffer = jnp.zeros((num_experts * shards * rows, d), x.dtype).at[index].add(pairs, mode="drop")
    buffer = buffer.reshape(num_experts, shards * rows, d)
    dots = [nvfp4_or_bf16_dot(recipe, key) for key in keys]
    h = activation(dots[0](buffer, up.astype(x.dtype), BATCHED_DIMS))
    mask = (jnp.arange(rows)[None, None, :] < filled[:, :, None]).reshape(num_experts, -1, 1)
    h = jnp.where(mask, h, 0)
    out = dots[1](h, down.astype(x.dtype), BATCHED_DIMS).reshape(num_experts * shards * rows, d)
    out = out.at[index].get(mode="fill", fill_value=0)
    return _combine(out.reshape(tokens, top_k, d), gates), dropped
