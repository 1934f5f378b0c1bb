"""The ``runtime:`` section: its Ray settings refused without ``engine: ray``, and the objectives a rollout worker
cannot serve refused in one line naming why, with the config, before any model loads."""

from __future__ import annotations

import pytest

from flowgrpo.algo.objectives import OBJECTIVES
from flowgrpo.config import ConfigError, build_config


def test_defaults_are_the_torchrun_engine():
    r = build_config({}, []).runtime
    assert (r.engine, r.rollout_workers, r.max_staleness, r.sync_every, r.address, r.reward_workers) == \
        ("torchrun", 1, 0, 1, None, 0)


@pytest.mark.parametrize("setting", ["runtime.max_staleness=1", "runtime.rollout_workers=2",
                                     "runtime.sync_every=2", "runtime.address=auto", "runtime.reward_workers=1"])
def test_ray_settings_need_the_ray_engine(setting):
    with pytest.raises(ConfigError, match=f"{setting.split('=')[0]}=.* is read only with runtime.engine=ray"):
        build_config({}, [setting])
    assert build_config({}, ["runtime.engine=ray", setting]).runtime.engine == "ray"


@pytest.mark.parametrize("objective, why", [("sft", "samples no rollout"), ("dpo_offline", "samples no rollout"),
                                            ("refl", "back-propagates the reward")])
def test_objectives_without_own_rollouts_are_refused(objective, why):
    with pytest.raises(ConfigError) as err:
        build_config({}, ["runtime.engine=ray", f"objective={objective}"])
    line = str(err.value)
    assert f"runtime.engine=ray cannot run objective {objective!r}" in line and why in line
    assert "\n" not in line.strip()


@pytest.mark.parametrize("objective", ["nft", "awm", "dgpo", "dpo", "flow_grpo"])
def test_objectives_from_their_own_rollouts_run(objective):
    assert build_config({}, ["runtime.engine=ray", f"objective={objective}"]).runtime.engine == "ray"


def test_every_registered_objective_is_classified():
    """The objectives verified with rollout workers run; every other one is refused with its reason (a new one by
    default, until a Ray run of it is tested to equal the torchrun run)."""
    served = {n for n in OBJECTIVES.names() if OBJECTIVES.get(n).rollout_workers_refusal is None}
    assert served == {"sde_ratio", "nft", "awm", "dgpo", "dpo", "opd", "dmd2", "srpo"}
    assert all(OBJECTIVES.get(n).rollout_workers_refusal for n in set(OBJECTIVES.names()) - served)


def test_without_ray_installed_the_run_is_refused_in_one_line(monkeypatch):
    import sys

    from flowgrpo.runtime.ray_engine import check_installed

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ValueError, match=r"runtime.engine=ray needs Ray .*pip install 'flowgrpo\[ray\]'") as err:
        check_installed()
    assert "\n" not in str(err.value)
