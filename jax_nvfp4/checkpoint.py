"""Save and restore trees that hold NVFP4 tensors (quantized parameters) with orbax-checkpoint.

Orbax stores arrays; an ``NVFP4Tensor``'s static metadata (its logical shape, dtype, ``QuantizeSpec``)
and a ``QuantizedWeight``'s kernel shape live in the pytree structure, which a checkpoint restored
without a target does not have. ``save`` writes both: the arrays (E4M3 scales as their bytes) as an
orbax ``StandardSave`` item and the metadata of every quantized node as a JSON item, so ``restore``
rebuilds the same tree, byte for byte, from the directory alone. Needs ``orbax-checkpoint``.

A tensor in 16x16 blocks with both copies is stored with its rowwise copy alone (its columnwise copy is
those bytes transposed, ``core.transpose``) and rebuilt on restore: about half the bytes. Checkpoints
written before that (both copies stored) restore as they are.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.core.spec import QuantizeSpec
from jax_nvfp4.core.tensor import NVFP4Tensor, QuantizedWeight
from jax_nvfp4.core.transpose import with_columnwise_copy

_ARRAYS = ("data", "scale", "amax", "data_t", "scale_t", "amax_t")
_SCALES = ("scale", "scale_t")  # float8_e4m3fn: stored as uint8 bytes


def _is_quantized(x) -> bool:
    return isinstance(x, NVFP4Tensor | QuantizedWeight)


def _scale_bytes(scale):
    """E4M3 scales as their bytes: a host (numpy) array stays on the host; with several processes orbax writes
    host arrays as they are but refuses a jax array on one local device."""
    if isinstance(scale, jax.Array):
        return jax.lax.bitcast_convert_type(scale, jnp.uint8)
    return np.asarray(scale).view(np.uint8)


_TRANSPOSED = "transposed"  # the metadata's "columnwise": rebuilt from the rowwise copy on restore


@jax.jit
def _same_bytes(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.array_equal(jax.lax.bitcast_convert_type(a, jnp.uint8), jax.lax.bitcast_convert_type(b, jnp.uint8))


def _transposes(t: NVFP4Tensor) -> bool:
    """Whether ``t``'s columnwise copy is its rowwise copy transposed (16x16 blocks, both copies, checked)."""
    if not (t.spec.transposable and t.data is not None and t.data_t is not None) or (t.batched and len(t.shape) != 3):
        return False
    made = with_columnwise_copy(dataclasses.replace(t, data_t=None, scale_t=None, amax_t=None))
    return all(bool(_same_bytes(getattr(made, n), getattr(t, n))) for n in ("data_t", "scale_t", "amax_t"))


def _tensor_parts(t: NVFP4Tensor) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    transposed = _transposes(t)
    names = [n for n in _ARRAYS if getattr(t, n) is not None and not (transposed and n in _ARRAYS[3:])]
    arrays = {k: _scale_bytes(getattr(t, k)) if k in _SCALES else getattr(t, k) for k in names}
    spec = dataclasses.asdict(t.spec)
    meta = {"shape": list(t.shape), "dtype": np.dtype(t.dtype).name, "spec": spec, "batched": t.batched}
    if transposed:
        meta["columnwise"] = _TRANSPOSED
    return arrays, meta


def _tensor_from(arrays: dict[str, Any], meta: dict[str, Any]) -> NVFP4Tensor:
    values = {}
    for name in _ARRAYS:
        a = arrays.get(name)
        if a is not None:
            a = jnp.asarray(a)
            values[name] = jax.lax.bitcast_convert_type(a, jnp.float8_e4m3fn) if name in _SCALES else a
        else:
            values[name] = None
    spec = dict(meta["spec"])
    if spec.get("amax_mesh_axes") is not None:
        spec["amax_mesh_axes"] = tuple(spec["amax_mesh_axes"])
    t = NVFP4Tensor(
        **values,
        shape=tuple(meta["shape"]),
        dtype=jnp.dtype(meta["dtype"]),
        spec=QuantizeSpec(**spec),
        batched=meta["batched"],
    )
    return with_columnwise_copy(t) if meta.get("columnwise") == _TRANSPOSED else t


def _split(node) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """A quantized node as (its arrays, its metadata)."""
    if isinstance(node, QuantizedWeight):
        arrays, meta = _tensor_parts(node.tensor)
        return arrays, {
            "kind": "QuantizedWeight",
            "kernel_shape": list(node.shape),
            "contract_ndim": node.contract_ndim,
            "tensor": meta,
        }
    arrays, meta = _tensor_parts(node)
    return arrays, {"kind": "NVFP4Tensor", "tensor": meta}


def _join(arrays: dict[str, Any], meta: dict[str, Any]):
    tensor = _tensor_from(arrays, meta["tensor"])
    if meta["kind"] == "QuantizedWeight":
        return QuantizedWeight(tensor, tuple(meta["kernel_shape"]), meta["contract_ndim"])
    return tensor


def _path(keys) -> list[str]:
    names = []
    for k in keys:
        if not isinstance(k, jax.tree_util.DictKey) or not isinstance(k.key, str):
            raise TypeError(f"checkpoint.save takes nested dicts with str keys (Flax params), found the key {k}")
        names.append(k.key)
    return names


def save(directory: str | os.PathLike, tree: Any) -> None:
    """Write ``tree`` (nested dicts of arrays, ``NVFP4Tensor`` and ``QuantizedWeight``) to ``directory``."""
    import orbax.checkpoint as ocp

    arrays_tree, quantized = {}, []
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_quantized)[0]
    for keys, leaf in leaves:
        path = _path(keys)
        if _is_quantized(leaf):
            leaf, meta = _split(leaf)
            quantized.append({"path": path, **meta})
        node = arrays_tree
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = leaf
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            os.path.abspath(directory),
            args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(arrays_tree), nvfp4=ocp.args.JsonSave({"quantized": quantized})
            ),
        )


def restore(directory: str | os.PathLike) -> Any:
    """The tree ``save`` wrote to ``directory``, with its NVFP4 tensors rebuilt (same bytes, same metadata)."""
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(
            os.path.abspath(directory),
            args=ocp.args.Composite(arrays=ocp.args.StandardRestore(), nvfp4=ocp.args.JsonRestore()),
        )
    tree = restored["arrays"]
    for meta in restored["nvfp4"]["quantized"]:
        *parents, name = meta["path"]
        node = tree
        for key in parents:
            node = node[key]
        node[name] = _join(node[name], meta)
    return jax.tree.map(jnp.asarray, tree)
