"""Bad configuration, refused before any model loads with a message naming the key, the value and what is allowed:
values the schema refuses, typos with a suggestion, overrides that are not ``key=value`` YAML, booleans given for
integers or floats, out-of-range seeds, settings of a strategy the run does not use, strategies that cannot plan on
the run's grid, batch layouts that do not split over the processes, a model id that cannot be read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo.config import ConfigError, Section, build_config, parse_override
from tests.tiny_runs import _cfg, _tiny_overrides

REPO = Path(__file__).resolve().parents[2]


# -------------------------------------------------------------------------------------------------- values and keys


@pytest.mark.parametrize("overrides, needle", [
    (["model.max_sequence_length=0"], "'model.max_sequence_length': Input should be greater than or equal to 1"),
    (["model.max_sequence_length=-5"], "greater than or equal to 1"),
    (["model.height=0"], "'model.height': Input should be greater than or equal to 1"),
    (["train.learning_rate=1e-4"], "unknown config key 'train.learning_rate'; did you mean 'train.lr'?"),
    (["train.epochs=3"], "did you mean 'train.num_epochs'?"),
    (["train.kl_beta=0.1"], "did you mean 'objective.kl_beta'?"),
    (["sampling.eta=0.3"], "did you mean 'sampling.noise_level'?"),
    (["sampling.guidance_scale=.nan"], "finite number"),
    (["rewards=[{name: jpeg_compressibility, weight: 0}]"], "every reward in rewards has weight 0"),
])
def test_bad_values_are_refused_by_the_schema(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        build_config({}, overrides)


@pytest.mark.parametrize("overrides, needle", [
    (["rewards=[{name: jpeg_compressibility, kwargs: {qualty: 80}}]"],
     "reward 'jpeg_compressibility' has no keyword argument 'qualty'.*did you mean 'quality'"),
    (["rewards=[{name: jpeg_compresibility}]"], "unknown reward 'jpeg_compresibility'.*did you mean"),
    (["data.train_prompts=/nonexistent/prompts.txt"], "data.train_prompts: prompt file '/nonexistent/prompts.txt'"),
    (["data.eval_prompts=/nonexistent/eval.txt"], "data.eval_prompts: prompt file"),
    (["sampling.noise_level=0"], "noise_level=0.0 leaves no stochastic transition"),
    (["sampling.sde_kind=ode"], "sde_kind='ode' with sampling.noise_level=0.7 leaves no stochastic"),
    (["sampling.sde_kind=cps", "sampling.noise_level=0"], "leaves no stochastic transition"),
    (["train.resume_from=/nonexistent/checkpoints"], "checkpoint '/nonexistent/checkpoints' does not exist"),
    (["logging.trackers=[wandb]"], r"logging.trackers=\['wandb'\]: \['wandb'\] not installed"),
])
def test_everything_is_checked_before_any_model_loads(tmp_path, tiny_flux_dir, monkeypatch, overrides, needle):
    import flowgrpo.models as models
    from flowgrpo.runner import run

    if "wandb" in " ".join(overrides) and __import__("importlib").util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    cfg = _cfg(tmp_path, tiny_flux_dir, overrides=overrides)
    with pytest.raises(Exception, match=needle) as info:
        run(cfg)
    assert not isinstance(info.value, AssertionError)


def test_an_override_that_is_not_yaml_names_itself_and_suggests_quoting():
    with pytest.raises(ConfigError, match=r"override 'rewards=\[\{name:': the value is not valid YAML.*quote"):
        parse_override("rewards=[{name:")


def test_an_override_without_a_value_says_how_overrides_are_written(tmp_path, monkeypatch, capsys):
    """``flowgrpo train train.num_epochs`` (no ``=``) was read as a config file that does not exist, no hint."""
    from flowgrpo.train import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train.num_epochs"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "error: config file 'train.num_epochs' does not exist; a config file ends in .yaml, and an override is "
        "dotted.key=value (e.g. train.num_epochs=20)")


def test_an_output_dir_override_ending_in_yaml_is_an_override_not_a_config(tmp_path, tiny_flux_dir, capsys):
    """Before: ``output_dir=runs/x.yaml`` as the first argument was read as a config file named
    'output_dir=runs/x.yaml' that does not exist."""
    from flowgrpo.train import main

    with pytest.raises(SystemExit) as info:  # help shows the value this command would use, without a run
        main([f"output_dir={tmp_path / 'run.yaml'}", *_tiny_overrides(tmp_path, tiny_flux_dir), "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and f"[{tmp_path / 'run.yaml'}]" in out


def test_unreachable_model_fails_at_once_naming_it():
    """No local folder, not cached: offline it fails without touching the network; with an unreachable hub (a
    closed port on loopback stands in for it) after one connection attempt, not after the hub client's retries."""
    code = ("import logging\nlogging.basicConfig(level=logging.WARNING)\n"
            "from flowgrpo.models import load_model\n"
            "try:\n    load_model('black-forest-labs/FLUX.1-dev')\n"
            "except ValueError as e:\n    print('ERR', e)\n")
    for offline, why in (("1", "HF_HUB_OFFLINE is set"), ("0", "cannot be reached from this machine")):
        env = {**os.environ, "HF_HUB_OFFLINE": offline, "HF_ENDPOINT": "http://127.0.0.1:9",
               "HF_HUB_CACHE": "/nonexistent-flowgrpo-test-cache"}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert "ERR cannot read model 'black-forest-labs/FLUX.1-dev'" in proc.stdout, proc.stderr[-2000:]
        assert why in proc.stdout and "hf download black-forest-labs/FLUX.1-dev" in proc.stdout
        assert "Retrying" not in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------- booleans are not integers


