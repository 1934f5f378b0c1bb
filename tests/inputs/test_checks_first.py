"""Every check that needs only the config and the files runs before the slow steps (the base model's build or
load, a reward's weights, the "before" evaluation), and every setting is read or refused (issue 54, "Hours lost",
"Settings silently ignored"). Nothing here times anything: the slow step is replaced by one that fails the test
when it is reached, so each test asserts the order of the checks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from flowgrpo.config import ConfigError, load_config
from flowgrpo.rewards.base import MissingWeightsError
from flowgrpo.runner import DEFAULT_CONFIG

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class SlowStepReached(AssertionError):
    """The model load (a base build of minutes, a download) was reached: a check ran too late."""


@pytest.fixture
def no_model_load(monkeypatch):
    """``flowgrpo.runner.run`` with the model load replaced by :class:`SlowStepReached`."""
    import flowgrpo.runner as runner

    def reached(*args, **kwargs):
        raise SlowStepReached("the model load was reached before the check")

    monkeypatch.setattr(runner, "load_model_from_config", reached)
    return runner.run


class NoWeights:
    """A reward whose weights are not on this machine: its ``setup`` raises what the hub rewards raise offline."""

    name = "no_weights"

    def setup(self, device) -> None:
        raise MissingWeightsError("reward 'no_weights': cannot get the weights (offline)", "no_weights", "checkpoint")

    def __call__(self, images, prompts, metadata):  # pragma: no cover - never scored
        raise AssertionError("never scored")


# --- the reward's weights before the base model ---------------------------------------------------------------


def test_missing_reward_weights_stop_the_run_before_the_model_loads(tmp_path, no_model_load):
    config = load_config(DEFAULT_CONFIG, [f"rewards=[{{name: '{__name__}:NoWeights'}}]",
                                          f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(MissingWeightsError, match="reward 'no_weights'"):
        no_model_load(config)


# --- DPO's pairs counted before the model loads ---------------------------------------------------------------


@pytest.mark.parametrize(("config", "what"), [("digits_dpo.yaml", "16 pair slots ('best_worst', G = 8)"),
                                              ("digits_dpo_offline.yaml", "16 dataset pairs")])
def test_more_optimizer_steps_than_pair_micro_batches_is_refused_before_the_model_loads(tmp_path, no_model_load,
                                                                                       config, what):
    # digits_dpo: P 16 prompts x G 8 = 128 samples are 16 best-worst pair slots, one micro-batch of 16 pairs (as
    # samples they would be 8 micro-batches of 16, enough for 2 steps); digits_dpo_offline: 16 pairs of 2 images
    cfg = load_config(REPO_CONFIGS / config, ["train.optimizer_steps_per_epoch=2", f"output_dir={tmp_path / 'r'}"])
    with pytest.raises(ValueError, match="optimizer_steps_per_epoch=2 exceeds the 1 training micro-batches") as info:
        no_model_load(cfg)
    assert what in str(info.value) and "\n" not in str(info.value)


def test_as_many_optimizer_steps_as_pair_micro_batches_pass_the_check():
    from flowgrpo.preflight import check_batch, check_strategies

    # train_batch_size 8: 16 best-worst pairs are 2 micro-batches (128 samples would be 16)
    dpo = REPO_CONFIGS / "digits_dpo.yaml"
    cfg = load_config(dpo, ["train.train_batch_size=8", "train.optimizer_steps_per_epoch=2"])
    check_batch(cfg, 1, objective=check_strategies(cfg))
    cfg = load_config(dpo, ["train.train_batch_size=8", "train.optimizer_steps_per_epoch=4"])
    with pytest.raises(ValueError, match="exceeds the 2 training micro-batches"):
        check_batch(cfg, 1, objective=check_strategies(cfg))
    # pairs: all: 28 slots a group x 16 groups = 448 pairs, 28 micro-batches of 16, whatever the 8 micro-batches
    # the 128 samples would make (the schema counted those)
    cfg = load_config(dpo, ["objective.pairs=all", "train.optimizer_steps_per_epoch=28"])
    check_batch(cfg, 1, objective=check_strategies(cfg))
    cfg = load_config(dpo, ["objective.pairs=all", "train.optimizer_steps_per_epoch=29"])
    with pytest.raises(ValueError, match="exceeds the 28 training micro-batches"):
        check_batch(cfg, 1, objective=check_strategies(cfg))


# --- metrics.jsonl read tolerantly at resume ----------------------------------------------------------------------


def _records(*epochs) -> str:
    return "".join(json.dumps({"epoch": e, "reward/mean": 0.5}) + "\n" for e in epochs)


def test_a_cut_last_line_is_dropped_and_said(tmp_path, caplog):
    from flowgrpo.writing.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(_records(0, 1) + '{"epoch": 2, "reward/me')  # killed while appending epoch 2
    with caplog.at_level(logging.WARNING, logger="flowgrpo.writing.metrics"):
        assert [r["epoch"] for r in read_metrics(path)] == [0, 1]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(path) in lines[0] and "line 3" in lines[0] and "dropped" in lines[0]


@pytest.mark.parametrize("bad", ['{"epoch": 1, "rew', "[1, 2]", '{"reward/mean": 1}'])
def test_a_bad_line_before_the_last_names_the_file_the_line_and_the_fix(tmp_path, bad):
    from flowgrpo.writing.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(_records(0) + bad + "\n" + _records(2))
    with pytest.raises(ValueError) as info:
        read_metrics(path)
    text = str(info.value)
    assert text.startswith(f"{path}:2: ") and "delete or repair that line" in text and "\n" not in text


def test_resume_reads_metrics_before_the_model_loads(tmp_path, monkeypatch, no_model_load):
    import flowgrpo.preflight as preflight
    from flowgrpo.writing.outputs import claim_folder

    out = tmp_path / "run"
    claim_folder(out, "run")  # a run's folder (flowgrpo's own), as a resume finds it
    (out / "metrics.jsonl").write_text(_records(0) + "garbage\n" + _records(2))
    monkeypatch.setattr(preflight, "resolve_checkpoint", lambda path: Path(path) / "epoch_1")  # not what is tested
    monkeypatch.setattr(preflight, "refuse_changed_evaluation", lambda config: None)
    monkeypatch.setattr(preflight, "refuse_changed_model", lambda config: None)
    monkeypatch.setattr(preflight, "refuse_other_model", lambda config: None)
    config = load_config(DEFAULT_CONFIG, [f"output_dir={out}", f"train.resume_from={out / 'checkpoints'}"])
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record"):
        no_model_load(config)


def _resumable(tmp_path, monkeypatch, *settings) -> tuple:
    """A run folder whose saved config has ``settings`` (on the default digits config), its metrics and a
    checkpoint path (the checkpoint itself is not what is tested); returns (folder, checkpoint)."""
    import flowgrpo.checkpoints.save_load as checkpoint
    import flowgrpo.preflight as preflight
    from flowgrpo.data.prompts import GroupSampler
    from flowgrpo.strategies.settings import save_config
    from flowgrpo.training import run_folder
    from flowgrpo.writing.outputs import claim_folder

    out = tmp_path / "run"
    claim_folder(out, "run")
    config = load_config(DEFAULT_CONFIG, [f"output_dir={out}", *settings])
    save_config(config, out / "config.yaml")
    (out / "metrics.jsonl").write_text(_records(0, 1))
    ckpt = out / "checkpoints" / "epoch_2"
    ckpt.mkdir(parents=True)  # its state.json: what a save writes after epoch 2 (the sampler 3 epochs on)
    sampler = GroupSampler(len(preflight.load_prompt_field(config, "train_prompts")), config.train.prompts_per_epoch,
                           config.train.seed)
    state = {"epoch": 2, "lr_scheduler": {}, "sampler": {**sampler.state_dict(), "position": 3 * sampler.p}}
    (ckpt / "state.json").write_text(json.dumps(state))
    for module in (preflight, run_folder, checkpoint):
        monkeypatch.setattr(module, "resolve_checkpoint", lambda path, **_: Path(path))
    return out, ckpt


def test_a_resume_with_another_finetune_is_refused_before_the_model_loads_naming_the_fix(
        tmp_path, monkeypatch, no_model_load):
    """A LoRA checkpoint resumed with ``model.finetune=full`` (or the reverse) once loaded the model, then failed
    on the first unknown parameter, naming no fix (fresh-user trial): refused first, from the checkpoint's run's
    config, naming both values, the setting that fixes it and the other way (a new run)."""
    lora = ["model.finetune=lora", "model.lora_rank=4"]
    out, ckpt = _resumable(tmp_path, monkeypatch, *lora)
    resume = [f"output_dir={out}", f"train.resume_from={ckpt}"]
    with pytest.raises(ConfigError) as info:
        no_model_load(load_config(DEFAULT_CONFIG, resume))  # digits: full fine-tuning
    text = str(info.value)
    assert "model.finetune: 'lora' -> 'full'" in text and "set model.finetune=lora, or start a new run without " \
        "train.resume_from" in text and "lora_rank" not in text and "\n" not in text, text
    with pytest.raises(ConfigError, match=r"model.lora_rank: 4 -> 8: .*set model.lora_rank=4, or start a new run"):
        no_model_load(load_config(DEFAULT_CONFIG, [*resume, "model.finetune=lora", "model.lora_rank=8"]))
    with pytest.raises(ConfigError, match=r"train.ema_decay=0.9 but the checkpoint's run kept no EMA"):
        no_model_load(load_config(DEFAULT_CONFIG, [*resume, *lora, "train.ema_decay=0.9"]))
    with pytest.raises(SlowStepReached):  # the checkpoint's settings: on to the model
        no_model_load(load_config(DEFAULT_CONFIG, [*resume, *lora]))


def test_a_resume_with_another_prompt_sampler_is_refused_before_the_model_loads(tmp_path, monkeypatch,
                                                                                 no_model_load):
    """``train.prompts_per_epoch``, ``train.seed`` or the training prompt set other than the checkpoint's sampler
    drew with was refused only once the model had loaded (the checkpoint load's sampler check): now first."""
    out, ckpt = _resumable(tmp_path, monkeypatch)
    resume = [f"output_dir={out}", f"train.resume_from={ckpt}"]
    p = load_config(DEFAULT_CONFIG, []).train.prompts_per_epoch
    with pytest.raises(ValueError, match=r"cannot change train.prompts_per_epoch.*changed here: train.seed$"):
        no_model_load(load_config(DEFAULT_CONFIG, [*resume, "train.seed=7"]))
    with pytest.raises(ValueError, match=rf"prompts_per_epoch={2 * p} .*changed here: train.prompts_per_epoch$"):
        no_model_load(load_config(DEFAULT_CONFIG, [*resume, f"train.prompts_per_epoch={2 * p}"]))
    with pytest.raises(SlowStepReached):
        no_model_load(load_config(DEFAULT_CONFIG, resume))


@pytest.mark.parametrize("new_folder", [False, True])
def test_a_cut_last_line_is_said_once_at_a_resume_before_the_model_loads(tmp_path, monkeypatch, caplog, new_folder):
    """A resume read a cut-off last line of metrics.jsonl in its preflight and again in the run's history (every
    process), warning each time (fresh-user trial); into a new folder the checkpoint's run's file was read only
    after the model loaded. Now: one warning, in the preflight (before the model loads); the history reads
    quietly and the run folder's copy is rewritten without the line."""
    import flowgrpo.checkpoints.health as health
    from flowgrpo.preflight import check_output_dir
    from flowgrpo.training.run_folder import RunFolder
    from flowgrpo.watch.divergence import run_history

    origin, ckpt = _resumable(tmp_path, monkeypatch)
    monkeypatch.setattr(health, "resolve_checkpoint", lambda path, **_: Path(path))  # run_history's
    (origin / "metrics.jsonl").write_text(_records(0, 1) + '{"epoch": 2, "reward/me')  # killed while appending
    out = tmp_path / "new" if new_folder else origin
    config = load_config(DEFAULT_CONFIG, [f"output_dir={out}", f"train.resume_from={ckpt}"])

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "cut off" in r.getMessage()]

    with caplog.at_level(logging.WARNING):
        check_output_dir(config)
        assert len(said()) == 1 and said()[0].startswith(f"{origin / 'metrics.jsonl'}: its last line (line 3)")
        assert [r["epoch"] for r in run_history(out, str(ckpt), 2)] == [0, 1]
        RunFolder(config).claim(2)
    assert len(said()) == 1, said()


