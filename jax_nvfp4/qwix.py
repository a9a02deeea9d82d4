"""``jax_nvfp4.qwix``: NVFP4 as a Qwix provider, for models whose modules call ``jnp.einsum`` / ``lax.dot_general``
themselves, and for the training stacks (MaxText) that quantize through Qwix.

``qwix.quantize_model(model, NVFP4Provider(rules), ...)`` intercepts the ``lax.dot_general``, ``jnp.einsum`` and
``lax.ragged_dot`` calls made inside each module of a linen or NNX model (Qwix's interception, by module path),
and routes those that the first matching ``jax_nvfp4.flax.Rule`` gives a recipe to our NVFP4 (or MXFP8) ops: the
same ops, keys and recipes as ``jax_nvfp4.flax`` / ``jax_nvfp4.flax.nnx.quantize_model``, so a model that both
convert gives the same bytes. The paths are Qwix's, which are the rules' of ``quantize_model`` too: linen
``module.path`` joined by ``/`` (``"layer_0/attn/q_einsum"``), NNX attribute paths (``"layers/0/attn/q_proj"``).

What is routed: a call whose second operand (``einsum``: either operand) is a parameter of the module making the
call (Qwix's ``find_param``: the parameter itself, or under ``jit`` a unary op of it such as a cast; failing
those, an operand of the exact shape of one of the module's parameters, Qwix's heuristic). A product of
two activations (attention scores, ``"BTNH,BSNH->BTNS"``) stays as it is, whatever the rules say: NVFP4's recipe
is for a layer's weight times its inputs. A weight given as ``einsum``'s first operand is swapped to the second.

Stochastic-rounding keys: linen modules draw them from the ``"nvfp4"`` RNG stream (``apply(..., rngs={"nvfp4":
key})``), per module, as ``quantize_model``'s layers do. NNX modules get an ``NVFP4DotGeneral`` / ``NVFP4Einsum`` /
``NVFP4RaggedDot`` op per intercepted call, kept on the module as ``nvfp4_<op id>`` (``nvfp4_dot_general0``) with its
own stream, forked (as ``NVFP4Op`` forks one) from a stream keyed ``fold_in(k, crc32("<module path>:<op id>"))``,
``k`` one key drawn at Qwix's first (eager) run from the provider's ``rngs`` or else the ``rngs=`` given to
``qwix.quantize_model`` (``nnx.quantize_model`` forks its layers' streams from ``rngs`` in graph order instead: with
stochastic rounding the two give other keys, with the same statistics). The layers of a stack that a model runs by
``scan`` share one module path, and so one key.

A call that contracts no axis (an RMSNorm's scale, ``"...k,k->...k"``) is not a GEMM and stays as it is.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax import lax
from qwix._src.utils import flax_util  # Qwix's current module, its path and find_param (not exported)

from jax_nvfp4.flax.linen.convert import layer_dot_general
from jax_nvfp4.flax.linen.layers import RNG_STREAM, stream_key
from jax_nvfp4.flax.nnx.layers import NVFP4DotGeneral, NVFP4Einsum, NVFP4RaggedDot, nvfp4_stream
from jax_nvfp4.flax.rules import (
    OnUnmatched,
    Rule,
    check_layer_operands,
    check_on_unmatched,
    check_rules,
    report_unmatched,
)
from jax_nvfp4.linear.einsum import contracted_sizes
from jax_nvfp4.linear.einsum import einsum as nvfp4_einsum
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.moe.ragged_dot import ragged_dot as nvfp4_ragged_dot
from jax_nvfp4.mxfp8 import MXFP8


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeRule(qwix.QuantizationRule):
    """A ``jax_nvfp4.flax.Rule`` as Qwix matches it: ``module_path`` (fullmatch, first rule wins) and its recipe."""

    recipe: Recipe | MXFP8 | None = None


def _spelled(module: nn.Module | nnx.Module) -> str:
    return "/".join(map(str, flax_util.get_current_module_path())) or type(module).__name__


class NVFP4Provider(qwix.QuantizationProvider):
    """A Qwix provider that runs the GEMMs ``rules`` match in NVFP4 (or MXFP8), with our recipes and ops.

    Args:
      rules: ``jax_nvfp4.flax.Rule`` objects (the same as for ``quantize_model``): the first whose ``module_path``
        fullmatches the path of the module making a call decides its recipe; ``None`` keeps it as it is.
      rngs: NNX only: the ``nnx.Rngs`` whose ``"nvfp4"`` (else ``default``) stream gives, at Qwix's first run, the
        key that each NVFP4 op's stochastic-rounding stream is derived from; without it, the ``rngs=`` given to
        ``qwix.quantize_model`` (MaxText gives none: pass it here). Linen draws from the ``"nvfp4"`` stream of
        ``apply``.
      on_unmatched: a rule that matched no routed call at Qwix's first run (``init`` for linen) is reported
        as by ``quantize_model``: ``"warn"``, ``"raise"`` or ``"ignore"``.
      disable_jit: Qwix's own option (intercept inside jitted functions such as ``jnp.matmul`` too).
    """

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        rngs: nnx.Rngs | None = None,
        on_unmatched: OnUnmatched = "warn",
        disable_jit: bool = False,
    ) -> None:
        self.rules = check_rules(rules)
        self.on_unmatched = check_on_unmatched(on_unmatched)
        if not (rngs is None or isinstance(rngs, nnx.Rngs)):
            raise TypeError(f"NVFP4Provider's rngs must be an nnx.Rngs or None, got {type(rngs).__name__}")
        self.rngs = rngs
        self.seen: set[str] = set()  # the paths of the modules whose calls were routed or kept by a rule
        self._stream_key: jax.Array | None = None  # NNX: the key each op's stream is derived from
        qwix_rules = [RecipeRule(module_path=r.module_path, recipe=r.recipe) for r in self.rules]
        super().__init__(qwix_rules, disable_jit=disable_jit)

    def get_intercept_map(self):
        """Qwix's map of the functions it intercepts to this provider's handlers."""
        return super().get_intercept_map() | {
            "jax.lax.dot_general": self.dot_general,
            "jax.numpy.einsum": self.einsum,
            "jax.lax.ragged_dot": self.ragged_dot,
        }

    def process_model_inputs(self, model, model_args, model_kwargs):
        """At Qwix's first NNX run (eager, outside any trace): one key from the ``"nvfp4"`` (else ``default``) stream
        of ``rngs`` (the provider's, else ``qwix.quantize_model``'s), from which each op's stream is derived."""
        rngs = self.rngs if self.rngs is not None else getattr(model, "qwix_rngs", None)
        if self._stream_key is None and isinstance(model, nnx.Module) and rngs is not None:
            self._stream_key = nvfp4_stream(rngs)()
        return super().process_model_inputs(model, model_args, model_kwargs)

    def process_model_output(self, method_name, model_output):
        """After Qwix's first run, report the rules that matched no routed call (``on_unmatched``)."""
        if not self._initial_run_complete:
            report_unmatched(self.rules, self.seen, self.on_unmatched, "NVFP4Provider", layers_only=False)
        return super().process_model_output(method_name, model_output)

    def _route(self, op_name: str, is_gemm: Callable[[], bool]) -> tuple[Recipe | MXFP8 | None, str | None, object]:
        """The recipe of the current call (None: as it is), its Qwix op id and the calling module. ``is_gemm``, asked
        only where a rule matches: whether the call contracts an axis (not a scale such as an RMSNorm's
        ``"...k,k->...k"``) with a parameter of that module as its weight operand."""
        rule, op_id = self._get_current_rule_and_op_id(op_name)
        module = flax_util.get_current_module()
        if rule is None or not is_gemm():
            return None, op_id, module
        self.seen.add(_spelled(module))
        return rule.recipe, op_id, module

    def _nnx_op(self, module: nnx.Module, op_id: str, op_cls: type, recipe):
        """The NNX op kept on ``module`` for the call ``op_id``, made at its first run."""
        name = f"nvfp4_{op_id}"
        op = getattr(module, name, None)
        if op is None or op.recipe != recipe:
            path = _spelled(module)
            # Made where the call first runs, which may be inside a transform of the model's (a scan or a
            # jax.checkpoint over its layers, as MaxText's decoder runs them): no stream from outside is drawn
            # from there, and the stream's key is computed now, not traced.
            with jax.ensure_compile_time_eval():
                stream = None
                if self._stream_key is not None:
                    key = jax.random.fold_in(self._stream_key, zlib.crc32(f"{path}:{op_id}".encode()))
                    stream = nnx.RngStream(key, tag=RNG_STREAM)
                op = op_cls(recipe, rngs=stream, path=path)
            setattr(module, name, nnx.data(op))
        return op

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        """``lax.dot_general``, in NVFP4 where a rule matches and ``rhs`` is the module's weight."""
        recipe, op_id, module = self._route("dot_general", lambda: bool(dimension_numbers[0][0]) and _is_weight(rhs))
        if recipe is None:
            return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
        if isinstance(module, nnx.Module):
            op = self._nnx_op(module, op_id, NVFP4DotGeneral, recipe)
            return op(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
        op = layer_dot_general(module, recipe)
        return op(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)

    def einsum(self, subscripts, *operands, **kwargs):
        """``jnp.einsum``, in NVFP4 for two operands where a rule matches and one of them is the module's weight
        (made the second)."""
        if len(operands) != 2 or not isinstance(subscripts, str) or "->" not in subscripts:
            return jnp.einsum(subscripts, *operands, **kwargs)
        equation, (lhs, rhs) = subscripts, operands
        weight = _is_weight(rhs)
        if not weight and _is_param(lhs):
            inputs, out = subscripts.split("->")
            a, b = inputs.split(",")
            equation, lhs, rhs, weight = f"{b},{a}->{out}", rhs, lhs, True
        recipe, op_id, module = self._route("einsum", lambda: weight and _contracts(equation, lhs, rhs))
        if recipe is None:
            return jnp.einsum(subscripts, *operands, **kwargs)  # as called, not swapped
        if isinstance(module, nnx.Module):
            return self._nnx_op(module, op_id, NVFP4Einsum, recipe)(equation, lhs, rhs, **kwargs)
        check_layer_operands(type(module).__name__, _spelled(module), lhs, rhs, contracted_sizes(equation, lhs, rhs))
        return nvfp4_einsum(equation, lhs, rhs, recipe=recipe, rng_key=stream_key(module, recipe), **kwargs)

    def ragged_dot(self, lhs, rhs, group_sizes, *args, **kwargs):
        """``lax.ragged_dot``, in NVFP4 where a rule matches and ``rhs`` (the experts' weights) is the module's."""
        recipe, op_id, module = self._route("ragged_dot", lambda: _is_weight(rhs))
        if recipe is None:
            return lax.ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)
        if isinstance(module, nnx.Module):
            return self._nnx_op(module, op_id, NVFP4RaggedDot, recipe)(lhs, rhs, group_sizes, *args, **kwargs)
        check_layer_operands(type(module).__name__, _spelled(module), lhs, rhs, lhs.shape[-1:])
        key = stream_key(module, recipe)
        return nvfp4_ragged_dot(lhs, rhs, group_sizes, *args, recipe=recipe, rng_key=key, **kwargs)


def _contracts(equation: str, lhs, rhs) -> bool:
    """Whether ``einsum(equation, lhs, rhs)`` contracts an axis (False too where jnp.einsum is to judge it)."""
    try:
        return bool(contracted_sizes(equation, lhs, rhs))
    except ValueError:
        return False


def _is_weight(x) -> bool:
    """Whether ``x`` is a parameter of the calling module (Qwix's ``find_param``)."""
    return flax_util.find_param(x) is not None


def _is_param(x) -> bool:
    """``_is_weight`` for an operand that may not be an array (einsum's first, which is usually not a weight)."""
    return isinstance(x, jax.Array | jax.core.Tracer) and _is_weight(x)


__all__ = ["NVFP4Provider", "RecipeRule"]
