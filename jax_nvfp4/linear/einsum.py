"""``jax_nvfp4.einsum``: a two-operand ``jnp.einsum`` whose contraction is ``jax_nvfp4.dot_general``.

The subscripts become one ``dot_general`` (labels in both operands and the output: batch axes; in both
but not the output: contracted; in one operand and the output: free), then a transpose to the output's
order. The first operand is the activations and the second the weights, as in ``dot_general`` (and in
Flax's ``Einsum`` layers, whose kernel is the second operand), so the recipe's blocks follow them;
``jnp.einsum`` itself may swap its operands, which is why this does not hand it our ``dot_general``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jax_nvfp4.linear.dot_general import dot_general
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.mxfp8.matmul import MXFP8

_SPARE = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # labels for the axes an ellipsis stands for (einsum's are lower case)


def _expand(subscripts: str, ndims: tuple[int, int]) -> tuple[str, str, str]:
    """``"...d,df->...f"`` -> explicit labels for each operand and the output (ellipses spelled out)."""
    subscripts = subscripts.replace(" ", "")
    if subscripts.count("->") != 1 or subscripts.count(",") != 1:
        raise ValueError(f"einsum takes two operands and an explicit output, like 'bld,df->blf'; got {subscripts!r}")
    inputs, out = subscripts.split("->")
    operands = inputs.split(",")
    if any(not (label.isalpha() or label == ".") for label in subscripts.replace("->", "").replace(",", "")):
        raise ValueError(f"einsum subscripts are letters and ellipses; got {subscripts!r}")
    if any(s.count("...") > 1 or s.replace("...", "").count(".") for s in (*operands, out)):
        raise ValueError(f"each einsum term takes at most one ellipsis; got {subscripts!r}")
    spare = [c for c in _SPARE if c not in subscripts]
    widths = [ndim - len(s.replace("...", "")) for s, ndim in zip(operands, ndims, strict=True)]
    width = max([w for s, w in zip(operands, widths, strict=True) if "..." in s], default=0)
    if width > len(spare):
        raise ValueError(f"einsum: an ellipsis of {width} axes is too wide")
    ellipsis = "".join(spare[:width])  # right-aligned, as numpy broadcasts
    terms = []
    for s, w, ndim in zip(operands, widths, ndims, strict=True):
        term = s.replace("...", ellipsis[width - w :] if w > 0 else "")
        if len(term) != ndim:
            raise ValueError(f"einsum: {s!r} does not match an operand of rank {ndim}")
        terms.append(term)
    return terms[0], terms[1], out.replace("...", ellipsis)


def _sum_alone(x: jax.Array, term: str, other: str, out: str) -> tuple[jax.Array, str]:
    """``x`` summed over the labels of ``term`` that neither the other operand nor the output has, and its term
    without them."""
    dropped = tuple(i for i, c in enumerate(term) if c not in other and c not in out)
    if not dropped:
        return x, term
    return x.sum(dropped), "".join(c for i, c in enumerate(term) if i not in dropped)


def contracted_sizes(subscripts: str, lhs, rhs) -> list[int]:
    """The sizes of the axes ``einsum(subscripts, lhs, rhs)`` contracts (labels of both operands, not the output)."""
    a, b, out = _expand(subscripts, (len(lhs.shape), len(rhs.shape)))
    return [lhs.shape[a.index(c)] for c in a if c in b and c not in out]


def _produced_sharding(out_sharding, out: str, produced: str):
    """``out_sharding`` (of the einsum's result, labels ``out``) for ``dot_general``'s result, labels ``produced``
    (the same labels in dot_general's order): each label keeps its mesh axes."""
    if out_sharding is None:
        return None
    spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"einsum's out_sharding must be a NamedSharding or a PartitionSpec, got {out_sharding!r}")
    if len(spec) > len(out):
        raise ValueError(f"einsum's out_sharding {spec} has more entries than its result {out!r} has axes")
    entries = (*spec, *(None,) * (len(out) - len(spec)))
    permuted = PartitionSpec(*(entries[out.index(c)] for c in produced))
    return NamedSharding(out_sharding.mesh, permuted) if isinstance(out_sharding, NamedSharding) else permuted


def einsum(
    subscripts: str,
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    out: None = None,
    optimize: str | bool | list = "auto",
    precision: lax.PrecisionLike = None,
    preferred_element_type: DTypeLike | None = None,
    _dot_general=lax.dot_general,
    out_sharding: NamedSharding | PartitionSpec | None = None,
    recipe: Recipe | MXFP8 | None = None,
    rng_key: jax.Array | None = None,
) -> jax.Array:
    """``jnp.einsum(subscripts, lhs, rhs)`` with the contraction in NVFP4 (``jax_nvfp4.dot_general``; in MXFP8 with
    ``recipe=MXFP8()``).

    ``lhs`` is the activations, ``rhs`` the weights (16x16 blocks with the default recipe). Two operands
    and an explicit output (``->``); ellipses are allowed. A label that appears in one operand only and not
    in the output is summed over first (in that operand's precision); a label repeated within one term
    (a trace or a diagonal) is not supported. ``recipe`` and ``rng_key`` as for ``dot_general``.

    Every keyword of ``jnp.einsum`` is taken: ``preferred_element_type`` (the result's dtype) and
    ``out_sharding`` (the result's sharding, as ``dot_general``'s: on Explicit axes its type) as there;
    ``precision`` and ``optimize`` are ignored (the GEMM is NVFP4 with float32 accumulation, and two operands
    have one contraction order); ``out`` must be None, as in ``jnp.einsum``; ``_dot_general``, jnp's hook for
    another contraction, is refused unless it is ``lax.dot_general`` (this function's contraction is NVFP4's).
    """
    del optimize, precision
    if out is not None:
        raise NotImplementedError("einsum: the 'out' argument is not supported, as in jnp.einsum")
    if _dot_general is not lax.dot_general:
        raise ValueError(
            "jax_nvfp4.einsum contracts with jax_nvfp4.dot_general and takes no other _dot_general; "
            f"got {_dot_general!r}"
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    a, b, out_labels = _expand(subscripts, (lhs.ndim, rhs.ndim))
    for term in (a, b, out_labels):
        if len(set(term)) != len(term):
            raise ValueError(f"einsum: a label repeated within a term ({subscripts!r}) is not supported")
    if set(out_labels) - set(a) - set(b):
        raise ValueError(f"einsum: output labels {sorted(set(out_labels) - set(a) - set(b))} are in neither operand")
    lhs, a = _sum_alone(lhs, a, b, out_labels)
    rhs, b = _sum_alone(rhs, b, a, out_labels)
    for c in set(a) & set(b):
        if lhs.shape[a.index(c)] != rhs.shape[b.index(c)]:
            raise ValueError(
                f"einsum {subscripts!r}: label {c!r} has sizes {lhs.shape[a.index(c)]} and {rhs.shape[b.index(c)]}"
            )
    batch = [c for c in a if c in b and c in out_labels]
    contract = [c for c in a if c in b and c not in out_labels]
    dims = (
        (tuple(map(a.index, contract)), tuple(map(b.index, contract))),
        (tuple(map(a.index, batch)), tuple(map(b.index, batch))),
    )
    produced = "".join(batch) + "".join(c for c in a if c not in b) + "".join(c for c in b if c not in a)
    y = dot_general(
        lhs,
        rhs,
        dims,
        None,
        preferred_element_type,
        out_sharding=_produced_sharding(out_sharding, out_labels, produced),
        recipe=recipe,
        rng_key=rng_key,
    )
    return y.transpose(tuple(map(produced.index, out_labels)))
