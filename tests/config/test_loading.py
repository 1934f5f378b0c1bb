"""Specification of reading a config (flowgrpo.config.loading): YAML files and their ``base``, dotted overrides
parsed as YAML, unknown keys answered with the closest valid key, the saved config loading back equal, the earlier
layouts (``grouper``, flat loss knobs) still read. The sections themselves are specified in test_schema.py,
``--help`` in test_help.py."""

from __future__ import annotations

import pytest
import yaml

from flowgrpo.config import ConfigError, build_config, load_config, parse_override, save_config


@pytest.mark.parametrize(
    ("data", "overrides", "bad", "hint"),
    [
        ({"train": {"grup_size": 4}}, [], "train.grup_size", "train.group_size"),
        ({}, ["samplng.num_steps=4"], "samplng", "sampling"),
        ({}, ["advantage.std_esp=0.1"], "advantage.std_esp", "advantage.std_eps"),
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
    assert "did you mean 'rewards.0.weight'?" in msg, msg  # the item's index kept
    with pytest.raises(ConfigError, match=r"'rewards\.1\.kwrags'; did you mean 'rewards\.1\.kwargs'\?"):
        build_config({"rewards": [{"name": "jpeg_compressibility"}, {"name": "aesthetic", "kwrags": {}}]})


def test_unknown_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  num_epoch: 3\n")
    with pytest.raises(ConfigError, match=r"train\.num_epoch.*did you mean 'train\.num_epochs'"):
        load_config(path)


def test_overrides_parse_yaml_types():
    assert parse_override("train.seed=7") == (["train", "seed"], 7)
    assert parse_override("a.b=0.5") == (["a", "b"], 0.5)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=[2, 3, 4, 7]") == (["a"], [2, 3, 4, 7])
    assert parse_override("a={x: 1}") == (["a"], {"x": 1})
    assert parse_override("a=x=y") == (["a"], "x=y")  # only the first '=' splits
    cfg = build_config({}, ["train.lr=1e-4", "objective.chunker.name=chunk", "objective.chunker.chunk_sizes=[2,3,4,7]",
                            "model.height=null",
                            "advantage.drop_zero_spread_groups=true", "train.seed=3", "logging.trackers=[tensorboard]"])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.objective.chunker.chunk_sizes == [2, 3, 4, 7]
    assert cfg.model.height is None
    assert cfg.advantage.drop_zero_spread_groups is True
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


def test_an_empty_file_is_refused_and_an_empty_mapping_is_the_defaults(tmp_path):
    """An empty file (or one of comments only) once ran the embedded digits job silently."""
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty.yaml' is empty; to run the embedded default give no config file"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "braces.yaml").write_text("{}\n")
    assert load_config(tmp_path / "braces.yaml") == load_config()


def test_a_directory_is_named_as_a_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"is a directory; give the path of a \.yaml file in it"):
        load_config(tmp_path)


@pytest.mark.parametrize("text", ["train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n",
                                  "train:\n  lr: 1.0e-3\ntrain:\n  group_size: 4\n"])
def test_a_key_given_twice_in_a_file_is_refused_with_its_lines(tmp_path, text):
    """PyYAML keeps the last of two equal keys: the first value (or a whole first section) would be lost."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    key, lines = ("'lr'", (3, 2)) if text.count("lr") == 2 else ("'train'", (3, 1))
    with pytest.raises(ConfigError, match=rf"twice.yaml', line {lines[0]}: the key {key} is given twice \(first on "
                                          rf"line {lines[1]}\); give each key once$"):
        load_config(path)


def test_a_key_given_twice_in_an_override_is_refused():
    with pytest.raises(ConfigError,
                       match=r"override 'objective.chunker=\{name: chunk, name: per_step\}': the key 'name' is "
                             "given twice"):
        parse_override("objective.chunker={name: chunk, name: per_step}")
    assert parse_override("objective.chunker={name: chunk}")[1] == {"name": "chunk"}


def test_saved_config_loads_back_equal(tmp_path):
    cfg = build_config({}, ["train.lr=0.003", "objective.chunker.name=chunk", "objective.chunker.chunk_sizes=[4, 6]",
                            "rewards=[{name: jpeg_compressibility, weight: 2.0}]"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["lr"] == 0.003


def test_base_config_is_merged_key_by_key(tmp_path):
    from flowgrpo.config import load_config

    (tmp_path / "parent.yaml").write_text("train: {lr: 0.5, seed: 7}\nsampling: {num_steps: 6}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ntrain: {lr: 0.25}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.train.lr, cfg.train.seed, cfg.sampling.num_steps) == (0.25, 7, 6)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="its own base"):
        load_config(tmp_path / "loop.yaml")


@pytest.mark.parametrize("make", ["missing", "folder"])
def test_a_base_that_is_not_a_file_is_one_error_naming_the_file_that_names_it(tmp_path, make):
    from flowgrpo.config import load_config

    if make == "folder":
        (tmp_path / "parent.yaml").mkdir()
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ntrain: {lr: 0.25}\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "child.yaml")
    msg = str(err.value)
    assert "child.yaml" in msg and "'parent.yaml'" in msg and "\n" not in msg
    assert ("does not exist" if make == "missing" else "is a directory") in msg


def test_old_grouper_section_is_an_alias_that_warns():
    """The strategy section was renamed grouper -> chunker; the old key (file or override) still works, warning."""
    with pytest.warns(FutureWarning, match="'grouper' is now called 'chunker'"):
        cfg = build_config({"grouper": {"name": "chunk"}})
    assert cfg.objective.chunker.name == "chunk"
    with pytest.warns(FutureWarning, match="chunker"):
        cfg = build_config({}, ["grouper.name=window"])
    assert cfg.objective.chunker.name == "window"
    with pytest.raises(ConfigError, match="keep only 'chunker'"), pytest.warns(FutureWarning):
        build_config({"grouper": {"name": "chunk"}, "chunker": {"name": "window"}})


def test_a_config_written_before_the_strategy_sections_still_loads():
    """A run folder's config.yaml of the earlier layout lists every loss knob flat in ``algo`` and every filter's
    keys in ``group_filter``: at their defaults they are dropped (nothing changes), a knob of the chosen loss
    moves into its section with a FutureWarning, a moved knob of another loss is refused as before."""
    old = {"algo": {"policy_loss": "clipped", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05, "dual_clip_c": 3.0,
                    "group_filter": {"name": "none", "keep": None, "metric": "total", "select": "top",
                                     "pass_threshold": None, "min_pass_rate": 0.0, "max_pass_rate": 1.0}}}
    cfg = build_config(old)
    assert cfg.objective.policy_loss.name == "clipped" and cfg.group_filter.model_dump() == {"name": "none"}
    with pytest.warns(FutureWarning, match="algo.sapo_tau_pos moved to objective.policy_loss.tau_pos"):
        cfg = build_config({"algo": {"policy_loss": "sapo", "sapo_tau_pos": 5000}})
    assert cfg.objective.policy_loss.tau_pos == 5000.0
    with pytest.raises(ConfigError, match="algo.dual_clip_c=5 is read only by objective.policy_loss=dual_clip"):
        build_config({"algo": {"policy_loss": "sapo", "dual_clip_c": 5}})
    with pytest.raises(ConfigError, match="keep=4 is read only by group_filter.name=gfpo"):
        build_config({"algo": {"group_filter": {"name": "none", "keep": 4}}})


def test_the_keys_of_the_algo_and_chunker_sections_load_at_their_homes_with_one_line():
    """issue #55: every SDE-ratio knob lives in ``objective:``, the estimator's in ``advantage:``; a config file or
    an override of the earlier layout loads at the new places, one FutureWarning line naming every move."""
    import warnings

    old = {"algo": {"advantage": "rloo", "advantage_clip": 3.0, "drop_zero_spread_groups": True, "kl_beta": 0.3,
                    "clip_range": 2e-4, "clip_range_high": 5e-4, "kl_form": "gaussian",
                    "recompute_old_log_probs": True, "policy_loss": {"name": "dual_clip", "c": 4.0},
                    "min_learning_frac": 0.2, "group_filter": {"name": "gfpo", "keep": 2}},
           "chunker": {"name": "window", "window_size": 2}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = build_config(old)
    lines = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(lines) == 1 and "\n" not in lines[0]
    for moved in ("algo.kl_beta moved to objective.kl_beta", "chunker moved to objective.chunker",
                  "algo.advantage moved to advantage.name", "algo.advantage_clip moved to advantage.clip",
                  "algo.group_filter moved to group_filter"):
        assert moved in lines[0]
    o, a = cfg.objective, cfg.advantage
    assert (o.name, o.kl_beta, o.clip_low, o.clip_high, o.kl_form, o.recompute_old_log_probs) == (
        "sde_ratio", 0.3, 2e-4, 5e-4, "gaussian", True)
    assert (o.policy_loss.name, o.policy_loss.c, o.chunker.name, o.chunker.window_size) == ("dual_clip", 4.0,
                                                                                             "window", 2)
    assert (a.name, a.clip, a.drop_zero_spread_groups, a.min_learning_frac) == ("rloo", 3.0, True, 0.2)
    assert (cfg.group_filter.name, cfg.group_filter.keep) == ("gfpo", 2)
    with pytest.warns(FutureWarning, match="algo.kl_beta moved to objective.kl_beta"):  # an override too
        assert build_config({"objective": {"kl_beta": 0.1}}, ["algo.kl_beta=0.2"]).objective.kl_beta == 0.2
    with pytest.raises(ConfigError, match="config has both algo.kl_beta and its new key objective.kl_beta"):
        build_config({"objective": {"kl_beta": 0.1}, "algo": {"kl_beta": 0.2}})


def test_a_moved_key_of_the_sde_ratio_objective_is_refused_for_another_objective():
    """An old run folder of another objective lists the SDE-ratio knobs at their defaults (dropped: it loads as it
    ran); the same knob moved from its default, or given by an override, is refused in one line."""
    old = {"objective": {"name": "nft", "kl_beta": 0.1}, "algo": {"clip_range": 1e-4, "kl_beta": 0.0,
                                                                 "policy_loss": {"name": "clipped"}},
           "chunker": {"name": "per_step", "timestep_fraction": 1.0}}
    cfg = build_config(old)
    assert cfg.objective.name == "nft" and cfg.objective.kl_beta == 0.1 and not hasattr(cfg.objective, "chunker")
    for data, overrides in (({**old, "algo": {"kl_beta": 0.04}}, []), (old, ["algo.kl_beta=0.0"])):
        with pytest.raises(ConfigError) as err:
            build_config(data, overrides)
        assert str(err.value).startswith("algo.kl_beta=0.") and "\n" not in str(err.value)
        assert "moved to objective.kl_beta, a setting of objective sde_ratio, but objective.name is 'nft'" in str(
            err.value)
    with pytest.raises(ConfigError, match="chunker=.*moved to objective.chunker, a setting of objective sde_ratio"):
        build_config({**old, "chunker": {"name": "window"}})


def _earlier_layout(cfg) -> dict:
    """The resolved config.yaml an earlier version wrote for ``cfg``: the ``algo`` and ``chunker`` sections (the
    fraction a key of the per_step chunker only)."""
    saved = cfg.model_dump(mode="json")
    obj, adv = saved.pop("objective"), saved.pop("advantage")
    fraction = obj.pop("timestep_fraction")
    saved["chunker"] = {**obj.pop("chunker"), **({"timestep_fraction": fraction}
                                                  if cfg.objective.chunker.name == "per_step" else {})}
    saved["algo"] = {**{k: obj.pop(k) for k in ("clip_range", "clip_range_low", "clip_range_high", "kl_beta",
                                                "kl_form", "recompute_old_log_probs", "policy_loss")},
                     "advantage": adv.pop("name"), "advantage_clip": adv.pop("clip"), **adv,
                     "group_filter": saved.pop("group_filter")}
    saved["objective"] = obj
    assert obj == {"name": "sde_ratio"}
    return saved


@pytest.mark.parametrize("chunker", [{"name": "per_step"}, {"name": "trajectory"}])
def test_a_run_folder_of_the_earlier_layout_shows_no_changed_setting(tmp_path, chunker):
    """A resume compares the run's saved config.yaml with the resumed config: an old run folder's keys are read at
    their new places, so nothing shows as changed (flowgrpo.training.run_folder.changed_settings), nor a home the
    old file had no key for (the fraction of a chunker without one)."""
    import yaml

    from flowgrpo.training.run_folder import changed_settings

    fraction = {"timestep_fraction": 0.5} if chunker["name"] == "per_step" else {}
    cfg = build_config({"objective": {"kl_beta": 0.04, "clip_range": 3e-4, "chunker": chunker, **fraction},
                        "advantage": {"std_eps": 0.05}})
    saved = _earlier_layout(cfg)
    assert saved["algo"]["kl_beta"] == 0.04 and ("timestep_fraction" in saved["chunker"]) == bool(fraction)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    assert build_config(saved) == cfg
    assert changed_settings(path, cfg) == {}
    assert changed_settings(path, build_config(saved, ["objective.kl_beta=0.05"])) == {
        "objective.kl_beta": "objective.kl_beta: 0.04 -> 0.05"}


def test_an_override_of_a_key_the_chosen_strategy_does_not_read_is_refused_even_at_its_default():
    # docs/configs.md: such a key "is refused"; only an old saved config file's defaults are dropped
    with pytest.raises(ConfigError, match="algo.sapo_tau_pos=1 is read only by objective.policy_loss=sapo"):
        build_config({}, ["algo.sapo_tau_pos=1"])
    with pytest.raises(ConfigError, match="algo.dual_clip_c=3.0 is read only by objective.policy_loss=dual_clip"):
        build_config({}, ["algo.dual_clip_c=3.0"])
    with pytest.raises(ConfigError, match="read only by group_filter.name="):
        build_config({}, ["group_filter.min_pass_rate=0.0"])
    assert build_config({"algo": {"sapo_tau_pos": 1.0}}).objective.policy_loss.name == "clipped"  # a file's: dropped