@pytest.mark.parametrize("key", ["data.eval_num_prompts", "logging.eval_every", "logging.plot_every",
                                 "train.num_epochs", "train.train_batch_size", "advantage.std_ddof",
                                 "train.warmup_steps", "model.height"])
@pytest.mark.parametrize("value", ["true", "false"])
def test_a_boolean_for_an_integer_key_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"config field '{key}': an integer is needed, got a boolean"):
        build_config({}, [f"{key}={value}"])


def test_a_boolean_in_a_strategy_integer_or_integer_list_is_refused():
    with pytest.raises(ConfigError, match=r"'group_filter.keep': an integer is needed, got a boolean"):
        build_config({}, ["group_filter={name: gfpo, keep: true}"])
    with pytest.raises(ConfigError, match=r"'objective.chunker.min_chunk_size': an integer is needed, got a boolean"):
        build_config({}, ["objective.chunker={name: chunk, min_chunk_size: true}"])
    with pytest.raises(ConfigError, match=r"'objective.chunker.chunk_sizes': an integer is needed, got a boolean"):
        build_config({}, ["objective.chunker={name: chunk, chunk_sizes: [true, 2]}"])


def _every_section() -> set:
    """Every section of the schema and every registered strategy's settings model, found from the schema and the
    registries, so a new field cannot slip through."""
    from flowgrpo.algo.chunkers import CHUNKERS, ChunkerConfig
    from flowgrpo.algo.filters import GROUP_FILTERS, GroupFilterConfig
    from flowgrpo.algo.objectives import OBJECTIVES, ObjectiveConfig
    from flowgrpo.algo.policy_losses import POLICY_LOSSES, PolicyLossConfig
    from flowgrpo.config import Config
    from flowgrpo.strategies.settings import settings_class

    def sections(model, seen):
        if model in seen:
            return
        seen.add(model)
        for f in model.model_fields.values():
            for ann in (f.annotation, *getattr(f.annotation, "__args__", ())):
                if isinstance(ann, type) and issubclass(ann, Section):
                    sections(ann, seen)

    found: set = set()
    sections(Config, found)
    for registry, base in ((CHUNKERS, ChunkerConfig), (GROUP_FILTERS, GroupFilterConfig),
                           (POLICY_LOSSES, PolicyLossConfig), (OBJECTIVES, ObjectiveConfig)):
        for name in registry:
            sections(settings_class(registry, name, base), found)
    return found


