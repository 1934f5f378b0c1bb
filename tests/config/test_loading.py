"""Specification of the typed configuration (flowgrpo.config) and of ``train.py --help``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from flowgrpo.config import Config, ConfigError, build_config, load_config, parse_override, save_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_derive_the_batch_sizes():
    cfg = build_config()
    assert cfg.batch_size == cfg.train.prompts_per_epoch * cfg.train.group_size
    assert cfg.train_batch_size == cfg.train.rollout_batch_size  # train_batch_size defaults to the rollout's
    assert cfg.clip_low == cfg.clip_high == cfg.algo.clip_range
    cfg = build_config({"algo": {"clip_range": 1e-4, "clip_range_high": 3e-4}, "train": {"train_batch_size": 4}})
    assert (cfg.clip_low, cfg.clip_high, cfg.train_batch_size) == (1e-4, 3e-4, 4)


@pytest.mark.parametrize(
    ("data", "overrides", "bad", "hint"),
    [
        ({"train": {"grup_size": 4}}, [], "train.grup_size", "train.group_size"),
        ({}, ["samplng.num_steps=4"], "samplng", "sampling"),
        ({}, ["algo.clip_rnge=0.1"], "algo.clip_rnge", "algo.clip_range"),
        ({"model": {"lora_rnak": 4}}, [], "model.lora_rnak", "model.lora_rank"),
    ],
)
def test_unknown_key_fails_with_a_suggestion(data, overrides, bad, hint):
    with pytest.raises(ConfigError) as err:
        build_config(data, overrides)
    msg = str(err.value)
    assert f"unknown config key '{bad}'" in msg
    assert f"did you mean '{hint}'" in msg


def test_unknown_key_in_a_reward_spec_suggests_the_spec_field():
    with pytest.raises(ConfigError) as err:
        build_config({"rewards": [{"name": "jpeg_compressibility", "wieght": 2.0}]})
    msg = str(err.value)
    assert "unknown config key 'rewards.0.wieght'" in msg
    assert re.search(r"did you mean '(rewards\.(0\.)?)?weight'", msg), msg


def test_unknown_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  num_epoch: 3\n")
    with pytest.raises(ConfigError, match=r"train\.num_epoch.*did you mean 'train\.num_epochs'"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.num_epochs=ten", "train.num_epochs"),
        ("sampling.noise_level=-1", "sampling.noise_level"),
        ("model.dtype=float64", "model.dtype"),
        ("train.group_size=1", "train.group_size"),
        ("chunker.timestep_fraction=1.5", "chunker.timestep_fraction"),
    ],
)
def test_bad_value_names_the_field_and_the_value(override, field):
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    msg = str(err.value)
    assert field in msg
    assert override.split("=", 1)[1] in msg


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        # B = 3·3 = 9 is not divisible by 2
        (["train.prompts_per_epoch=3", "train.group_size=3", "train.rollout_batch_size=2"],
         ["rollout_batch_size=2", "9"]),
        # B = 8·4 = 32, train_batch_size 5 does not divide it
        (["train.prompts_per_epoch=8", "train.group_size=4", "train.rollout_batch_size=8", "train.train_batch_size=5"],
         ["train_batch_size=5", "32"]),
        # 32 / 8 = 4 micro-batches cannot be shared by 3 optimizer steps
        (["train.prompts_per_epoch=8", "train.group_size=4", "train.rollout_batch_size=8",
          "train.optimizer_steps_per_epoch=3"], ["optimizer_steps_per_epoch=3", "4"]),
    ],
)
def test_impossible_batch_combination_names_the_values(overrides, needles):
    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    for needle in needles:
        assert needle in str(err.value)


def test_overrides_parse_yaml_types():
    assert parse_override("train.seed=7") == (["train", "seed"], 7)
    assert parse_override("a.b=0.5") == (["a", "b"], 0.5)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=[2, 3, 4, 7]") == (["a"], [2, 3, 4, 7])
    assert parse_override("a={x: 1}") == (["a"], {"x": 1})
    assert parse_override("a=x=y") == (["a"], "x=y")  # only the first '=' splits
    cfg = build_config({}, ["train.lr=1e-4", "chunker.name=chunk", "chunker.chunk_sizes=[2,3,4,7]", "model.height=null",
                            "algo.drop_zero_spread_groups=true", "train.seed=3", "logging.trackers=[tensorboard]"])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.chunker.chunk_sizes == [2, 3, 4, 7]
    assert cfg.model.height is None
    assert cfg.algo.drop_zero_spread_groups is True
    assert cfg.train.seed == 3
    assert cfg.logging.trackers == ["tensorboard"]


def test_overrides_apply_on_top_of_the_file(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  lr: 0.01\n  seed: 5\nsampling: {num_steps: 6}\n")
    cfg = load_config(path, ["train.lr=0.5", "sampling.guidance_scale=1"])
    assert (cfg.train.lr, cfg.train.seed, cfg.sampling.num_steps, cfg.sampling.guidance_scale) == (0.5, 5, 6, 1.0)


def test_overrides_do_not_modify_the_callers_dict():
    base = {"train": {"lr": 0.1}}
    first = build_config(base, ["train.seed=3"])
    second = build_config(base)  # a sweep reusing one base config
    assert first.train.seed == 3
    assert base == {"train": {"lr": 0.1}}
    assert second.train.seed == 0


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        build_config({}, ["train.lr"])


def test_missing_file_and_non_mapping_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_saved_config_loads_back_equal(tmp_path):
    cfg = build_config({}, ["train.lr=0.003", "chunker.name=chunk", "chunker.chunk_sizes=[4, 6]",
                            "rewards=[{name: jpeg_compressibility, weight: 2.0}]"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["lr"] == 0.003


def _schema_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, description) of every leaf field, walked from the pydantic schema here in the test."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _schema_keys(ann, f"{prefix}{name}.")
        else:
            rows.append((prefix + name, field.description or ""))
    return rows


def test_train_help_lists_every_field():
    out = subprocess.run([sys.executable, str(REPO / "flowgrpo" / "train.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    keys = _schema_keys(Config)
    assert len(keys) > 50
    lines = out.stdout.splitlines()
    for key, description in keys:
        line = next((ln for ln in lines if ln.split() and ln.split()[0] == key), None)
        assert line is not None, f"--help does not list {key}"
        assert description[:30] in line, f"--help does not describe {key}"


def test_base_config_is_merged_key_by_key(tmp_path):
    from flowgrpo.config import load_config

    (tmp_path / "parent.yaml").write_text("train: {lr: 0.5, seed: 7}\nsampling: {num_steps: 6}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ntrain: {lr: 0.25}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.train.lr, cfg.train.seed, cfg.sampling.num_steps) == (0.25, 7, 6)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="its own base"):
        load_config(tmp_path / "loop.yaml")


def test_old_grouper_section_is_an_alias_that_warns():
    """The strategy section was renamed grouper -> chunker; the old key (file or override) still works, warning."""
    with pytest.warns(FutureWarning, match="'grouper' is now called 'chunker'"):
        cfg = build_config({"grouper": {"name": "chunk"}})
    assert cfg.chunker.name == "chunk"
    with pytest.warns(FutureWarning, match="chunker"):
        cfg = build_config({}, ["grouper.name=window"])
    assert cfg.chunker.name == "window"
    with pytest.raises(ConfigError, match="keep only 'chunker'"), pytest.warns(FutureWarning):
        build_config({"grouper": {"name": "chunk"}, "chunker": {"name": "window"}})


def test_each_chunker_has_its_own_section():
    """A knob of another strategy is an error naming its owner (it used to be silently ignored); a typo gets a
    suggestion; the section's values round-trip through the saved YAML."""
    with pytest.raises(ConfigError, match="chunker.window_size=8 is read only by chunker.name=window, but chunker.name "
                                          "is 'per_step'"):
        build_config({"chunker": {"name": "per_step", "window_size": 8}})
    # switching the default's E-GRPO chunker by name alone leaves its knobs: the error says how to switch
    with pytest.raises(ConfigError, match=r"replace the whole section, e.g. 'chunker=\{name: chunk\}'"):
        build_config({"chunker": {"name": "entropy_merge", "entropy_threshold": 0.9}}, ["chunker.name=chunk"])
    assert build_config({"chunker": {"name": "entropy_merge", "entropy_threshold": 0.9}},
                        ["chunker={name: chunk}"]).chunker.name == "chunk"
    with pytest.raises(ConfigError, match="did you mean 'min_chunk_size'"):
        build_config({"chunker": {"name": "chunk", "min_chunk_sise": 3}})
    with pytest.raises(ConfigError, match="unknown chunker 'per_stp'.*did you mean 'per_step'"):
        build_config({"chunker": {"name": "per_stp"}})
    with pytest.raises(ConfigError, match="exactly one of chunker.entropy_threshold"):
        build_config({"chunker": {"name": "entropy_merge"}})
    cfg = build_config({"chunker": {"name": "window", "window_size": 3}})
    assert build_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))).chunker == cfg.chunker


