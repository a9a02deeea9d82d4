"""One public name per operation across the core, linen and NNX namespaces; renamed names warn for one release;
the package docstring lists the whole public API."""

from __future__ import annotations

import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_nvfp4

pytest.importorskip("flax")

NAMESPACES = ("jax_nvfp4", "jax_nvfp4.flax", "jax_nvfp4.flax.linen", "jax_nvfp4.flax.nnx")

# Each operation that more than one namespace offers: its name in each (one stem: a weight in the core, a
# model's weights in Flax).
OPERATIONS = {
    "quantize weights once for inference": {
        "jax_nvfp4": "quantize_weight",
        "jax_nvfp4.flax": "quantize_weights",
        "jax_nvfp4.flax.linen": "quantize_weights",
        "jax_nvfp4.flax.nnx": "quantize_weights",
    },
    "quantize weights once per training step": {
        "jax_nvfp4": "cache_weight",
        "jax_nvfp4.flax": "cache_weights",
        "jax_nvfp4.flax.linen": "cache_weights",
        "jax_nvfp4.flax.nnx": "cache_weights",
    },
    "convert a model by rules": {
        ns: "quantize_model" for ns in ("jax_nvfp4.flax", "jax_nvfp4.flax.linen", "jax_nvfp4.flax.nnx")
    },
}
# Old name -> new name, per namespace: served with a DeprecationWarning for one release (CHANGELOG).
RENAMED = {
    "jax_nvfp4.flax": {"quantize_params": "quantize_weights"},
    "jax_nvfp4.flax.linen": {"quantize_params": "quantize_weights"},
    "jax_nvfp4.flax.nnx": {"quantize_params": "quantize_weights", "cached_weights": "cache_weights"},
}
# Words that name one of these operations: a public name holding one must be the operation's name.
STEMS = re.compile(r"^(quantize|cache|cached)_(weight|weights|params)$")


def _public(namespace: str) -> dict[str, object]:
    module = importlib.import_module(namespace)
    return {name: getattr(module, name) for name in module.__all__}


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_namespace_names_each_object_once(namespace):
    names_of: dict[int, list[str]] = {}
    for name, obj in _public(namespace).items():
        if callable(obj):
            names_of.setdefault(id(obj), []).append(name)
    assert [names for names in names_of.values() if len(names) > 1] == []


def test_an_object_has_one_name_in_every_namespace():
    """``jax_nvfp4.flax`` re-exports linen: the same object under the same name, never another."""
    seen: dict[int, set[str]] = {}
    for namespace in NAMESPACES:
        for name, obj in _public(namespace).items():
            if callable(obj):
                seen.setdefault(id(obj), set()).add(name)
    assert [names for names in seen.values() if len(names) > 1] == []


def test_each_operation_has_its_one_name():
    for operation, names in OPERATIONS.items():
        for namespace, name in names.items():
            assert name in _public(namespace), f"{namespace} should offer {operation!r} as {name}"
    for namespace in NAMESPACES:
        named = {names[namespace] for names in OPERATIONS.values() if namespace in names}
        stray = {name for name in _public(namespace) if STEMS.match(name)} - named
        assert not stray, f"{namespace} offers {stray} beside the one name of their operation"


@pytest.mark.parametrize(("namespace", "old", "new"), [(ns, o, n) for ns, m in RENAMED.items() for o, n in m.items()])
def test_a_renamed_name_warns_and_is_the_new_one(namespace, old, new):
    module = importlib.import_module(namespace)
    assert old not in module.__all__
    with pytest.warns(DeprecationWarning, match=f"{namespace}.{old} is deprecated.*use {namespace}.{new}"):
        assert getattr(module, old) is getattr(module, new)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_gemms_old_argument_name_warns_and_gives_the_same_bytes():
    a = jax_nvfp4.quantize(jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16))
    b_t = jax_nvfp4.quantize(jax.random.normal(jax.random.key(1), (16, 64), jnp.bfloat16))
    with pytest.warns(DeprecationWarning, match="named b_t"):
        old = jax_nvfp4.gemm(a, c=b_t)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = jax_nvfp4.gemm(a, b_t)
    assert bool((old == new).all())
    with pytest.raises(TypeError, match="not both"):
        jax_nvfp4.gemm(a, b_t, c=b_t)


def test_the_package_docstring_lists_the_whole_api():
    doc = jax_nvfp4.__doc__
    missing = [name for name in jax_nvfp4.__all__ if not re.search(rf"(?<![\w.]){name}\b", doc)]
    assert missing == [], f"jax_nvfp4's docstring should describe {missing}"
