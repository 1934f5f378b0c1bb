"""Specification of the config's sections (flowgrpo.config.schema): the defaults and the batch sizes they derive,
values refused naming the field, batch combinations that cannot split, a section per strategy (a knob of another
strategy refused naming its owner), registered names checked, rewards listed once."""

from __future__ import annotations

import pytest
import yaml

from flowgrpo.config import ConfigError, build_config


def test_defaults_are_valid_and_derive_the_batch_sizes():
    cfg = build_config()
    assert cfg.batch_size == cfg.train.prompts_per_epoch * cfg.train.group_size
    assert cfg.train_batch_size == cfg.train.rollout_batch_size  # train_batch_size defaults to the rollout's
    assert cfg.objective.clip_low == cfg.objective.clip_high == cfg.objective.clip_range
    cfg = build_config({"algo": {"clip_range": 1e-4, "clip_range_high": 3e-4}, "train": {"train_batch_size": 4}})
    assert (cfg.objective.clip_low, cfg.objective.clip_high, cfg.train_batch_size) == (1e-4, 3e-4, 4)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.num_epochs=ten", "train.num_epochs"),
        ("sampling.noise_level=-1", "sampling.noise_level"),
        ("model.dtype=float64", "model.dtype"),
        ("train.group_size=1", "train.group_size"),
        ("objective.timestep_fraction=1.5", "objective.timestep_fraction"),
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


def test_each_chunker_has_its_own_section():
    """A knob of another strategy is an error naming its owner (it used to be silently ignored); a typo gets a
    suggestion; the section's values round-trip through the saved YAML."""
    with pytest.raises(ConfigError, match="objective.chunker.window_size=8 is read only by "
                                          "objective.chunker.name=window, but objective.chunker.name is 'per_step'"):
        build_config({"objective": {"chunker": {"name": "per_step", "window_size": 8}}})
    # switching the default's E-GRPO chunker by name alone leaves its knobs: the error says how sections merge
    with pytest.raises(ConfigError, match=r"replacing the whole section, e.g. the override 'objective.chunker="
                                          r"\{name: entropy_merge, entropy_threshold: 0.9\}'.*a plain name"):
        build_config({"objective": {"chunker": {"name": "entropy_merge", "entropy_threshold": 0.9}}},
                     ["objective.chunker.name=chunk"])
    assert build_config({"chunker": {"name": "entropy_merge", "entropy_threshold": 0.9}},
                        ["objective.chunker={name: chunk}"]).objective.chunker.name == "chunk"
    with pytest.raises(ConfigError, match="did you mean 'min_chunk_size'"):
        build_config({"chunker": {"name": "chunk", "min_chunk_sise": 3}})
    with pytest.raises(ConfigError, match="unknown chunker 'per_stp'.*did you mean 'per_step'"):
        build_config({"chunker": {"name": "per_stp"}})
    with pytest.raises(ConfigError, match="exactly one of chunker.entropy_threshold"):
        build_config({"chunker": {"name": "entropy_merge"}})
    cfg = build_config({"objective": {"chunker": {"name": "window", "window_size": 3}}})
    again = build_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"))))
    assert again.objective.chunker == cfg.objective.chunker


def test_registered_names_are_checked_by_the_schema():
    with pytest.raises(ConfigError, match="sampling.sde_kind: unknown SDE kind 'flow_sd'.*did you mean 'flow_sde'"):
        build_config({}, ["sampling.sde_kind=flow_sd"])
    with pytest.raises(ConfigError, match="advantage.name: unknown advantage estimator 'grp'"):
        build_config({}, ["advantage.name=grp"])


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
    """``objective.policy_loss`` and ``group_filter`` are strategy sections as ``chunker`` is: the plain name of
    the shipped configs still reads, a knob goes in its loss's section, an override may set a knob of a section
    given by its name, and the resolved config round-trips through the saved YAML."""
    import yaml

    from flowgrpo.algo.policy_losses import SapoConfig

    cfg = build_config({"algo": {"policy_loss": "sapo"}}, ["objective.policy_loss.tau_pos=500"])
    assert isinstance(cfg.objective.policy_loss, SapoConfig) and cfg.objective.policy_loss.tau_pos == 500.0
    assert cfg.objective.name == "sde_ratio" and cfg.group_filter.name == "none"
    again = build_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"))))
    assert again.objective.policy_loss == cfg.objective.policy_loss and again.objective.chunker == cfg.objective.chunker
    with pytest.raises(ConfigError, match="did you mean 'tau_neg'"):
        build_config({}, ["objective.policy_loss={name: sapo, tau_ng: 2}"])


