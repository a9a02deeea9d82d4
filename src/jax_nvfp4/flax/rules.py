"""Rules: which layers of a model run in NVFP4, and with which recipe, by their module path.

A layer's path is its module names from the model's root joined by ``/`` (linen: ``module.path``,
e.g. ``"block0/mlp_up"`` or ``"MultiHeadDotProductAttention_0/query"``; NNX: the attribute path,
e.g. ``"blocks/0/attn/query"``). The first rule whose ``module_path`` regex matches the whole path
(``re.fullmatch``) decides: its recipe (an NVFP4 ``Recipe``, or ``MXFP8()`` for that layer's GEMMs in MXFP8),
or ``None`` to keep the layer in its input precision. A layer no rule matches is kept too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

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


def keep_ends(
    blocks: int,
    *,
    first: int = 0,
    last: int = 1,
    block: str = "block{i}",
    keep: Sequence[str] = (r"(.*/)?head",),
    recipe: Recipe | None = None,
) -> tuple[Rule, ...]:
    """Rules for a stack of ``blocks`` blocks: the first ``first`` and the last ``last`` blocks, and the layers
    that ``keep`` matches (by default the LM head), in their input precision; every other layer in NVFP4 with
    ``recipe`` (``Recipe()`` by default). ``block`` names block i's path (``"block{i}"``, ``"layers_{i}"``,
    ``"blocks/{i}"``, ...), every layer under it is kept.
    """
    if first < 0 or last < 0 or first + last > blocks:
        raise ValueError(f"keep_ends: first={first} and last={last} must be >= 0 and add up to at most {blocks}")
    kept = [*range(first), *range(blocks - last, blocks)]
    rules = [Rule(re.escape(block.format(i=i)) + "(/.*)?", None) for i in kept]
    rules += [Rule(pattern, None) for pattern in keep]
    return (*rules, Rule(".*", Recipe() if recipe is None else recipe))


__all__ = ["Rule", "check_rules", "keep_ends", "recipe_for"]