def test_registered_names_are_checked_by_the_schema():
    with pytest.raises(ConfigError, match="sampling.sde_kind: unknown SDE kind 'flow_sd'.*did you mean 'flow_sde'"):
        build_config({}, ["sampling.sde_kind=flow_sd"])
    with pytest.raises(ConfigError, match="algo.advantage: unknown advantage estimator 'grp'"):
        build_config({}, ["algo.advantage=grp"])


def test_egrpo_optimizer_steps_are_checked_against_its_own_batch():
    """Before: E-GRPO's 8 x 3 x 8 = 192 trajectories (24 micro-batches of 8) were counted as P·G = 64 (8
    micro-batches), so 3 optimizer steps were refused with the wrong count."""
    over = ["train.prompts_per_epoch=8", "train.group_size=8", "train.rollout_batch_size=16",
            "train.train_batch_size=8", "train.optimizer_steps_per_epoch=3"]
    egrpo = build_config({"chunker": {"name": "entropy_merge", "entropy_threshold": 0.9}}, over)
    assert egrpo.train.optimizer_steps_per_epoch == 3
    with pytest.raises(ConfigError, match="optimizer_steps_per_epoch=3 must divide .* = 8"):
        build_config({"chunker": {"name": "per_step"}}, over)


def test_a_reward_in_both_lists_is_named_as_such_and_a_repeat_as_a_repeat():
    """Before: an evaluation judge moved into rewards on top of the default's eval_rewards was reported only as
    'repeated', which did not say which list it should leave."""
    with pytest.raises(ConfigError, match=r"rewards \['digit_judge'\] are in both rewards and eval_rewards"):
        build_config({"rewards": [{"name": "digit_judge"}], "eval_rewards": [{"name": "digit_judge"}]})
    with pytest.raises(ConfigError, match=r"may appear once .* repeated: \['jpeg_compressibility'\]"):
        build_config({"rewards": [{"name": "jpeg_compressibility"}, {"name": "jpeg_compressibility", "weight": 2}]})