def test_every_integer_field_refuses_a_boolean_and_takes_an_integer():
    from flowgrpo.strategies.settings import _takes_int

    checked = 0
    for model in _every_section():
        for name, f in model.model_fields.items():
            if _takes_int(f.annotation):
                with pytest.raises(Exception, match="an integer is needed, got a boolean"):
                    model.model_validate({name: True})
                checked += 1
    assert checked >= 20


def test_integers_none_and_the_old_refusals_are_unchanged():
    c = build_config({"train": {"num_epochs": 3}}, ["data.eval_num_prompts=20", "logging.plot_every=0",
                                                   "train.train_batch_size=null", "model.gradient_checkpointing=true"])
    assert (c.train.num_epochs, c.data.eval_num_prompts, c.logging.plot_every) == (3, 20, 0)
    assert c.train.train_batch_size is None and c.model.gradient_checkpointing is True
    with pytest.raises(ConfigError, match="fractional part"):
        build_config({}, ["train.num_epochs=1.5"])
    with pytest.raises(ConfigError, match="unable to parse string as an integer"):
        build_config({}, ["train.num_epochs=abc"])


@pytest.mark.parametrize("override", ["train.lr=true", "train.ema_decay=false", "objective.kl_beta=true",
                                      "train.adam_betas=[true, 0.999]", "model.scheduler_shift=true"])
def test_a_boolean_for_a_float_key_is_refused_naming_the_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"config field '{key}': a number is needed, got a boolean"):
        build_config({}, [override])


def test_every_float_field_refuses_a_boolean_and_takes_a_number():
    """Every float field of every section and strategy (a boolean once ran as 1.0: train.lr=true)."""
    from flowgrpo.strategies.settings import _takes_float

    checked = 0
    for model in _every_section():
        for name, f in model.model_fields.items():
            if _takes_float(f.annotation):
                with pytest.raises(Exception, match="a number is needed, got a boolean"):
                    model.model_validate({name: True})
                checked += 1
    assert checked >= 20
    assert build_config({}, ["train.lr=1", "train.adam_betas=[0, 0.9]"]).train.lr == 1.0


@pytest.mark.parametrize("override", ["advantage.drop_zero_spread_groups=1.0", "sampling.same_noise_in_group=0.0",
                                      "model.gradient_checkpointing=1", "advantage.drop_zero_spread_groups=0",
                                      "advantage.drop_zero_spread_groups='true'"])
def test_a_number_or_string_for_a_boolean_key_is_refused_naming_the_key(override):
    """A boolean takes only true or false (pydantic's lax mode once read 1.0 as true, silently)."""
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"config field '{key}': true or false is needed"):
        build_config({}, [override])


def test_every_boolean_field_refuses_a_number_and_takes_true_and_false():
    from flowgrpo.strategies.settings import _takes_only_bool

    checked = 0
    for model in _every_section():
        for name, f in model.model_fields.items():
            if _takes_only_bool(f.annotation):
                for bad in (1, 0.0, "on"):
                    with pytest.raises(Exception, match="true or false is needed"):
                        model.model_validate({name: bad})
                checked += 1
    assert checked >= 10
    c = build_config({}, ["advantage.drop_zero_spread_groups=false", "model.gradient_checkpointing=true"])
    assert c.advantage.drop_zero_spread_groups is False and c.model.gradient_checkpointing is True


# ------------------------------------------------------------------------------------------ seeds numpy cannot take


