"""The README as a newcomer reads it: the two set-up commands come first, and the Quick start runs as written."""

from __future__ import annotations

import pathlib
import re
import warnings

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


def test_the_quick_start_runs_as_written():
    pytest.importorskip("flax")
    code = _blocks(_section(README.read_text(), "Quick start"), "python")
    assert len(code) == 2, "the Quick start's two blocks: the ops, then Flax"
    from jax_nvfp4.flax import UnmatchedRuleWarning
    from jax_nvfp4.flax.rules import recipe_for

    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedRuleWarning)  # every rule matched a layer
        for block in code:  # one session, as a reader pasting them in order
            exec(compile(block, str(README), "exec"), namespace)
    assert namespace["y"].shape == (64, 128) and namespace["dw"].shape == (128, 32)
    assert namespace["out"].shape == (8, 512) and namespace["logits"].shape == (8, 10)
    # The rules kept the first and last blocks (Flax's automatic names) and the head: they matched layers.
    kept = {"Block_0/Dense_0", "Block_3/Dense_1", "head"}
    assert {p for p in (*kept, "Block_1/Dense_0") if recipe_for(namespace["model"].rules, p) is None} == kept