def test_losses_and_filters_have_their_own_sections_and_a_plain_name_is_shorthand():
    """``algo.policy_loss`` and ``algo.group_filter`` are strategy sections as ``chunker`` is: the plain name of
    the shipped configs still reads, a knob goes in its loss's section, an override may set a knob of a section
    given by its name, and the resolved config round-trips through the saved YAML."""
    import yaml

    from flowgrpo.algo.losses import SapoConfig

    cfg = build_config({"algo": {"policy_loss": "sapo"}}, ["algo.policy_loss.tau_pos=500"])
    assert isinstance(cfg.algo.policy_loss, SapoConfig) and cfg.algo.policy_loss.tau_pos == 500.0
    assert cfg.objective.name == "sde_ratio" and cfg.algo.group_filter.name == "none"
    again = build_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"))))
    assert again.algo.policy_loss == cfg.algo.policy_loss and again.chunker == cfg.chunker
    with pytest.raises(ConfigError, match="did you mean 'tau_neg'"):
        build_config({}, ["algo.policy_loss={name: sapo, tau_ng: 2}"])


def test_a_config_written_before_the_strategy_sections_still_loads():
    """A run folder's config.yaml of the earlier layout lists every loss knob flat in ``algo`` and every filter's
    keys in ``group_filter``: at their defaults they are dropped (nothing changes), a knob of the chosen loss
    moves into its section with a FutureWarning, a moved knob of another loss is refused as before."""
    old = {"algo": {"policy_loss": "clipped", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05, "dual_clip_c": 3.0,
                    "group_filter": {"name": "none", "keep": None, "metric": "total", "select": "top",
                                     "pass_threshold": None, "min_pass_rate": 0.0, "max_pass_rate": 1.0}}}
    cfg = build_config(old)
    assert cfg.algo.policy_loss.name == "clipped" and cfg.algo.group_filter.model_dump() == {"name": "none"}
    with pytest.warns(FutureWarning, match="algo.sapo_tau_pos is now algo.policy_loss.tau_pos"):
        cfg = build_config({"algo": {"policy_loss": "sapo", "sapo_tau_pos": 5000}})
    assert cfg.algo.policy_loss.tau_pos == 5000.0
    with pytest.raises(ConfigError, match="algo.dual_clip_c=5 is read only by algo.policy_loss=dual_clip"):
        build_config({"algo": {"policy_loss": "sapo", "dual_clip_c": 5}})
    with pytest.raises(ConfigError, match="keep=4 is read only by algo.group_filter.name=gfpo"):
        build_config({"algo": {"group_filter": {"name": "none", "keep": 4}}})
