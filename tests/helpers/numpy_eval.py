"""The pure-JAX reference run without XLA: ``evaluate(fn, *args)`` traces ``fn`` to a jaxpr, as ``jax.jit`` would,
and runs each equation with NumPy instead of compiling the program.

Why: the reference is bit-level integer emulation, thousands of operations a quantize, and XLA takes seconds to
compile it for each shape a property test draws (most of the suite's time); NumPy runs the same jaxpr in a
fraction of that. The reference stays the spec: this is the same program, run by another executor, and
tests/quantize/test_numpy_eval.py holds the two to the same bytes (golden files, every option). The operations
follow XLA's semantics where NumPy's differ (shifts past the bit width, unsigned division by zero, a gather's
clamped indices). An equation without a NumPy rule here (random bits of a key, for instance) runs through jax
itself, one small op at a time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore


def evaluate(fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` with its jaxpr run by NumPy: the same pytree of values, as NumPy arrays (a
    leaf that NumPy cannot hold, such as a random key, stays a jax array). ``kwargs`` are static."""
    closed, out_shape = jax.make_jaxpr(functools.partial(fn, **kwargs), return_shape=True)(*args)
    with np.errstate(all="ignore"):  # wrapping integers and IEEE specials are the semantics, not errors
        outs = eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def eval_jaxpr(jaxpr: jcore.Jaxpr, consts, *args) -> list:
    """The values of the jaxpr's outputs for these inputs, equation by equation."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = _host(value)
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = _host(value)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        rule = _RULES.get(eqn.primitive.name)
        outs = None
        if rule is not None and not any(_is_key(v) for v in invals):
            # Each input in its own dtype (a literal's Python number would widen the op); a case without a
            # NumPy rule (NotImplementedError) runs through jax.
            with contextlib.suppress(NotImplementedError):
                outs = rule(eqn, *[np.asarray(v, _dtype(var)) for v, var in zip(invals, eqn.invars, strict=True)])
        if outs is None:
            outs = _through_jax(eqn, invals)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[var] = _typed(value, var.aval)
    return [read(v) for v in jaxpr.outvars]


def _dtype(var):
    return getattr(var.aval, "dtype", None)


def _is_key(value) -> bool:
    return isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key)


def _host(value):
    """A jax array as NumPy (keys stay jax arrays)."""
    return value if _is_key(value) or not isinstance(value, jax.Array) else np.asarray(value)


def _typed(value, aval):
    """value as NumPy of the aval's dtype (a rule's Python scalar or a wider NumPy result)."""
    if _is_key(value) or not hasattr(aval, "dtype") or jnp.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return value
    return np.asarray(value).astype(aval.dtype, copy=False).reshape(aval.shape)


def _through_jax(eqn, invals) -> list:
    """The equation run by jax (eagerly: one small compiled op), its results as NumPy."""
    outs = eqn.primitive.bind(*invals, **eqn.params)
    return [_host(o) for o in outs] if eqn.primitive.multiple_results else _host(outs)


# ---- the rules: (eqn, *NumPy inputs) -> result (a list for primitives with multiple results) ----


def _shift(op, logical: bool = False):
    """XLA's shifts: an amount of the bit width or more (as unsigned) gives 0; a logical shift of a signed
    integer shifts in zeros (NumPy's right shift of one is arithmetic)."""

    def rule(eqn, x, s):
        bits = x.dtype.itemsize * 8
        unsigned = s.astype(np.uint64) if s.dtype.kind == "u" else s.astype(np.int64).astype(np.uint64)
        v = x.view(np.dtype(f"u{x.dtype.itemsize}")) if logical else x
        safe = np.minimum(unsigned, bits - 1).astype(v.dtype)
        return np.where(unsigned >= bits, np.zeros((), v.dtype), op(v, safe)).astype(v.dtype).view(x.dtype)

    return rule


def _div(eqn, x, y):
    if x.dtype.kind == "f":
        return x / y
    if x.dtype.kind == "u":  # XLA: x / 0 is all ones
        return np.where(y == 0, np.array(-1).astype(x.dtype), x // np.where(y == 0, 1, y))
    raise NotImplementedError("signed integer division")  # truncation and INT_MIN / -1 not needed here


def _clz(eqn, x):
    bits = x.dtype.itemsize * 8
    unsigned = x.view(np.dtype(f"u{x.dtype.itemsize}"))  # a negative int's sign bit counts
    length = np.frexp(unsigned.astype(np.float64))[1]  # exact below 2^53: the bit length
    return bits - length


def _select_n(eqn, which, *cases):
    if which.dtype == np.bool_:
        return np.where(which, cases[1], cases[0]) if len(cases) == 2 else cases[0]
    return np.choose(which, cases)


def _convert(eqn, x):
    new = np.dtype(eqn.params["new_dtype"])
    if x.dtype.kind == "f" and new.kind in "iu":
        raise NotImplementedError("float to integer conversion")  # XLA's saturation is not NumPy's
    return x.astype(new)


def _bitcast(eqn, x):
    new = np.dtype(eqn.params["new_dtype"])
    if new.itemsize != x.dtype.itemsize:
        raise NotImplementedError("a bitcast between widths")
    return x.view(new)


def _broadcast_in_dim(eqn, x):
    shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    expanded = [1] * len(shape)
    for i, d in enumerate(dims):
        expanded[d] = x.shape[i]
    return np.broadcast_to(x.reshape(expanded), shape)


def _iota(eqn):
    p = eqn.params
    shape = [1] * len(p["shape"])
    shape[p["dimension"]] = p["shape"][p["dimension"]]
    return np.broadcast_to(np.arange(p["shape"][p["dimension"]], dtype=p["dtype"]).reshape(shape), p["shape"])


def _reduce_max(eqn, x):
    axes = tuple(eqn.params["axes"])
    if x.dtype.kind == "f":
        initial = -np.inf
    elif x.dtype == np.bool_:
        initial = False
    else:
        initial = np.iinfo(x.dtype).min
    return np.max(x, axis=axes, initial=initial)


def _gather(eqn, operand, indices):
    """The one gather the reference makes: a table lookup (operand [K], indices [..., 1]), clamped as XLA's."""
    dn, mode = eqn.params["dimension_numbers"], eqn.params["mode"]
    clamped = mode in (jax.lax.GatherScatterMode.CLIP, jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    if operand.ndim != 1 or indices.shape[-1] != 1 or dn.collapsed_slice_dims != (0,) or dn.offset_dims != ():
        raise NotImplementedError(f"gather {dn}")
    if not clamped:  # FILL_OR_DROP: out-of-range indices read a fill value
        raise NotImplementedError(f"gather mode {mode}")
    return operand[np.clip(indices[..., 0], 0, operand.shape[0] - 1)]


def _scan(eqn, *args):
    p = eqn.params
    if "num_consts" in p:  # jax 0.10
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        consts, carry, xs = args[:n_consts], list(args[n_consts : n_consts + n_carry]), args[n_consts + n_carry :]
    else:  # jax 0.11: a flat tree of (consts, carries, xs)
        consts, carry, xs = map(list, p["ft_in"].update(args).unpack())
        n_carry = len(carry)
    body = p["jaxpr"]
    ys: list[list] = []
    for i in range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"]):
        outs = eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *[x[i] for x in xs])
        carry = outs[:n_carry]
        ys.append(outs[n_carry:])
    if p["reverse"]:
        ys.reverse()
    y_vars = body.jaxpr.outvars[n_carry:]
    stacked = [
        np.stack([y[k] for y in ys]) if ys else np.zeros((0, *v.aval.shape), v.aval.dtype) for k, v in enumerate(y_vars)
    ]
    return [*carry, *stacked]


def _call_rule(name: str):
    """A call primitive (a nested jit, a custom_jvp's primal): its jaxpr, run here."""

    def rule(eqn, *args):
        closed = eqn.params[name]
        return eval_jaxpr(closed.jaxpr, closed.consts, *args)

    return rule


def _binary(op):
    return lambda eqn, x, y: op(x, y)


def _unary(op):
    return lambda eqn, x: op(x)


_RULES: dict[str, Callable] = {
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "div": _div,
    "max": _binary(np.maximum),
    "min": _binary(np.minimum),
    "and": _binary(np.bitwise_and),
    "or": _binary(np.bitwise_or),
    "xor": _binary(np.bitwise_xor),
    "not": _unary(np.invert),
    "neg": _unary(np.negative),
    "eq": _binary(np.equal),
    "ne": _binary(np.not_equal),
    "lt": _binary(np.less),
    "le": _binary(np.less_equal),
    "gt": _binary(np.greater),
    "ge": _binary(np.greater_equal),
    "shift_left": _shift(np.left_shift),
    "shift_right_logical": _shift(np.right_shift, logical=True),
    "clz": _clz,
    "select_n": _select_n,
    "convert_element_type": _convert,
    "bitcast_convert_type": _bitcast,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": lambda eqn, x: x.reshape(eqn.params["new_sizes"]),
    "squeeze": lambda eqn, x: np.squeeze(x, axis=tuple(eqn.params["dimensions"])),
    "transpose": lambda eqn, x: np.transpose(x, eqn.params["permutation"]),
    "slice": lambda eqn, x: x[
        tuple(
            slice(a, b, s)
            for a, b, s in zip(
                eqn.params["start_indices"],
                eqn.params["limit_indices"],
                eqn.params["strides"] or (1,) * x.ndim,
                strict=True,
            )
        )
    ],
    "concatenate": lambda eqn, *xs: np.concatenate(xs, axis=eqn.params["dimension"]),
    "stack": lambda eqn, *xs: np.stack(xs, axis=eqn.params["axis"]),
    "iota": _iota,
    "reduce_max": _reduce_max,
    "gather": _gather,
    "scan": _scan,
    "jit": _call_rule("jaxpr"),
    "pjit": _call_rule("jaxpr"),
    "custom_jvp_call": _call_rule("call_jaxpr"),
    "optimization_barrier": lambda eqn, *xs: list(xs),  # a compiler hint: its operands, unchanged
}
