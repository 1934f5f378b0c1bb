"""The preference and supervised objectives (dpo, dpo_offline, sft) end to end: each trains the tiny FLUX and the
tiny SD3.5 through the training command's library entry (``flowgrpo.runner.run``), the dataset objectives from a
dataset in the documented layouts (flowgrpo/data/image_sets.py); a run saved after its first epoch, killed and
resumed ends bit for bit where the uninterrupted run does; their settings are checked in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flowgrpo.config import ConfigError, build_config
from flowgrpo.writing.metrics import read_metrics
from tests.tiny_runs import _one_thread  # noqa: F401 - autouse here
from tests.training.objective_runs import assert_resume_equals_whole, tiny_config

PROMPTS = ("a red cube", "a blue ball")


def write_datasets(root):
    """``root/pairs.jsonl``, a preference set (two pairs a prompt), and ``root/items.jsonl``, an image set (two
    images a prompt), of random 32×32 PNGs under ``root/img``, written by hand in the documented layouts (paths
    relative to the JSONL); returns ``root``."""
    from PIL import Image

    (root / "img").mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
    pairs = [{"prompt": PROMPTS[i % 2], "chosen": f"img/{2 * i}.png", "rejected": f"img/{2 * i + 1}.png"}
             for i in range(4)]
    items = [{"prompt": PROMPTS[i % 2], "target": f"img/{i}.png"} for i in range(4)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (root / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    return root


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The sets of :func:`write_datasets`."""
    return write_datasets(tmp_path_factory.mktemp("prefs_data"))


def _config(tmp_path, model_dir, data, name: str, out: str = "run", **sections):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    train_prompts = {"dpo": prompts, "dpo_offline": data / "pairs.jsonl", "sft": data / "items.jsonl"}[name]
    objective = {"name": name, "num_train_timesteps": 2, **({"beta_dpo": 50.0} if name != "sft" else {})}
    return tiny_config(tmp_path / out, model_dir, objective, train_prompts,
                       {"train": {"train_batch_size": 1}, "data": {"eval_prompts": str(prompts)}}, sections)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "sd3"])
@pytest.mark.parametrize("name", ["dpo", "dpo_offline", "sft"])
def test_each_objective_trains_an_epoch_through_the_command(tmp_path, tiny_flux_dir, tiny_sd3_dir, datasets, name,
                                                           model):
    from flowgrpo.runner import run

    folder = tiny_flux_dir if model == "flux" else tiny_sd3_dir
    summary = run(_config(tmp_path, folder, datasets, name))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert summary and rec["objective/rows"] > 0 and rec["policy/grad_norm"] > 0
    # the dataset objectives sample nothing; online DPO: T = 3 calls for each of 2 micro-batches of 2 (SD3's CFG
    # doubling the rows)
    calls = {"dpo": (6, 12 * (2 if model == "sd3" else 1))}.get(name, (0, 0))
    assert (rec["rollout/transformer_calls"], rec["rollout/transformer_rows"]) == calls
    # the update: 2 pair slots (2 groups) or 4 samples, micro-batches of one, K = 2 sigmas: per pair and sigma one
    # reference and one trained call on the pair's two images (masked slots forwarded too); SFT one trained call per
    # sample and sigma; at training guidance 1 (no CFG)
    assert (rec["update/transformer_calls"], rec["update/transformer_rows"]) == ((8, 8) if name == "sft" else (8, 16))
    assert rec["objective/rows"] == (8 if name == "sft" else 4) or name == "dpo"  # online: the groups that differ
    weights = load_file(tmp_path / "run" / "checkpoints" / "epoch_0" / "trainable.safetensors")
    assert [k for k, v in weights.items() if "lora_B" in k and v.abs().max() > 0]  # the update moved LoRA B
    assert "jpeg_incompressibility_mean_after" in summary
    assert ("adv/low_signal" in rec) == (name == "dpo")  # only online DPO trains on the group advantages


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "dpo_offline", "sft"])
def test_save_kill_resume_equals_the_uninterrupted_run(tmp_path, tiny_flux_dir, datasets, name):
    """Two epochs in one go against one epoch, saved, and a second run resuming it: the same weights and
    optimizer state, to the bit (the pairs, draws and dataset records of epoch 1 come back from the seed and the
    prompt sampler's position)."""
    assert_resume_equals_whole(tmp_path, lambda out, **s: _config(tmp_path, tiny_flux_dir, datasets, name, out, **s),
                               figures=("objective/loss", "reward/total/mean"))


def test_offline_dpo_needs_groups_of_two():
    with pytest.raises(ConfigError, match="train.group_size must be 2, got 4"):
        build_config({"objective": "dpo_offline", "train": {"group_size": 4, "rollout_batch_size": 8}})


@pytest.mark.parametrize("name", ["dpo", "dpo_offline"])
def test_dpo_refuses_a_kl_weight(name):
    with pytest.raises(ConfigError, match=r"objective.kl_beta=0.1 is not read by objective .*objective.beta_dpo"):
        build_config({"objective": {"name": name, "kl_beta": 0.1}, "train": {"group_size": 2,
                                                                              "rollout_batch_size": 4}})


def test_pairs_is_online_only():
    with pytest.raises(ConfigError, match="pairs"):
        build_config({"objective": {"name": "dpo_offline", "pairs": "all"},
                      "train": {"group_size": 2, "rollout_batch_size": 4}})


def test_a_dataset_image_of_another_size_is_refused(tmp_path, tiny_flux_dir, datasets):
    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.config import SamplingConfig
    from flowgrpo.models import load_model
    from flowgrpo.sampling.rollout import RolloutRequest

    cfg = _config(tmp_path, tiny_flux_dir, datasets, "sft")
    adapter = load_model(str(tiny_flux_dir), max_sequence_length=12, height=64, width=64)
    request = RolloutRequest(prompts=[PROMPTS[0]], metadata=[{"target": "img/0.png"}],
                             prompt_ids=torch.tensor([0]), sample_index=torch.tensor([0]),
                             settings=SamplingConfig(num_steps=2, guidance_scale=1.0), batch_size=1, seed=0,
                             epoch=0)
    with pytest.raises(ValueError, match=r"img/0.png' is 32x32 .* the run needs 64x64"):
        build_objective(cfg).rollout(adapter, request)
