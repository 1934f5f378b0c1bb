"""What each objective declares, and what the loop and the config checks make of it: the low-signal warning
(``advantage.min_learning_frac``, metric ``adv/low_signal``) only for an objective that trains on the group
advantages."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.algo.objectives import OBJECTIVES
from flowgrpo.records import Advantages
from flowgrpo.training.loop import Trainer

#: written here from each objective's loss, not read from the code: whose update the advantages drive
ON_ADVANTAGES = {"sde_ratio", "nft", "awm", "dgpo", "dpo"}  # dpo: pairs chosen by the advantages
NOT_ON_ADVANTAGES = {"sft", "dpo_offline", "refl", "srpo", "opd"}  # a dataset, the reward's gradient, a teacher


def test_every_builtin_objective_declares_whether_it_trains_on_advantages():
    builtins = [n for n in OBJECTIVES if n in ON_ADVANTAGES | NOT_ON_ADVANTAGES]
    assert set(builtins) == ON_ADVANTAGES | NOT_ON_ADVANTAGES  # a new built-in is sorted into one of the two
    for name in builtins:
        assert OBJECTIVES.get(name).trains_on_advantages is (name in ON_ADVANTAGES), name


class _Metrics:
    def __init__(self) -> None:
        self.logged: dict = {}

    def log(self, values: dict) -> None:
        self.logged.update(values)


@pytest.mark.parametrize("name", sorted(ON_ADVANTAGES | NOT_ON_ADVANTAGES))
def test_low_signal_is_warned_and_logged_only_for_objectives_on_advantages(name, caplog):
    """Every group of equal rewards (sft draws each record G times): learning_frac 0 < min_learning_frac 0.1."""
    adv = Advantages(values=torch.zeros(8), train_mask=torch.ones(8, dtype=torch.bool), zero_spread_frac=1.0,
                     nan_frac=0.0, learning_frac=0.0)
    trainer = SimpleNamespace(_on_advantages=OBJECTIVES.get(name).trains_on_advantages, metrics=_Metrics(),
                              main=True, _low_signal_warned=False,
                              cfg=SimpleNamespace(advantage=SimpleNamespace(min_learning_frac=0.1)))
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        for epoch in range(3):
            Trainer._warn_low_signal(trainer, epoch, adv)
    warned = [r for r in caplog.records if "carry a learning signal" in r.getMessage()]
    if name in ON_ADVANTAGES:
        assert trainer.metrics.logged == {"adv/low_signal": 1.0} and len(warned) == 1
    else:
        assert trainer.metrics.logged == {} and warned == []


@pytest.mark.parametrize("case", ["solved", "failed", "constant"])
def test_low_signal_says_solved_when_the_equal_groups_sit_at_the_highest_reward(case, caplog):
    """Groups of 4: two equal groups and one that varies. At the epoch's highest reward (a capped reward's solved
    prompts) the warning says so and gives no advice to densify the reward; equal groups at a low reward, or one
    constant reward everywhere (nothing solved), keep the advice."""
    from flowgrpo.algo.advantages import solved_group_frac

    total = {"solved": [0.8] * 8 + [0.2, 0.8, 0.5, 0.8], "failed": [0.1] * 8 + [0.2, 0.8, 0.5, 0.8],
             "constant": [0.8] * 12}[case]
    total, ids = torch.tensor(total), torch.arange(3).repeat_interleave(4)
    assert solved_group_frac(total, ids) == {"solved": 1.0, "failed": 0.0, "constant": None}[case]
    adv = Advantages(values=torch.zeros(12), train_mask=torch.ones(12, dtype=torch.bool), zero_spread_frac=2 / 3,
                     nan_frac=0.0, learning_frac=1 / 3)
    trainer = SimpleNamespace(_on_advantages=True, metrics=_Metrics(), main=True, _low_signal_warned=False,
                              cfg=SimpleNamespace(advantage=SimpleNamespace(min_learning_frac=0.5)))
    with caplog.at_level(logging.WARNING, logger="flowgrpo.training"):
        Trainer._warn_low_signal(trainer, 66, adv, total, ids)
    (msg,) = [r.getMessage() for r in caplog.records if "carry a learning signal" in r.getMessage()]
    assert msg.startswith("epoch 67: only 33.3% of the samples carry a learning signal (66.7% of the groups")
    if case == "solved":
        assert "100% of those at the epoch's highest reward" in msg and "are solved" in msg
        assert "denser reward" not in msg and "advantage.min_learning_frac" in msg
    else:
        assert "denser reward" in msg and "solved" not in msg


# ------------------------------------------------------------------------------------------ the refusals, gathered
from flowgrpo.config import ConfigError, build_config  # noqa: E402

#: a valid value other than the default for every setting of the shared sections only sde_ratio reads (written
#: here, not derived); its own settings are in its section (objective: {name: sde_ratio, ...})
SDE_RATIO_MOVED = {"sampling": {"sde_kind": "cps", "noise_level": 0.5, "logprob_reduction": "sum",
                                "cps_simplified_logprob": True, "sigma_one_guard": "next", "final_decode": "x0_pred"}}
#: a valid value other than the default for every objective.* setting a refusal may name as the fix
FIX_VALUES = {"solver": "dpmpp_2m", "solver_noise_level": 0.1, "kl_beta": 0.1, "beta_dpo": 50.0, "noise_level": 0.1,
              "reward_scale": 0.5, "refl_margin": 1.5, "teacher": "runs/teacher"}
#: what each objective trains on, as its refusals must say (from each objective's module docstring)
TRAINS_ON = {"nft": "final samples", "awm": "final samples", "dgpo": "final samples", "dpo": "final samples",
             "sft": "dataset's images", "dpo_offline": "dataset's pairs", "refl": "path", "opd": "path"}
#: one group of 2 suits every objective (dpo_offline's pairs); refl's default reward is differentiable
RUN = {"train": {"group_size": 2, "rollout_batch_size": 8}}


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        build_config({**RUN, **data})
    return str(err.value)


@pytest.mark.parametrize("name", sorted(TRAINS_ON))
def test_every_sde_ratio_setting_is_refused_at_once_one_line_each_naming_a_fix_that_is_accepted(name):
    """All of them moved in one config: one error, one line per setting (a user fixes them in one go); each line
    says what the objective trains on, and an objective.* setting it names as what to use instead is one the
    objective takes (the refl refusal named objective.solver_noise_level, and then refused it)."""
    import re

    text = _error({"objective": name, **SDE_RATIO_MOVED})
    lines = [ln.removeprefix("  - ") for ln in text.splitlines()[1:]]
    moved = [f"{sec}.{key}=" for sec, keys in SDE_RATIO_MOVED.items() for key in keys]
    assert text.splitlines()[0].endswith(f"{len(moved)} settings to change, one a line:"), text
    assert sorted(ln.split("=")[0] + "=" for ln in lines) == sorted(moved), text
    for ln in lines:
        assert f"objective.name is {name!r}, which trains on " in ln and TRAINS_ON[name] in ln.split("(")[0], ln
    for key in sorted(set(re.findall(r"objective\.([a-z_]+)", text)) - {"name"}):
        assert key in FIX_VALUES, f"a refusal of {name} names objective.{key}: give it a value in FIX_VALUES"
        build_config({**RUN, "objective": {"name": name, key: FIX_VALUES[key]}})  # the named fix is taken


@pytest.mark.parametrize("name", sorted(TRAINS_ON))
def test_the_sde_ratio_objectives_own_settings_are_not_another_objectives(name):
    """issue #55: its clip range, KL, chunker and policy loss are keys of its own section, so another objective's
    section cannot hold them: one line each naming sde_ratio as their reader (the schema's refusal of another
    strategy's key), with no refusal machinery of their own."""
    own = {"kl_form": "gaussian", "recompute_old_log_probs": True, "chunker": "chunk", "policy_loss": "sapo",
           "clip_range_low": 1e-3}
    text = _error({"objective": {"name": name, **own}})
    for key, value in own.items():
        assert f"objective.{key}={value!r} is read only by objective.name=sde_ratio, but objective.name is " \
               f"{name!r}" in text, text
    assert build_config({**RUN, "objective": name}).objective.name == name  # the plain name: none of them


def test_a_single_problem_stays_one_line():
    text = _error({"objective": "refl", "sampling": {"noise_level": 0.5}})
    (line,) = text.splitlines()
    assert line.startswith("sampling.noise_level=0.5 is read only by objective.name=sde_ratio") and "Euler" in line
    assert "solver_noise_level" not in line


def test_refl_names_every_reward_without_a_gradient_in_one_error():
    text = _error({"objective": {"name": "refl", "variant": "draft_k", "k": 5},
                   "sampling": {"noise_level": 0.5, "num_steps": 4},
                   "rewards": [{"name": "jpeg_compressibility"}, {"name": "digit_correctness"},
                               {"name": "digit_correctness_strict"}]})
    assert text.splitlines()[0].endswith("4 settings to change, one a line:"), text
    assert "objective.k=5 exceeds sampling.num_steps=4" in text  # known before the model loads
    assert "reward 'jpeg_compressibility' declares no" in text and "reward 'digit_correctness_strict' declares" in text
    assert "reward 'digit_correctness' declares" not in text


def test_dpo_offline_gathers_its_own_refusals_with_the_family_s():
    text = _error({"objective": {"name": "dpo_offline", "kl_beta": 0.1}, "train": {"group_size": 4,
                   "rollout_batch_size": 8}, "sampling": {"sde_kind": "cps"}})
    assert text.splitlines()[0].endswith("3 settings to change, one a line:"), text
    assert "objective.kl_beta=0.1 is not read by objective 'dpo_offline'" in text and "objective.beta_dpo" in text
    assert "train.group_size must be 2, got 4" in text and "sampling.sde_kind='cps'" in text


#: the objective.* fields each objective never reads (written here from each objective's rollout and loss)
NEVER_READ = {"sft": {"solver", "solver_noise_level", "grid", "grid_shift", "adv_clip_max", "decay_flat",
                      "decay_ramp", "decay_cap"},
              "dpo_offline": {"solver", "solver_noise_level", "grid", "grid_shift", "adv_clip_max", "decay_flat",
                              "decay_ramp", "decay_cap", "kl_beta"},
              "dpo": {"adv_clip_max", "decay_flat", "decay_ramp", "decay_cap", "kl_beta"}}
MOVED_FIELD = {"solver": "dpmpp_2m", "solver_noise_level": 0.1, "grid": "flow_shift", "grid_shift": 2.0,
               "adv_clip_max": 2.0, "decay_flat": 3, "decay_ramp": 0.01, "decay_cap": 0.3, "kl_beta": 0.1}


@pytest.mark.parametrize("name", sorted(NEVER_READ))
def test_fields_an_objective_never_reads_are_refused_when_moved_all_at_once(name):
    """A field the objective has (a shared settings base) but never reads is not silently ignored."""
    keys = NEVER_READ[name]
    assert set(OBJECTIVES.get(name).Config.unread) == keys
    text = _error({"objective": {"name": name, **{k: MOVED_FIELD[k] for k in keys}}})
    assert text.splitlines()[0].endswith(f"{len(keys)} settings to change, one a line:"), text
    for k in keys:
        assert f"objective.{k}={MOVED_FIELD[k]!r} is not read by objective {name!r}" in text, k


@pytest.mark.parametrize("name", sorted(NOT_ON_ADVANTAGES))
def test_min_learning_frac_is_refused_where_no_advantage_trains(name):
    rewards = {"rewards": [{"name": "hpsv2"}]} if name == "srpo" else {}  # srpo's reward reads the prompt
    text = _error({"objective": name, "advantage": {"min_learning_frac": 0.3}, **rewards})
    assert text.startswith(f"advantage.min_learning_frac=0.3 is read only by objectives that train on the group "
                           f"advantages, but objective {name!r} does not"), text
    build_config({**RUN, "objective": "dpo", "advantage": {"min_learning_frac": 0.3}})


@pytest.mark.parametrize("objective", ["nft", "awm", "dgpo"])
def test_the_command_line_fix_the_refusal_names_builds_a_valid_config(objective):
    """Switching the embedded default to a forward objective by an override replaces its SDE-ratio section whole
    (its settings go with it); a rollout setting only the SDE-ratio objective reads is refused naming it, and the
    refusal's own command-line fix (``key=default``) then builds a config that runs (a fresh-eyes run found "remove
    the setting" only, which an override cannot do)."""
    import re

    import yaml

    from flowgrpo.config import build_config
    from flowgrpo.runner import DEFAULT_CONFIG

    data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    assert build_config(data, [f"objective={objective}"]).objective.name == objective
    with pytest.raises(ValueError) as err:
        build_config(data, [f"objective={objective}", "sampling.noise_level=0.5", "sampling.sde_kind=cps"])
    fixes = re.findall(r"set it back on the command line: (\S+)$", str(err.value), flags=re.M)
    assert len(fixes) == len(str(err.value).splitlines()) - 1 == 2, str(err.value)
    cfg = build_config(data, [f"objective={objective}", "sampling.noise_level=0.5", "sampling.sde_kind=cps", *fixes])
    assert cfg.objective.name == objective
