"""benchmarks.train_lm_seeds: invocations of the example merged by their settings (the learning rate included),
and the plots' choice where groups of one width and length differ in learning rate: the most seeds, then the
lowest bf16 loss (a sweep's bf16-only runs not candidates)."""

from __future__ import annotations

import json

import pytest

from benchmarks import train_lm_seeds


def _write(tmp_path, name: str, *, d_model: int, lr: float, seed: int, final: dict[str, float], **settings) -> str:
    """An example's --json of one seed: each run's validation loss at steps 100 and 200 (the last as given)."""
    args = dict.fromkeys(train_lm_seeds.SETTINGS) | {"steps": 200, "d_model": d_model, "lr": lr, "seed": seed}
    args |= {"heads": 4, **settings}
    results = {
        run: {
            "val_loss": [[100, 3.0], [200, loss]],
            "final_val_loss": loss,
            "final_train_loss": loss,
            "ms_per_step": 1.0,
            "switch": None,
        }
        for run, loss in final.items()
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"args": args, "results": results}))
    return str(path)


def test_groups_split_by_learning_rate_and_the_plots_take_the_most_seeds_then_the_tuned_rate(tmp_path, capsys):
    files = [
        _write(tmp_path, "d128", d_model=128, lr=3e-3, seed=0, final={"full": 2.2, "bf16": 2.0}),
        _write(tmp_path, "d256-a", d_model=256, lr=3e-3, seed=0, final={"full": 3.0, "bf16": 2.0}),
        _write(tmp_path, "d256-b0", d_model=256, lr=1e-3, seed=0, final={"full": 2.04, "bf16": 2.0}),
        _write(tmp_path, "d256-b1", d_model=256, lr=1e-3, seed=1, final={"full": 2.06, "bf16": 2.0}),
        _write(tmp_path, "sweep", d_model=256, lr=5e-4, seed=0, final={"bf16": 2.1}),
        _write(tmp_path, "d128-high", d_model=128, lr=6e-3, seed=0, final={"full": 2.1, "bf16": 1.9}),
    ]
    found = train_lm_seeds.groups(files)
    assert [(s.d_model, s.lr, sorted(by_seed)) for s, by_seed in found] == [
        (128, 3e-3, [0]),
        (128, 6e-3, [0]),
        (256, 3e-3, [0]),
        (256, 1e-3, [0, 1]),
        (256, 5e-4, [0]),
    ]
    chosen = train_lm_seeds.comparable(found)
    out = capsys.readouterr().out
    assert "gpt d_model 256, 200 steps: lr 0.001 (2 seeds) drawn, lr 0.003 (1 seed) not" in out
    assert "gpt d_model 128, 200 steps: lr 0.006 (1 seed) drawn, lr 0.003 (1 seed) not" in out  # bf16 ends lower
    assert {key: settings.lr for key, (settings, _) in chosen.items()} == {
        ("gpt", 128, 200): 6e-3,
        ("gpt", 256, 200): 1e-3,
    }
    for draw in (train_lm_seeds.plot_widths, train_lm_seeds.plot_progress):
        plot = tmp_path / f"{draw.__name__}.png"
        draw(chosen, str(plot))
        assert plot.stat().st_size > 0


def test_blocks_group_apart_and_a_switch_to_bf16_takes_the_unswitched_bf16(tmp_path, capsys):
    """A file without --arch ran GPT-2's block: it groups with --arch gpt, not with qwen3; --kv-heads groups by the
    value the model took (its default half of --heads, or said). A precision schedule
    switching to bf16 forms its own group, not drawn, whose bf16 partner is the unswitched one (bf16 does not
    switch)."""
    switch = {"switch_at": 0.9, "switch_to": "bf16"}
    files = [
        _write(tmp_path, "old", d_model=128, lr=3e-3, seed=0, final={"full": 2.2, "bf16": 2.0}),
        _write(tmp_path, "gpt", d_model=128, lr=3e-3, seed=1, final={"full": 2.3, "bf16": 2.0}, arch="gpt"),
        _write(tmp_path, "q0", d_model=128, lr=3e-3, seed=0, final={"full": 2.1, "bf16": 2.0}, arch="qwen3"),
        # --kv-heads 2 said, as the default (half of 4 heads) is: the same model
        _write(
            tmp_path, "q1", d_model=128, lr=3e-3, seed=1, final={"full": 2.1, "bf16": 2.0}, arch="qwen3", kv_heads=2
        ),
        _write(tmp_path, "q256", d_model=256, lr=3e-3, seed=0, final={"full": 2.05, "bf16": 2.0}, arch="qwen3"),
        _write(tmp_path, "qs", d_model=128, lr=3e-3, seed=0, final={"full": 2.02}, arch="qwen3", **switch),
    ]
    found = train_lm_seeds.groups(files)
    assert "qwen3 d_model 128, switched to bf16: bf16 from the unswitched runs" in capsys.readouterr().out
    named = {(s.arch, s.d_model, s.switch_to): (s.runs, sorted(by_seed)) for s, by_seed in found}
    assert named == {
        ("gpt", 128, None): (["full", "bf16"], [0, 1]),
        ("qwen3", 128, None): (["full", "bf16"], [0, 1]),
        ("qwen3", 128, "bf16"): (["full", "bf16"], [0]),
        ("qwen3", 256, None): (["full", "bf16"], [0]),
    }
    switched = next(by_seed for s, by_seed in found if s.switch_to == "bf16")
    assert switched[0]["full"]["final_val_loss"] == 2.02 and switched[0]["bf16"]["final_val_loss"] == 2.0
    chosen = train_lm_seeds.comparable(found)
    assert sorted(chosen) == [("gpt", 128, 200), ("qwen3", 128, 200), ("qwen3", 256, 200)]
    assert train_lm_seeds._multi_width_runs(chosen) == [("qwen3", "full")]
    assert train_lm_seeds._multi_width_runs(chosen, ["rht"]) == []  # named, but at one width or none
    with pytest.raises(ValueError, match=r"--width-runs names no run of examples.train_lm: \['ful'\]"):
        train_lm_seeds._multi_width_runs(chosen, ["full", "ful"])
    for draw in (train_lm_seeds.plot_widths, train_lm_seeds.plot_progress):
        plot = tmp_path / f"{draw.__name__}.png"
        draw(chosen, str(plot))
        assert plot.stat().st_size > 0