@pytest.mark.parametrize("seed", [-1, 2**32, 2**33])
def test_an_out_of_range_seed_is_refused_naming_train_seed(seed):
    with pytest.raises(ConfigError, match=rf"train.seed={seed} is out of range: .*0\.\.2\*\*32-1"):
        build_config({}, [f"train.seed={seed}"])


def test_the_seed_range_ends_are_accepted():
    assert build_config({}, ["train.seed=0"]).train.seed == 0
    assert build_config({}, [f"train.seed={2**32 - 1}"]).train.seed == 2**32 - 1


# ------------------------------------------------------------------------------------------------------- strategies


@pytest.mark.parametrize("overrides, needle", [
    (["sampling.sde_kind=fow_sde"], "unknown SDE kind 'fow_sde'"),
    (["advantage.name=grpoo"], "unknown advantage estimator 'grpoo'"),
    (["objective.chunker.name=chunk", "objective.chunker.chunk_sizes=[2,3]"], "must be positive and sum to the 8"),
    (["objective.chunker.name=window", "objective.chunker.window_size=20"], "exceeds sampling.num_steps=8"),
    (["objective.chunker.name=entropy_merge", "objective.chunker.entropy_threshold=0.9", "sampling.sde_kind=cps"],
     "cannot use"),
])
def test_strategy_errors_come_before_any_model_loads(overrides, needle):
    from flowgrpo.preflight import check_strategies

    with pytest.raises((KeyError, ValueError), match=needle):
        check_strategies(build_config({"sampling": {"num_steps": 8}}, overrides))