def test_a_resume_rewrites_metrics_without_the_cut_line(tmp_path):
    from flowgrpo.training.run_folder import RunFolder

    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / "metrics.jsonl").write_text(_records(0, 1, 2) + '{"epoch": 3, "rew')
    config = load_config(DEFAULT_CONFIG, [f"output_dir={tmp_path}", f"train.resume_from={tmp_path / 'checkpoints'}"])
    RunFolder(config).claim(2)  # resumes at epoch 2: its record (and the cut one) go
    assert (tmp_path / "metrics.jsonl").read_text() == _records(0, 1)


# --- settings the chosen strategy does not read -----------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["rloo", "dr_grpo"])
def test_switching_the_default_to_an_estimator_without_std_says_what_std_eps_is_and_how_to_drop_it(estimator):
    # the embedded default sets advantage.std_eps: 0.05 (its schema default is 1e-4); rloo / dr_grpo divide by no std
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT_CONFIG, [f"advantage.name={estimator}"])
    text = str(info.value)
    assert text.startswith("advantage.std_eps=0.05 is read only by advantage.name=grpo") and "\n" not in text
    assert f"advantage.name is '{estimator}'" in text and "advantage.std_eps=0.0001" in text and "gdpo" in text
    config = load_config(DEFAULT_CONFIG, [f"advantage.name={estimator}", "advantage.std_eps=0.0001"])  # the way out
    assert config.advantage.name == estimator


