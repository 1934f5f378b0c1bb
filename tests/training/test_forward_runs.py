"""The forward-process objectives (nft, awm, dgpo) end to end: each trains the tiny FLUX and the tiny SD3.5 through
the training command's library entry (``flowgrpo.runner.run``); a run saved after its first epoch, killed and
resumed, ends bit for bit where the uninterrupted run does (the old copy is in the checkpoint); the solver rollout
is the ODE rollout; their settings and the SDE-ratio family's refuse each other in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.config import ConfigError, build_config
from flowgrpo.writing.metrics import read_metrics
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here
from tests.training.objective_runs import assert_resume_equals_whole, tiny_config

SMALL = {"nft": {}, "awm": {"train_timesteps": 2}, "dgpo": {"trunc_steps": 2, "num_train_timesteps": 2}}


def _config(tmp_path, model_dir, name: str, out: str = "run", **sections):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue ball\n")
    return tiny_config(tmp_path / out, model_dir, {"name": name, **SMALL[name]}, prompts, sections)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "sd3"])
@pytest.mark.parametrize("name", ["nft", "awm", "dgpo"])
def test_each_objective_trains_an_epoch_through_the_command(tmp_path, tiny_flux_dir, tiny_sd3_dir, name, model):
    from flowgrpo.runner import run

    folder = tiny_flux_dir if model == "flux" else tiny_sd3_dir
    summary = run(_config(tmp_path, folder, name))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    t = summary and rec  # both written
    assert t["objective/rows"] > 0 and t["policy/grad_norm"] > 0 and "timing/recompute" not in t
    # the rollout: T = 3 calls for each of 2 micro-batches of 2, SD3's CFG (guidance 3 > 1) doubling the rows;
    # the update: K = 2 forwards of each micro-batch, each with two no-gradient passes (NFT: old copy and reference;
    # AWM: reference and old copy; DGPO: reference and the old copy it clips against), at training guidance 1:
    # no CFG on either model
    assert (rec["rollout/transformer_calls"], rec["rollout/transformer_rows"]) == (6, 12 * (2 if model == "sd3"
                                                                                             else 1))
    assert (rec["update/transformer_calls"], rec["update/transformer_rows"]) == (12, 24)
    assert 0 < rec["rollout/x0_norm"] <= rec["rollout/x0_norm_max"]  # every objective's rollout logs its x0 norm
    ckpt = tmp_path / "run" / "checkpoints" / "epoch_0"
    old, weights = load_file(ckpt / "objective.safetensors"), load_file(ckpt / "trainable.safetensors")
    assert len(old) == len(weights) > 0
    moved = [k for k, v in weights.items() if "lora_B" in k and v.abs().max() > 0]
    assert moved  # LoRA B starts at 0: the update moved it
    assert "jpeg_incompressibility_mean_after" in summary


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nft"])
def test_save_kill_resume_equals_the_uninterrupted_run(tmp_path, tiny_flux_dir, name):
    """Two epochs in one go against one epoch, saved, and a second process resuming it: the same weights,
    optimizer state and old copy, to the bit (DiffusionNFT: the old copy both rolls out and moves)."""
    assert_resume_equals_whole(tmp_path, lambda out, **s: _config(tmp_path, tiny_flux_dir, name, out, **s),
                               files=("trainable.safetensors", "objective.safetensors"), moved="objective.safetensors",
                               figures=("objective/loss", "reward/total/mean"))


def test_a_checkpoint_without_the_old_copy_is_refused(tmp_path, tiny_flux_dir):
    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.checkpoints.save_load import CheckpointError, _load_objective

    class Optim:
        params = [torch.nn.Parameter(torch.ones(2))]
        model = None

    obj = build_objective(_config(tmp_path, tiny_flux_dir, "nft"))
    obj.prepare(Optim())
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointError, match="no objective state.*objective 'nft' keeps some"):
        _load_objective(tmp_path / "ckpt", obj)


def test_the_euler_solver_rollout_is_the_ode_rollout(tiny_flux):
    """The solver loop with ``euler`` is the SDE sampler with every transition deterministic (one velocity
    function, one grid, the same initial noise): the same final latents to the bit, and the same images."""
    from flowgrpo.config import SamplingConfig
    from flowgrpo.sampling.final_rollout import solver_rollout
    from flowgrpo.sampling.rollout import RolloutRequest, rollout

    settings = SamplingConfig(num_steps=4, guidance_scale=3.5, sde_kind="ode")
    request = RolloutRequest(prompts=["a red cube", "a blue ball"], metadata=[{}, {}],
                             prompt_ids=torch.tensor([3, 4]), sample_index=torch.tensor([0, 1]), settings=settings,
                             batch_size=2, seed=1, epoch=2)
    traj = rollout(tiny_flux, request, torch.zeros(4, dtype=torch.bool))
    final = solver_rollout(tiny_flux, request, solver="euler", sigmas=tiny_flux.sigmas(4))
    assert torch.equal(final.x0, traj.latents[:, -1]) and torch.equal(final.initial_noise, traj.latents[:, 0])
    assert torch.equal(final.images, traj.images)
    dpm = solver_rollout(tiny_flux, request, solver="dpmpp_2m", sigmas=tiny_flux.sigmas(4))
    assert not torch.equal(dpm.x0, final.x0)  # a second-order solver is another path to x0


@pytest.mark.parametrize(("section", "value", "owner"), [
    ({"sampling": {"sde_kind": "cps"}}, "sampling.sde_kind='cps'", "objective.solver"),
    ({"sampling": {"noise_level": 0.9}}, "sampling.noise_level=0.9", "objective.solver_noise_level"),
    ({"objective": {"kl_form": "gaussian"}}, "objective.kl_form='gaussian'", "sde_ratio"),
    ({"objective": {"chunker": "chunk"}}, "objective.chunker='chunk'", "sde_ratio"),
    ({"objective": {"policy_loss": "sapo"}}, "objective.policy_loss='sapo'", "sde_ratio"),
])
@pytest.mark.parametrize("name", ["nft", "awm", "dgpo"])
def test_sde_ratio_settings_are_refused_with_a_forward_objective(name, section, value, owner):
    """The rollout settings only the SDE-ratio objective reads, and its own settings in a forward objective's
    section (another objective's keys), are refused in one line naming sde_ratio."""
    section = {k: {"name": name, **v} if k == "objective" else v for k, v in section.items()}
    with pytest.raises(ConfigError) as err:
        build_config({"objective": name, "train": {"group_size": 4, "rollout_batch_size": 8}, **section})
    (line,) = str(err.value).splitlines()
    assert line.startswith(value) and "read only by objective.name=sde_ratio" in line
    assert f"objective.name is {name!r}" in line and owner in line


@pytest.mark.parametrize(("key", "value"), [("solver", "euler"), ("beta", 0.5), ("beta_dpo", 10.0),
                                            ("train_timesteps", 3), ("train_guidance_scale", 1.0)])
def test_forward_settings_are_refused_with_sde_ratio(key, value):
    with pytest.raises(ConfigError) as err:
        build_config({"objective": {"name": "sde_ratio", key: value}})
    (line,) = str(err.value).splitlines()
    assert line.startswith(f"objective.{key}=") and "is read only by objective.name=" in line
    assert "but objective.name is 'sde_ratio'" in line


def test_dgpo_micro_batches_hold_whole_groups():
    from flowgrpo.algo.objectives import build_objective

    cfg = build_config({"objective": "dgpo", "train": {"group_size": 4, "rollout_batch_size": 8,
                                                        "train_batch_size": 2}})
    with pytest.raises(ValueError, match=r"^objective dgpo .*train.train_batch_size=2 must be a multiple of "
                                         r"train.group_size=4$"):
        build_objective(cfg).validate()
    build_objective(build_config({"objective": "dgpo", "train": {"group_size": 4, "rollout_batch_size": 8,
                                                                  "train_batch_size": 8}})).validate()


def test_the_old_copy_schedule_of_each_release():
    """The decays the releases apply, k = the optimizer-step count handed to the schedule."""
    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.algo.objectives.old_copy import decay_at

    for name, cap, ks in (("nft", 0.5, (0, 1, 400, 600)), ("awm", 0.3, (0, 1, 200, 400)),
                          ("dgpo", 0.3, (0, 1, 200, 400))):
        o = build_objective(build_config({"objective": name, "train": {"group_size": 4, "rollout_batch_size": 8}}))
        got = [decay_at(k, o.o) for k in ks]
        assert got == pytest.approx([0.0, 0.001, min(ks[2] * 0.001, cap), cap]), name