@pytest.mark.parametrize(("override", "message"), [
    ("parallel.reshard_after_forward=false", r"parallel.reshard_after_forward=false is read only with "
                                             r"parallel.sharding=fsdp2"),
    ("parallel.reference=cpu_offload", r"parallel.reference=cpu_offload .* needs parallel.sharding=fsdp2"),
])
def test_settings_only_fsdp2_reads_are_refused_without_it(override, message):
    """reshard_after_forward=false was accepted without sharding and did nothing (every other setting a strategy
    does not read is refused)."""
    with pytest.raises(ConfigError, match=message):
        build_config({}, [override])
    sharded = build_config({}, [override, "parallel.sharding=fsdp2"]).parallel
    assert sharded.sharding == "fsdp2" and (not sharded.reshard_after_forward or sharded.reference == "cpu_offload")


def test_an_ema_in_host_memory_needs_an_ema():
    """parallel.ema=cpu without train.ema_decay would place nothing: refused, naming both settings."""
    with pytest.raises(ConfigError, match=r"parallel.ema=cpu places the EMA of train.ema_decay, which is not set"):
        build_config({}, ["parallel.ema=cpu"])
    assert build_config({}, ["parallel.ema=cpu", "train.ema_decay=0.9"]).parallel.ema == "cpu"


def test_the_switch_hint_never_names_the_chosen_strategy():
    """Every strategy kind, every strategy, every key only other strategies have: the refusal's hint (after
    "remove the setting") names a strategy that reads the key, never the one already chosen (it used to suggest
    '{name: <the chosen one>}')."""
    from flowgrpo.config.schema import STRATEGY_SECTIONS
    from flowgrpo.strategies.settings import settings_class, strategy_settings

    checked = 0
    for prefix, (registry, base) in STRATEGY_SECTIONS.items():
        fields = {n: settings_class(registry, n, base).model_fields for n in registry}
        for chosen in registry:
            for key in sorted({k for f in fields.values() for k in f} - set(fields[chosen])):
                owners = [n for n in registry if key in fields[n]]
                with pytest.raises(ValueError) as err:
                    strategy_settings({"name": chosen, key: 1}, prefix=prefix, registry=registry, base=base)
                hint = str(err.value).split("remove the setting", 1)[1]
                assert f"name: {chosen}" not in hint and f"{prefix}: {chosen}'" not in hint, str(err.value)
                assert f"'{prefix}={{name: {owners[0]}, {key}: 1}}'" in hint, str(err.value)
                checked += 1
    assert checked > 50


def test_the_timestep_fraction_is_the_objectives_and_read_by_its_per_step_chunker():
    """objective.timestep_fraction (Flow-GRPO's train.timestep_fraction) is the SDE-ratio objective's knob, read by
    the per_step chunker; moved from its default with a chunker that trains no such fraction it is refused."""
    from flowgrpo.algo.objectives import build_objective

    cfg = build_config({"objective": {"timestep_fraction": 0.5, "chunker": {"name": "per_step"}}},
                       ["sampling.num_steps=6"])
    assert build_objective(cfg).chunker.timestep_fraction == 0.5
    with pytest.raises(ConfigError, match="objective.timestep_fraction=0.5 is read only with "
                                          "objective.chunker.name=per_step, but the chunker is 'window'"):
        build_config({"objective": {"timestep_fraction": 0.5, "chunker": {"name": "window"}}})


def test_the_clip_range_is_one_field_each_objective_defaults_and_sde_ratio_keeps_above_zero():
    """objective.clip_range is declared once (CLIP_RANGE) for sde_ratio, awm and dgpo, each with its release's
    default (Flow-GRPO 1e-4, AWM 1, DGPO 1e-2); sde_ratio's clipped surrogate needs epsilon > 0, DGPO's mask takes 0."""
    assert [build_config({"objective": n}).objective.clip_range for n in ("sde_ratio", "awm", "dgpo")] == [1e-4, 1.0,
                                                                                                        1e-2]
    with pytest.raises(ConfigError, match="objective.clip_range"):
        build_config({"objective": {"clip_range": 0.0}})
    assert build_config({"objective": {"name": "dgpo", "clip_range": 0.0}}).objective.clip_range == 0.0