@pytest.mark.parametrize("setting", ["advantage.std_eps=0.01", "advantage.std_ddof=1"])
def test_std_settings_are_refused_with_rloo_and_read_under_gdpo(setting):
    key, value = setting.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}={value} is read only by .*\(its default is "):
        load_config(REPO_CONFIGS / "digits_rloo.yaml", [setting])
    load_config(REPO_CONFIGS / "digits_rloo.yaml", [setting, "advantage.multi_reward=gdpo"])  # GDPO's batch std
    load_config(REPO_CONFIGS / "digits.yaml", [setting])  # grpo reads both


@pytest.mark.parametrize(("setting", "default"), [("model.lora_rank=64", "8"), ("model.lora_alpha=128", "16.0"),
                                                  ('model.lora_target_modules=["to_q"]', '["to_q", "to_k"')])
def test_lora_settings_are_refused_with_full_fine_tuning(setting, default):
    key = setting.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT_CONFIG, [setting])  # the embedded default fine-tunes every weight
    text = str(info.value)
    assert text.startswith(f"{key}=") and "model.finetune is 'full'" in text and "\n" not in text
    assert f"give {key}={default}" in text and "model.finetune=lora" in text
    assert load_config(DEFAULT_CONFIG, [setting, "model.finetune=lora"]).model.finetune == "lora"


