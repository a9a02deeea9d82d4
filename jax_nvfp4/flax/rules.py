"""Rules: which layers of a model run in NVFP4, and with which recipe, by their module path.

A layer's path is its module names from the model's root joined by ``/`` (linen: ``module.path``,
e.g. ``"block0/mlp_up"`` or ``"MultiHeadDotProductAttention_0/query"``; NNX: the attribute path,
e.g. ``"blocks/0/attn/query"``). The first rule whose ``module_path`` regex matches the whole path
(``re.fullmatch``) decides: its recipe (an NVFP4 ``Recipe``, or ``MXFP8()`` for that layer's GEMMs in MXFP8),
or ``None`` to keep the layer in its input precision. A layer no rule matches is kept too.

A rule that matches no layer of the model is almost always a wrong path (a block named ``Block_3`` where the rule
says ``block3``): ``quantize_model`` and ``nvfp4_rules`` report it (``on_unmatched``: a warning by default, or an
error, or nothing), naming the layer paths they saw and, where the model has numbered blocks, the ``block=``
pattern that ``keep_ends`` would need.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Literal

from jax_nvfp4.core.formats import INPUT_DTYPES
from jax_nvfp4.linear.recipe import Recipe
from jax_nvfp4.mxfp8 import MXFP8


@dataclasses.dataclass(frozen=True)
class Rule:
    """Layers whose path matches ``module_path`` (a regex, matched whole) run with ``recipe`` (NVFP4, or
    ``MXFP8()``); ``None`` keeps them in their input precision."""

    module_path: str
    recipe: Recipe | MXFP8 | None = dataclasses.field(default_factory=Recipe)

    def __post_init__(self) -> None:
        if not isinstance(self.module_path, str):
            raise TypeError(f"Rule.module_path must be a regex string, got {type(self.module_path).__name__}")
        try:
            re.compile(self.module_path)
        except re.error as e:
            raise ValueError(f"Rule.module_path {self.module_path!r} is not a valid regex: {e}") from None
        if not (self.recipe is None or isinstance(self.recipe, (Recipe, MXFP8))):
            raise TypeError(
                f"Rule.recipe must be a jax_nvfp4.Recipe, a jax_nvfp4.MXFP8 or None, got {type(self.recipe).__name__}"
            )


def check_rules(rules: Iterable[Rule]) -> tuple[Rule, ...]:
    """``rules`` as a tuple, each a ``Rule`` (TypeError naming the first that is not)."""
    rules = (rules,) if isinstance(rules, Rule) else tuple(rules)
    for rule in rules:
        if not isinstance(rule, Rule):
            raise TypeError(f"rules must be jax_nvfp4.flax.Rule objects, got {type(rule).__name__}")
    return rules


def recipe_for(rules: Sequence[Rule], path: str) -> Recipe | MXFP8 | None:
    """The recipe of the first rule matching ``path`` (None: the layer stays in its input precision)."""
    for rule in rules:
        if re.fullmatch(rule.module_path, path):
            return rule.recipe
    return None


# keep_ends' block names when it is not told one, matched from the model's root: "block3" (our example), Flax's
# automatic names "Block_3" (linen, a class Block called in @nn.compact) and "layers_3" (linen, a list attribute in
# setup, or nn.Sequential's children), NNX's attribute paths "blocks/3" and "layers/3". Not searched deeper than the
# root: nn.Sequential inside a block names its own children layers_0, layers_1, ...
AUTOMATIC_BLOCK_NAMES = r"(?:[Bb]lock_?|[Bb]locks[_/]|layers[_/]|layer_?)"


def keep_ends(
    blocks: int,
    *,
    first: int = 0,
    last: int = 1,
    block: str | None = None,
    keep: Sequence[str] = (r"(.*/)?head",),
    recipe: Recipe | None = None,
) -> tuple[Rule, ...]:
    """Rules for a stack of ``blocks`` blocks: the first ``first`` and the last ``last`` blocks, and the layers
    that ``keep`` matches (by default the LM head), in their input precision; every other layer in NVFP4 with
    ``recipe`` (``Recipe()`` by default).

    ``block`` names block i's path from the model's root (``"block{i}"``, ``"Block_{i}"``, ``"blocks/{i}"``,
    ``"decoder/layers_{i}"``, ...); every layer under it is kept. By default (``None``) the usual names are all
    tried at the root: ``block{i}``, ``block_{i}``, Flax's automatic ``Block_{i}`` and ``layers_{i}``, and
    ``blocks/{i}``, ``blocks_{i}``, ``layers/{i}``, ``layer{i}``, ``layer_{i}``. If the model names its blocks
    otherwise, ``quantize_model`` reports the rules that matched nothing and the ``block=`` pattern to pass.
    """
    if first < 0 or last < 0 or first + last > blocks:
        raise ValueError(f"keep_ends: first={first} and last={last} must be >= 0 and add up to at most {blocks}")
    kept = [*range(first), *range(blocks - last, blocks)]
    if block is None:
        rules = [Rule(f"{AUTOMATIC_BLOCK_NAMES}{i}(/.*)?", None) for i in kept]
    else:
        if "{i}" not in block:
            raise ValueError(f"keep_ends: block must name block i's path with '{{i}}' in it, got {block!r}")
        rules = [Rule(re.escape(block.format(i=i)) + "(/.*)?", None) for i in kept]
    rules += [Rule(pattern, None) for pattern in keep]
    return (*rules, Rule(".*", Recipe() if recipe is None else recipe))


def check_layer_operands(layer: str, path: str | None, lhs, rhs, contracted: Sequence[int]) -> None:
    """TypeError / ValueError naming the layer (``layer`` at ``path``) whose GEMM cannot run in NVFP4: operands that
    are not bfloat16, float16 or float32 (integers, complex), no contracted axis (a scale, not a GEMM) or one of
    size 0 (nothing to quantize), before any kernel sees them; ``contracted``: the sizes of the contracted axes."""
    where = layer if path is None else f"{layer} at {path!r}"
    keep = f" (keep the layer in its precision with Rule({path!r}, None))" if path is not None else ""
    for name, operand in (("inputs", lhs), ("kernel", rhs)):
        dtype = getattr(operand, "dtype", None)
        if dtype not in INPUT_DTYPES:
            raise TypeError(
                f"{where}: NVFP4 GEMMs take bfloat16, float16 or float32 operands, its {name} are {dtype}{keep}"
            )
    if not contracted:
        raise ValueError(f"{where}: it contracts no axis, so it is no GEMM to run in NVFP4{keep}")
    if 0 in contracted:
        raise ValueError(
            f"{where}: its GEMM contracts an axis of size 0 (sizes {tuple(contracted)}), nothing to quantize{keep}"
        )


class UnmatchedRuleWarning(UserWarning):
    """A rule matched no layer of the model (``quantize_model``, ``nvfp4_rules``)."""


OnUnmatched = Literal["warn", "raise", "ignore"]


def numbered_block_pattern(paths: Iterable[str]) -> str | None:
    """The model's numbered blocks as a ``keep_ends(block=...)`` pattern, read from its layer paths: the numbered
    path prefix (``"Block_3"``, ``"decoder/layers/3"``) with the most distinct numbers, shallowest first; ``None``
    without one."""
    numbers: dict[str, set[str]] = collections.defaultdict(set)
    for path in paths:
        parts = path.split("/")
        for depth, part in enumerate(parts[:-1]):  # a block holds layers: never the layer's own name
            stem = re.fullmatch(r"(.*?)(\d+)", part)
            if stem:
                numbers["/".join([*parts[:depth], stem[1] + "{i}"])].add(stem[2])
    if not numbers:
        return None
    return max(numbers, key=lambda pattern: (len(numbers[pattern]), -pattern.count("/")))


def check_on_unmatched(on_unmatched: OnUnmatched) -> OnUnmatched:
    """``on_unmatched`` if it is one of "warn", "raise" or "ignore" (ValueError otherwise)."""
    if on_unmatched not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_unmatched must be 'warn', 'raise' or 'ignore', got {on_unmatched!r}")
    return on_unmatched


def report_unmatched(
    rules: Sequence[Rule], paths: Iterable[str], on_unmatched: OnUnmatched, where: str, *, layers_only: bool = True
) -> None:
    """Warn (``"warn"``), raise ValueError (``"raise"``) or do nothing (``"ignore"``) when a rule of ``rules``
    matches none of the layer ``paths`` that ``where`` saw; the message names the paths and, where the model has
    numbered blocks, the ``keep_ends`` block pattern they suggest. ``layers_only``: ``where`` sees Flax's layers
    alone, so a model without any is pointed to the Qwix provider, which sees every module's calls."""
    check_on_unmatched(on_unmatched)
    paths = sorted(set(paths))
    unmatched = [rule.module_path for rule in rules if not any(re.fullmatch(rule.module_path, p) for p in paths)]
    if not unmatched or on_unmatched == "ignore":
        return
    shown = ", ".join(repr(p) for p in paths[:12]) + (f", ... ({len(paths)} in all)" if len(paths) > 12 else "")
    message = f"{where}: {len(unmatched)} rule(s) matched no layer: {unmatched}; the layers' paths: [{shown}]"
    pattern = numbered_block_pattern(paths)
    if pattern is not None:
        message += f". Its numbered blocks look like {pattern!r}: keep_ends(..., block={pattern!r})"
    if not paths and layers_only:
        message += (
            ". The model has no Flax Dense, DenseGeneral, Einsum, Linear or LinearGeneral layer: if its modules "
            "call jnp.einsum / lax.dot_general themselves, convert it with jax_nvfp4.qwix.NVFP4Provider(rules), "
            "which intercepts those calls by module path"
        )
    message += " (on_unmatched='ignore' to allow it)"
    if on_unmatched == "raise":
        raise ValueError(message)
    warnings.warn(message, UnmatchedRuleWarning, stacklevel=3)


__all__ = [
    "Rule",
    "UnmatchedRuleWarning",
    "check_layer_operands",
    "check_on_unmatched",
    "check_rules",
    "keep_ends",
    "numbered_block_pattern",
    "recipe_for",
    "report_unmatched",
]
