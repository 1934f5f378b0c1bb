"""Every shipped config is valid: schema, registered names, reward kwargs; none loads weights. The shipped launch
config silences accelerate's warning; a config whose prompts are a built file names the command that builds it."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from flowgrpo.algo.advantages import ESTIMATORS
from flowgrpo.algo.chunkers import CHUNKERS
from flowgrpo.config import load_config
from flowgrpo.rewards.registry import load_reward
from flowgrpo.sampling.sde import SDE_KINDS

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_the_expected_configs_ship():
    names = {p.stem for p in CONFIGS}
    assert {"digits", "tiny_jpeg", "flux_grpo", "flux_chunk", "flux_mix", "flux_egrpo", "sd35_grpo"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_is_valid_and_names_registered_strategies(path):
    cfg = load_config(path)
    chunker = getattr(cfg.objective, "chunker", None)  # the SDE-ratio objective's
    assert chunker is None or chunker.name in CHUNKERS
    assert cfg.sampling.sde_kind in SDE_KINDS
    assert cfg.advantage.name in ESTIMATORS
    for spec in cfg.rewards + cfg.eval_rewards:
        reward, origin = load_reward(spec.name, **spec.kwargs)  # constructs: checks kwargs, loads no weights
        assert origin.distribution is not None
        assert callable(reward)


# --------------------------------------------------------------------------------- launch defaults and prompt files
def test_shipped_launch_defaults_silence_accelerates_warning():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger().addHandler(handler)
    try:
        args = launch_command_parser().parse_args(
            ["--config_file", str(REPO / "configs" / "accelerate" / "default.yaml"), "flowgrpo/train.py"])
        args, _, _ = _validate_launch_command(args)
    finally:
        logging.getLogger().removeHandler(handler)
    assert "were not passed" not in buf.getvalue()
    assert args.num_processes == 1 and args.mixed_precision == "no"


def test_configs_name_the_command_that_builds_their_prompt_files():
    """A config whose prompt file is not shipped says, in its comments, how to make it: the ``flowgrpo prompts``
    command, or (records with a conditioning image, which no public set provides) the record's format. (The video
    configs passed on "Prompt file: JSONL or plain text", naming no way to make it.)"""
    import yaml

    checked = 0
    for path in sorted((REPO / "configs").glob("*.yaml")):
        text = path.read_text()
        data = yaml.safe_load(text)
        for key in ("train_prompts", "eval_prompts"):
            file = (data.get("data") or {}).get(key) or ""
            if "/" not in file or (REPO / file).is_file():
                continue  # an embedded set, or a file in the repository
            header = " ".join(ln.lstrip("# ") for ln in text.split("\n") if ln.startswith("#"))
            assert "flowgrpo prompts" in header or (file.endswith(".jsonl") and '"image"' in header), path.name
            checked += 1
    assert checked >= 20


def test_a_missing_prompt_file_names_the_command_that_builds_it(tmp_path):
    from flowgrpo.data.prompts import load_prompts
    from flowgrpo.data.public_prompts import PROMPT_SETS

    missing = tmp_path / "data" / "pickscore_train.txt"
    with pytest.raises(ValueError) as err:
        load_prompts(str(missing))
    (line,) = str(err.value).splitlines()
    assert f"'flowgrpo prompts SET SOURCE... --out {missing}'" in line and "flowgrpo prompts --help" in line
    assert all(name in line for name in [*PROMPT_SETS.names(), "geneval"]), line


def test_the_digits_variants_are_described_by_what_they_change():
    """Each configs/digits_*.yaml changes one method of configs/digits.yaml; docs/configs.md and digits.yaml's
    header name every kind of method they change (they said "one per chunker / SDE kind" once objectives came)."""
    base = load_config(REPO / "configs" / "digits.yaml")

    def methods(c) -> dict[str, str]:
        chunker = getattr(c.objective, "chunker", None)  # the SDE-ratio objective's: another has none to change
        return {"a chunker": chunker.name if chunker else base.objective.chunker.name,
                "an SDE kind": c.sampling.sde_kind, "an advantage estimator": c.advantage.name,
                "an objective": c.objective.name}

    kinds = set()
    for path in sorted((REPO / "configs").glob("digits_*.yaml")):
        changed = [k for k, v in methods(load_config(path)).items() if v != methods(base)[k]]
        assert len(changed) == 1, (path.name, changed)
        kinds.add(changed[0])
    assert kinds == set(methods(base))  # every kind occurs, so every kind must be named
    row = next(ln for ln in (REPO / "docs" / "configs.md").read_text().splitlines() if "`configs/digits_*.yaml`" in ln)
    header = " ".join(ln.lstrip("# ") for ln in (REPO / "configs" / "digits.yaml").read_text().splitlines()
                      if ln.startswith("#"))
    for kind in kinds:
        assert kind in row and kind in header, kind


def test_every_shipped_noise_level_is_in_its_kinds_release_range():
    """The release ranges the noise-level warning compares with hold every shipped config's value (each config
    names its release), so none of them is warned about."""
    from flowgrpo.sampling.sde import RELEASE_NOISE_LEVELS, noise_level_warning

    seen = set()
    for path in CONFIGS:
        s = load_config(path).sampling
        if s.sde_kind in RELEASE_NOISE_LEVELS:
            low, high, _ = RELEASE_NOISE_LEVELS[s.sde_kind]
            assert low <= s.noise_level <= high, (path.name, s.sde_kind, s.noise_level)
            assert noise_level_warning(s.sde_kind, s.noise_level) is None
            seen.add((s.sde_kind, s.noise_level))
    # each range's ends are a shipped release config's value
    for kind, (low, high, _) in RELEASE_NOISE_LEVELS.items():
        assert (kind, low) in seen and (kind, high) in seen, kind


@pytest.mark.parametrize(("config", "typed", "meant"), [("digits.yaml", 7.0, 0.7), ("digits_dance.yaml", 3.0, 0.3)])
def test_a_noise_level_far_above_the_releases_is_warned_before_any_model_loads(tmp_path, caplog, config, typed,
                                                                                meant):
    from flowgrpo.preflight import preflight

    cfg = load_config(REPO / "configs" / config, [f"output_dir={tmp_path / 'run'}", f"sampling.noise_level={typed}"])
    with caplog.at_level(logging.WARNING, logger="flowgrpo.preflight"):
        preflight(cfg, world_size=1)
    (line,) = [r.getMessage() for r in caplog.records if "noise_level" in r.getMessage()]
    kind = cfg.sampling.sde_kind
    assert line.startswith(f"sampling.noise_level={typed:g} is ") and f"sde_kind {kind!r}" in line, line
    assert f"a typo for {meant:g}?" in line and "\n" not in line
    caplog.clear()
    ok = load_config(REPO / "configs" / config, [f"output_dir={tmp_path / 'ok'}", "sampling.noise_level=2.4"])
    with caplog.at_level(logging.WARNING, logger="flowgrpo.preflight"):
        preflight(ok, world_size=1)  # twice the largest release value (1.2): not warned
    assert not [r for r in caplog.records if "noise_level" in r.getMessage()]


def test_opds_own_noise_level_is_warned_too():
    from flowgrpo.sampling.sde import noise_level_warning

    line = noise_level_warning("flow_sde", 9.0, "objective.noise_level")
    assert line.startswith("objective.noise_level=9 is 7.5 times the largest") and "a typo for 0.9?" in line
    assert noise_level_warning("cps", 8.0) is None and noise_level_warning("ode", 8.0) is None
    # the preflight asks the objective's settings for the noise they give its rollout (never the objective's name)
    opd = load_config(REPO / "configs" / "digits_opd.yaml", ["objective.noise_level=9.0"])
    assert [noise_level_warning(*noise) for noise in opd.objective.own_noise()] == [line]
    assert load_config(REPO / "configs" / "digits.yaml").objective.own_noise() == []


def test_a_config_error_under_accelerate_launch_is_our_one_line(tmp_path):
    """``accelerate launch flowgrpo/train.py bad.yaml`` printed the one-line error, then accelerate's launcher
    traceback (CalledProcessError: the process exited non-zero); with ``-q``, as every documented command launches,
    the one line alone and a non-zero exit."""
    import os
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {num_epochs: -1}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "rewards"),
                                                         os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file",
                          str(REPO / "configs" / "accelerate" / "default.yaml"), "flowgrpo/train.py", str(bad)],
                         capture_output=True, text=True, timeout=1800, cwd=REPO, env=env)
    assert out.returncode != 0
    assert out.stderr.strip() == ("error: config field 'train.num_epochs': Input should be greater than or equal to 1 "
                                  "(got -1)"), out.stderr[-2000:]


def test_every_documented_accelerate_launch_is_quiet():
    """The commands users copy (README, docs, the configs' headers, the training script's usage) launch with
    ``-q``, so that an error ends with the run's own line (the test above)."""
    import re

    texts = [REPO / "README.md", REPO / "flowgrpo" / "train.py", REPO / "flowgrpo" / "runner.py",
             *(p for p in (REPO / "docs").glob("*.md") if p.name != "results.md"),  # results: commands as run
             *(REPO / "configs").rglob("*.yaml"), *(REPO / "flowgrpo" / "tasks").rglob("*.yaml")]
    found = 0
    for path in texts:
        for command in re.findall(r"accelerate launch (?:--config_file|--multi_gpu|-q|flowgrpo/train\.py)",
                                  path.read_text()):
            assert command == "accelerate launch -q", (path.name, command)
            found += 1
    assert found >= 40
