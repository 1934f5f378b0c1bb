"""bench/learning.py's aggregation on hand-written run folders (no training): per-digit diversity ratios, RL wall
time, epochs to judge correctness 0.97, mean (min–max) over seeds, and --resume."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "learning.py"


@pytest.fixture(scope="module")
def learning():
    spec = importlib.util.spec_from_file_location("bench_learning", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # registered before it runs, as importlib's recipe does (its dataclasses need it)
    spec.loader.exec_module(mod)
    return mod


def fake_run(folder: Path, after: float, evals: dict[int, float], epochs: int = 20) -> Path:
    """A digits run folder: every digit's real diversity 30; after RL digit 4 at 12 (ratio 0.4), digit 7 at 24
    (0.8), the others at 30 (1.0); each epoch rollout 1.5 s + update 2.0 s (+ eval 10 s where evaluated)."""
    folder.mkdir(parents=True)
    summary = {"correctness_before": 0.6, "correctness_after": after, "epochs": epochs, "diversity_real": 36.1,
               "diversity_after": 25.0, "diversity_min_ratio_after": 0.4}
    for d in range(10):
        summary[f"digit_{d}_diversity_real"] = 30.0
        summary[f"digit_{d}_diversity_before"] = 33.0
        summary[f"digit_{d}_diversity_after"] = {4: 12.0, 7: 24.0}.get(d, 30.0)
        summary[f"digit_{d}_correctness_after"] = after
    (folder / "summary.json").write_text(json.dumps(summary))
    lines = []
    for e in range(epochs):
        rec = {"epoch": e, "timing/rollout": 1.5, "timing/update": 2.0, "rollout/transformer_calls": 16,
               "rollout/transformer_rows": 512, "rollout/trajectories": 128}
        if e in evals:
            rec.update({"timing/eval": 10.0, "eval/correctness": evals[e], "eval/diversity": 20.0})
        lines.append(json.dumps(rec))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_seed_figures(learning, tmp_path):
    # periodic evaluations after 5, 10, 15 epochs (records 4, 9, 14); 0.97 exactly counts as reached
    r = learning.seed_figures(fake_run(tmp_path / "a", 0.99, {4: 0.90, 9: 0.97, 14: 0.99}))
    assert r["ratio_min_after"] == pytest.approx(0.4)
    assert r["ratio_mean_after"] == pytest.approx((8 * 1.0 + 0.4 + 0.8) / 10)
    assert r["rl_seconds"] == pytest.approx(20 * (1.5 + 2.0))  # the 3 x 10 s of evaluation left out
    assert r["eval_seconds_periodic"] == pytest.approx(30.0)
    assert r["epochs_to_target"] == 10
    assert (r["calls_per_epoch"], r["rows_per_epoch"]) == (16, 512)


def test_epochs_to_target_final_and_never(learning, tmp_path):
    # no periodic evaluation reached 0.97 but the final one did: counted at the last epoch
    final = learning.seed_figures(fake_run(tmp_path / "b", 0.975, {4: 0.90, 9: 0.969}))
    assert final["epochs_to_target"] == 20
    never = learning.seed_figures(fake_run(tmp_path / "c", 0.96, {4: 0.90, 9: 0.95}))
    assert never["epochs_to_target"] is None


def test_not_a_digits_run(learning, tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"epochs": 1, "correctness_after": 0.5}))
    (folder / "metrics.jsonl").write_text(json.dumps({"epoch": 0}) + "\n")
    with pytest.raises(ValueError, match="not a digits run"):
        learning.seed_figures(folder)


def test_aggregate_mean_and_range(learning, tmp_path):
    results = []
    for seed, (after, evals) in enumerate([(0.99, {4: 0.9, 9: 0.97}), (0.975, {9: 0.95}), (0.96, {9: 0.95})]):
        fig = learning.seed_figures(fake_run(tmp_path / f"s{seed}", after, evals))
        results.append({"row": "default", "seed": seed, "overrides": [], **fig})
    results[1]["ratio_min_after"] = 0.7  # seeds differ in their minimum: 0.4, 0.7, 0.4
    results[2]["rl_seconds"] = 100.0  # 70, 70, 100
    (t,) = learning.aggregate(results)
    assert t["seeds"] == [0, 1, 2]
    assert t["correctness_after"] == "0.975 (0.960–0.990)"  # (0.99 + 0.975 + 0.96) / 3
    assert t["ratio_min_after"] == "0.50 (0.40–0.70)"
    assert t["ratio_mean_after"] == "0.92 (0.92–0.92)"
    assert t["rl_seconds"] == "80 (70–100)"
    assert t["epochs_to_target"] == "15 (10–20); 2/3 seeds"  # 10, 20 (final), never
    assert t["settings"] == "digits.yaml"
    table = learning.markdown([t])
    assert table.splitlines()[2].startswith("| default | 0 1 2 | 0.975 (0.960–0.990) | 0.92 (0.92–0.92) | 0.50")
    assert learning.spread([None, None], ".0f") == "—"


def test_resume_skips_finished_and_refuses_other_overrides(learning, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    overrides = [*learning.ROWS["trajectory"], "train.num_epochs=20", "logging.eval_every=5"]
    fig = learning.seed_figures(fake_run(tmp_path / "r", 0.99, {4: 0.98}))
    (out / "trajectory").mkdir(parents=True)
    (out / "trajectory" / "seed0.json").write_text(json.dumps({"row": "trajectory", "seed": 0,
                                                               "overrides": overrides, **fig}))

    def no_training(*a, **k):
        raise AssertionError("a finished (row, seed) was trained again")

    monkeypatch.setattr(learning, "run_one", no_training)
    argv = ["learning.py", "--rows", "trajectory", "--seed", "0", "--epochs", "20", "--out", str(out), "--resume"]
    monkeypatch.setattr(sys, "argv", argv)
    learning.main()
    assert "| trajectory | 0 | 0.990 | 0.92 | 0.40 | 70 | 20 | 5 |" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["30" if a == "20" else a for a in argv])  # --epochs 30: other overrides
    with pytest.raises(ValueError, match="was run with overrides"):
        learning.main()


def test_every_row_is_a_valid_config(learning):
    import yaml

    from flowgrpo.config import ConfigError, build_config
    from flowgrpo.preflight import check_batch, check_strategies
    from flowgrpo.runner import DEFAULT_CONFIG

    for name, overrides in learning.ROWS.items():
        cfg = build_config(learning.row_data(name), [*overrides, "logging.eval_every=5"])
        assert cfg.logging.eval_every == 5, name
        objective = check_strategies(cfg)  # what the run checks before loading: the chunker against the SDE kind,
        check_batch(cfg, 1)  # the batch layout, and after loading: the chunker on the digits model's σ grid
        settings = cfg.sampling  # (σ_i = 1 − i/T, no shift)
        objective.trajectories_per_sample(torch.linspace(1, 0, settings.num_steps + 1), settings)
    assert build_config(yaml.safe_load(DEFAULT_CONFIG.read_text()), learning.OLD_DEFAULT).train.num_epochs == 80
    with pytest.raises(ConfigError):  # the check can fail: a misspelt key is refused
        build_config(yaml.safe_load(DEFAULT_CONFIG.read_text()), ["objective.chunker.nmae=chunk"])


def test_the_per_step_default_row_is_configs_digits_yaml(learning):
    """The row that keeps the previous default and the shipped per-step digits config name the same settings."""
    import yaml

    from flowgrpo.config import build_config, load_config
    from flowgrpo.runner import DEFAULT_CONFIG

    row = build_config(yaml.safe_load(DEFAULT_CONFIG.read_text()), [*learning.PER_STEP_DEFAULT, "output_dir=x"])
    shipped = load_config(BENCH.parents[1] / "configs" / "digits.yaml", ["output_dir=x"])
    assert row == shipped
    assert row != build_config(yaml.safe_load(DEFAULT_CONFIG.read_text()), ["output_dir=x"])  # not the default


def no_training(*a, **k):
    raise AssertionError("the bench trained a row")


def parser_error(learning, monkeypatch, capsys, args: list[str]) -> str:
    """Runs the bench's main on ``args`` with training refused; it must stop with a parser error (exit status 2)
    before any run. Returns the error line."""
    monkeypatch.setattr(learning, "run_one", no_training)
    monkeypatch.setattr(sys, "argv", ["learning.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        learning.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("learning.py: error: ") and sum("error" in line for line in err) == 1, err
    return err[-1]


@pytest.mark.parametrize("epochs", ["0", "-1"])
def test_epochs_below_one_is_a_parser_error(learning, monkeypatch, capsys, tmp_path, epochs):
    # --epochs 0 used to be ignored (the config's epochs ran); -1 ended in a ConfigError traceback
    line = parser_error(learning, monkeypatch, capsys, ["--rows", "default", "--seed", "0", "--epochs", epochs,
                                                        "--out", str(tmp_path)])
    assert "--epochs" in line and ">= 1" in line


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_seed_out_of_range_is_a_parser_error(learning, monkeypatch, capsys, tmp_path, seed):
    line = parser_error(learning, monkeypatch, capsys, ["--rows", "default", "--seed", "0", seed,
                                                        "--out", str(tmp_path)])
    assert "--seed" in line and "0 and 2**32 - 1" in line
    args, _ = learning.parse_args(["--rows", "default", "--seed", "0", str(2**32 - 1)])  # the ends are allowed
    assert args.seed == [0, 2**32 - 1]


@pytest.mark.parametrize(("override", "message"), [("foo.bar=1", "unknown config key 'foo'"),
                                                   ("novalue", "must look like dotted.key=value")])
def test_bad_set_is_a_parser_error(learning, monkeypatch, capsys, tmp_path, override, message):
    line = parser_error(learning, monkeypatch, capsys, ["--rows", "default", "--seed", "0", "--set", override,
                                                        "--out", str(tmp_path)])
    assert "row 'default'" in line and message in line


def test_every_row_is_checked_before_any_training(learning, monkeypatch, capsys, tmp_path):
    # per_step has no entropy_threshold: refused before the default row trains, naming the row and the key
    line = parser_error(learning, monkeypatch, capsys, ["--rows", "default", "per_step", "--seed", "0",
                                                        "--set", "objective.chunker.entropy_threshold=0.8",
                                                        "--out", str(tmp_path)])
    assert "row 'per_step'" in line and "objective.chunker.entropy_threshold" in line
    assert not (tmp_path / "default").exists()


def test_repeated_set_combines_and_resume_compares_the_combined_list(learning, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    both = ["train.lr=1.0e-4", "objective.kl_beta=0.01"]
    fig = learning.seed_figures(fake_run(tmp_path / "r", 0.99, {4: 0.98}))
    (out / "trajectory").mkdir(parents=True)
    path = out / "trajectory" / "seed0.json"
    overrides = [*learning.ROWS["trajectory"], *both, "logging.eval_every=5"]
    path.write_text(json.dumps({"row": "trajectory", "seed": 0, "overrides": overrides, **fig}))
    monkeypatch.setattr(learning, "run_one", no_training)
    monkeypatch.setattr(sys, "argv", ["learning.py", "--rows", "trajectory", "--seed", "0", "--out", str(out),
                                      "--resume", "--set", both[0], "--set", both[1]])
    learning.main()  # the JSON written with both overrides is the finished run
    assert f"every row also has: {' '.join(both)} logging.eval_every=5" in capsys.readouterr().out
    overrides.remove(both[0])  # one written with the last --set only has other overrides
    path.write_text(json.dumps({"row": "trajectory", "seed": 0, "overrides": overrides, **fig}))
    with pytest.raises(ValueError, match="was run with overrides"):
        learning.main()


def test_out_and_json_keep_the_write_rule(learning, monkeypatch, capsys, tmp_path):
    """flowgrpo.writing.outputs: --out is empty, absent or this bench's (an older one holds only row folders); --json is
    replaced only with --overwrite. Before: the bench wrote its row folders into any folder and replaced --json."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    line = parser_error(learning, monkeypatch, capsys, ["--rows", "default", "--seed", "0", "--out", str(mine)])
    assert line == (f"learning.py: error: --out {str(mine)!r} is not empty and was not made by flowgrpo (it holds "
                    "'notes.txt'): nothing was written; choose another folder, or empty this one")
    old = tmp_path / "old"
    (old / "default").mkdir(parents=True)
    figures = tmp_path / "figures.json"
    figures.write_text("[]")
    line = parser_error(learning, monkeypatch, capsys, ["--rows", "default", "--seed", "0", "--out", str(old),
                                                        "--json", str(figures)])
    assert line.startswith(f"learning.py: error: --json {str(figures)!r} exists") and "--overwrite" in line
    learning.parse_args(["--rows", "default", "--seed", "0", "--out", str(old), "--json", str(figures),
                         "--overwrite"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json", "mine", "old"]
    assert (mine / "notes.txt").read_text() == "mine" and figures.read_text() == "[]"
