"""The README as a newcomer reads it: short, the two set-up commands first, and its example runs as written."""

from __future__ import annotations

import pathlib
import re
import warnings

import jax.numpy as jnp
import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_the_set_up_commands_come_first():
    commands = _blocks(README.read_text(), "bash")
    assert commands[0].strip() == 'pip install ".[examples]" && python -m examples.train_lm'
    assert commands[1].strip() == 'NVFP4_CUDA_HOST=ON pip install ".[test]" && pytest -n 2'


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 120, "the README is for a user with five minutes"


def test_the_example_runs_as_written():
    """The README's one example, as a reader pastes it: every rule matches a layer, the kept layers are the
    first and last blocks' and the head, and the sharded training step returns a finite loss."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    (code,) = _blocks(_section(README.read_text(), "Example"), "python")
    from jax_nvfp4.flax import UnmatchedRuleWarning
    from jax_nvfp4.flax.rules import recipe_for

    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedRuleWarning)
        exec(compile(code, str(README), "exec"), namespace)
    assert bool(jnp.isfinite(namespace["loss"]))
    kept = {"Block_0/Dense_0", "Block_3/Dense_1", "head"}
    assert {p for p in (*kept, "Block_1/Dense_0") if recipe_for(namespace["model"].rules, p) is None} == kept