# --- a dataset objective's images, each opened before the model loads ---------------------------------------------


def _png(path, size=(16, 16), seed=0) -> None:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def _preference_set(folder, n: int = 16):
    """``n`` pairs of 16x16 PNGs, one JSONL line each; returns the JSONL path."""
    (folder / "images").mkdir()
    lines = []
    for i in range(n):
        for k in ("chosen", "rejected"):
            _png(folder / "images" / f"{i}_{k}.png", seed=2 * i + (k == "rejected"))
        lines.append(json.dumps({"prompt": f"digit {i % 10}", "chosen": f"images/{i}_chosen.png",
                                 "rejected": f"images/{i}_rejected.png"}))
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _spoil(image, how: str) -> str:
    """Make the dataset image ``image`` unusable; returns what the one-line error must say."""
    if how == "missing":
        image.unlink()
        return "not found"
    if how == "empty":
        image.write_bytes(b"")
        return "is empty (0 bytes)"
    if how == "garbage":
        image.write_bytes(b"not an image at all" * 10)
        return "cannot be read as an image"
    if how == "truncated":
        image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])
        return "cannot be read as an image"
    _png(image, size=(16, 12))
    return "is 16x12 (width x height), the set's first image"


@pytest.mark.parametrize("how", ["missing", "empty", "garbage", "truncated", "wrong size"])
def test_a_bad_image_on_the_last_line_of_a_preference_set_stops_the_run_before_the_model_loads(
        tmp_path, no_model_load, how):
    data = _preference_set(tmp_path)
    said = _spoil(tmp_path / "images" / "15_rejected.png", how)
    cfg = load_config(REPO_CONFIGS / "digits_dpo_offline.yaml", [f"data.train_prompts={data}",
                                                                 f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError) as info:
        no_model_load(cfg)
    text = str(info.value)
    assert f"{data}:16: rejected 'images/15_rejected.png'" in text and said in text and "\n" not in text


def test_a_dataset_image_of_another_size_than_the_models_is_named_by_file_and_line(tmp_path):
    from types import SimpleNamespace

    from flowgrpo.preflight import check_dataset, check_dataset_size, check_strategies

    data = _preference_set(tmp_path, n=2)
    cfg = load_config(REPO_CONFIGS / "digits_dpo_offline.yaml", [f"data.train_prompts={data}"])
    first = check_dataset(cfg, check_strategies(cfg))
    assert first == ((16, 16), f"{data}:1: chosen 'images/0_chosen.png'")
    check_dataset_size(first, SimpleNamespace(width=16, height=16))
    with pytest.raises(ValueError, match=rf"{data}:1: chosen 'images/0_chosen.png' is 16x16 .* the model makes 8x8"):
        check_dataset_size(first, SimpleNamespace(width=8, height=8))
    # model.width x model.height given: every image checked against them before the model loads
    cfg = load_config(REPO_CONFIGS / "digits_dpo_offline.yaml", [f"data.train_prompts={data}", "model.height=8",
                                                                 "model.width=8"])
    with pytest.raises(ValueError, match=r"data\.jsonl:1: chosen .* the run needs 8x8"):
        check_dataset(cfg, check_strategies(cfg))


# --- context-parallel token counts from the model folder's configs ------------------------------------------------


def test_an_image_token_count_the_context_degree_does_not_divide_is_refused_before_the_model_loads(tiny_flux_dir):
    from flowgrpo.config import build_config
    from flowgrpo.preflight import preflight

    # the tiny FLUX's VAE has 4 blocks (factor 2^3 = 8) and FLUX packs 2x2 latent patches: 48 px -> 3 x 3 = 9 tokens
    base = [f"model.pretrained={tiny_flux_dir}", "model.max_sequence_length=16", "parallel.context_degree=2",
            "parallel.sharding=fsdp2", "rewards=[{name: jpeg_compressibility}]", "data.train_prompts=t2i_compbench"]
    config = build_config({}, [*base, "model.height=48", "model.width=48"])
    with pytest.raises(ValueError, match=r"context_degree=2 .* has 9 tokens \(48x48 pixels / VAE factor 8 / 2x2 "
                                         r"patches\), not a multiple of 2"):
        preflight(config, world_size=2)
    preflight(build_config({}, [*base, "model.height=64", "model.width=64"]), world_size=2)  # 4 x 4 = 16 tokens
    preflight(build_config({}, base), world_size=2)  # unset: the VAE's sample size 64, 16 tokens


def test_attention_heads_ulysses_does_not_divide_are_refused_before_the_model_loads(tiny_flux_dir):
    """Ulysses splits the attention heads: the tiny FLUX's transformer has 2 (its config.json), so a context degree
    of 4 is refused by preflight, read from the folder, though its 64 x 64 images' 16 tokens split in four; ring
    attention splits no heads."""
    from flowgrpo.config import build_config
    from flowgrpo.preflight import check_context_tokens

    base = [f"model.pretrained={tiny_flux_dir}", "parallel.context_degree=4", "parallel.sharding=fsdp2"]
    with pytest.raises(ValueError, match=r"context_degree=4 with ulysses attention splits the attention heads: "
                                         r"FluxTransformer2DModel \(.*\) has 2, not a multiple of 4"):
        check_context_tokens(build_config({}, base))
    check_context_tokens(build_config({}, [*base, "parallel.context_attention=ring", "model.dtype=bfloat16"]))


def test_the_embedded_tiny_model_is_counted_once_it_is_built(tmp_path, monkeypatch):
    """``model.pretrained: tiny`` (configs/tiny_jpeg.yaml) with an odd token count passed preflight, loaded and
    sharded the model, then printed a traceback on every rank in the first evaluation (a fresh user's trial): the
    embedded model's cache folder is read as any folder once it is built (nothing is built by the check)."""
    from flowgrpo.config import build_config
    from flowgrpo.models import ensure_tiny_model
    from flowgrpo.preflight import check_context_tokens

    monkeypatch.setenv("FLOWGRPO_CACHE", str(tmp_path / "cache"))
    base = ["model.pretrained=tiny", "parallel.context_degree=2", "parallel.sharding=fsdp2",
            "model.height=48", "model.width=48"]
    check_context_tokens(build_config({}, base))  # not built yet: left to the first transformer call
    assert not (tmp_path / "cache" / "tiny-flux-v1").exists()
    ensure_tiny_model()
    with pytest.raises(ValueError, match=r"context_degree=2 .* has 9 tokens"):
        check_context_tokens(build_config({}, base))