@pytest.mark.parametrize("overrides, needle", [
    (["group_filter.keep=4"], "group_filter.keep=4 is read only by group_filter.name=gfpo, but "
                                   "group_filter.name is 'none'"),
    (["group_filter.select=bottom"], "group_filter.select='bottom' is read only by"),
    (["objective.policy_loss.tau_pos=5000"],
     "objective.policy_loss.tau_pos=5000 is read only by objective.policy_loss.name=sapo, "
                                        "but objective.policy_loss.name is 'clipped'"),
    (["objective.policy_loss={name: sapo, c: 5}"],
     "objective.policy_loss.c=5 is read only by objective.policy_loss.name=dual_clip, "
                                              "but objective.policy_loss.name is 'sapo'"),
    (["algo.sapo_tau_pos=5000"], "algo.sapo_tau_pos=5000 is read only by objective.policy_loss=sapo, but "
                                 "objective.policy_loss is 'clipped'"),  # the key of earlier versions
    (["advantage.name=rloo", "advantage.global_std=true"],
     "advantage.global_std=True is read only by advantage.name=grpo, "
                                                       "but advantage.name is 'rloo'"),
])
def test_a_setting_the_chosen_strategy_does_not_read_is_refused(tmp_path, monkeypatch, capsys, overrides, needle):
    """Before: ``group_filter.keep=4`` without a filter started an 80-epoch run that never filtered."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    with pytest.raises(SystemExit) as info:
        main([*overrides, f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and needle in err.strip().splitlines()[-1]


@pytest.mark.parametrize("overrides, why", [
    (["objective.chunker={name: per_step, drop_last_step: true}"],
     "objective.chunker.drop_last_step=true leaves it out"),
    (["objective.chunker={name: per_step}", "sampling.sde_kind=cps"], "sde_kind 'cps' makes it deterministic"),
    (["objective.chunker={name: chunk, drop_last_step: true}"], "objective.chunker.drop_last_step=true leaves it out"),
    (["objective.chunker={name: trajectory, drop_last_step: true}"],
     "objective.chunker.drop_last_step=true leaves it out"),
])
def test_one_step_whose_only_transition_is_never_trained_is_refused_before_loading(tmp_path, monkeypatch, capsys,
                                                                                  overrides, why):
    """Before: ``sampling.num_steps=1 chunker.drop_last_step=true`` loaded the model, evaluated, sampled, then
    died in the plan with a traceback blaming sde_kind and noise_level."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    with pytest.raises(SystemExit) as info:
        main(["sampling.num_steps=1", *overrides, f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error: sampling.num_steps=1 leaves no transition to train: the last "
                                            f"transition is never trained ({why}); use sampling.num_steps >= 2")


@pytest.mark.parametrize("level", ["1.5", "3"])
def test_a_cps_noise_level_above_one_is_refused_before_loading(tmp_path, monkeypatch, capsys, level):
    """Before: cps with a = 1.5 trained silently with the std of a = 0.5 (sin(a·π/2) folds back above 1)."""
    import flowgrpo.models as models
    from flowgrpo.train import main

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "load_model_from_config", no_model)
    with pytest.raises(SystemExit) as info:
        main(["objective.chunker={name: per_step}", "sampling.sde_kind=cps", f"sampling.noise_level={level}",
              f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"error: sampling.noise_level={float(level)} is outside [0, 1], the range of sde_kind 'cps'")


def test_an_entropy_threshold_no_jump_reaches_is_one_line_before_any_evaluation(tmp_path, tiny_flux_dir, capsys,
                                                                                  monkeypatch):
    """Before: E-GRPO's entropy rule ran first in the first rollout, after the model load and the 'before'
    evaluation, and died there with a traceback (DanceGRPO's SDE at eta 0.7 never reaches tau 0.9 per dim)."""
    from flowgrpo.train import main
    from flowgrpo.training.loop import Trainer

    def no_training(self):
        raise AssertionError("the run started although its chunker cannot plan on the model's grid")

    monkeypatch.setattr(Trainer, "fit", no_training)
    overrides = [o for o in _tiny_overrides(tmp_path, tiny_flux_dir) if not o.startswith("objective.chunker=")]
    with pytest.raises(SystemExit) as info:
        main([*overrides, "sampling.num_steps=8", "objective.chunker={name: entropy_merge, entropy_threshold: 0.9}",
              "sampling.sde_kind=dance_sde", "sampling.noise_level=0.7", "train.num_epochs=1",
              f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: no jump within the first 4 steps reaches "
                                                   "entropy_threshold=0.9")


# -------------------------------------------------------------------------------------- batch layout over processes


def test_batch_layout_is_checked_per_process(tmp_path, tiny_flux_dir, monkeypatch):
    from flowgrpo.runner import run

    monkeypatch.setenv("WORLD_SIZE", "2")
    # B = 4: 2 trajectories a process, one micro-batch of 2, but 2 optimizer steps asked for
    cfg = _cfg(tmp_path, tiny_flux_dir, overrides=["train.optimizer_steps_per_epoch=2", "train.rollout_batch_size=2",
                                                   "train.prompts_per_epoch=2"])
    with pytest.raises(ValueError, match="optimizer_steps_per_epoch=2 exceeds the 1 training micro-batches of the "
                                         "2 trajectories each of the 2 processes"):
        run(cfg)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("digits*.yaml")) + [REPO / "configs/tiny_jpeg.yaml"])
def test_shipped_cpu_configs_split_over_two_processes(path):
    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.config import load_config
    from flowgrpo.preflight import check_batch

    config = load_config(path)  # the README's `torchrun --nproc_per_node 2` command; DPO's counted in pairs
    check_batch(config, 2, objective=build_objective(config))


@pytest.mark.parametrize("common", ["grpo", "flow_grpo", "flowgrpo"])
def test_the_common_names_of_grpo_select_the_sde_ratio_objective(common):
    """``objective=grpo`` once answered "did you mean 'dgpo'?" (issue 54): GRPO is the ``sde_ratio`` objective, and
    its common names are aliases of it in the objective registry, as a plain name and as a section's name."""
    from flowgrpo.config import build_config

    assert build_config(overrides=[f"objective={common}"]).objective.name == "sde_ratio"
    assert build_config(overrides=[f"objective={{name: {common}}}"]).objective.name == "sde_ratio"
