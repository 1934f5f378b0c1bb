"""User-facing input faults, each refused at the boundary with a message naming the value and what is allowed:
booleans given for integers, out-of-range seeds, corrupt checkpoint files, a resume that changes the prompt
sampler, and digits left out of the digit judge's diversity figures."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from flowgrpo.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flowgrpo.config import ConfigError, Section, build_config
from flowgrpo.data.prompts import GroupSampler

# --- 1. booleans are not integers -----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["data.eval_num_prompts", "logging.eval_every", "logging.plot_every",
                                 "train.num_epochs", "train.train_batch_size", "algo.std_ddof",
                                 "train.warmup_steps", "model.height"])
@pytest.mark.parametrize("value", ["true", "false"])
def test_a_boolean_for_an_integer_key_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"config field '{key}': an integer is needed, got a boolean"):
        build_config({}, [f"{key}={value}"])


def test_a_boolean_in_a_strategy_integer_or_integer_list_is_refused():
    with pytest.raises(ConfigError, match=r"'algo.group_filter.keep': an integer is needed, got a boolean"):
        build_config({}, ["algo.group_filter={name: gfpo, keep: true}"])
    with pytest.raises(ConfigError, match=r"'chunker.min_chunk_size': an integer is needed, got a boolean"):
        build_config({}, ["chunker={name: chunk, min_chunk_size: true}"])
    with pytest.raises(ConfigError, match=r"'chunker.chunk_sizes': an integer is needed, got a boolean"):
        build_config({}, ["chunker={name: chunk, chunk_sizes: [true, 2]}"])


def _every_section() -> set:
    """Every section of the schema and every registered strategy's settings model, found from the schema and the
    registries, so a new field cannot slip through."""
    from flowgrpo.algo.chunkers import CHUNKERS, ChunkerConfig
    from flowgrpo.algo.filters import GROUP_FILTERS, GroupFilterConfig
    from flowgrpo.algo.losses import POLICY_LOSSES, PolicyLossConfig
    from flowgrpo.algo.objectives import OBJECTIVES, ObjectiveConfig
    from flowgrpo.config import Config
    from flowgrpo.settings import settings_class

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
    from flowgrpo.settings import _takes_int

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


@pytest.mark.parametrize("override", ["train.lr=true", "train.ema_decay=false", "algo.kl_beta=true",
                                      "train.adam_betas=[true, 0.999]", "model.scheduler_shift=true"])
def test_a_boolean_for_a_float_key_is_refused_naming_the_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"config field '{key}': a number is needed, got a boolean"):
        build_config({}, [override])


def test_every_float_field_refuses_a_boolean_and_takes_a_number():
    """Every float field of every section and strategy (a boolean once ran as 1.0: train.lr=true)."""
    from flowgrpo.settings import _takes_float

    checked = 0
    for model in _every_section():
        for name, f in model.model_fields.items():
            if _takes_float(f.annotation):
                with pytest.raises(Exception, match="a number is needed, got a boolean"):
                    model.model_validate({name: True})
                checked += 1
    assert checked >= 20
    assert build_config({}, ["train.lr=1", "train.adam_betas=[0, 0.9]"]).train.lr == 1.0


# --- 2. seeds numpy cannot take ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, 2**32, 2**33])
def test_an_out_of_range_seed_is_refused_naming_train_seed(seed):
    with pytest.raises(ConfigError, match=rf"train.seed={seed} is out of range: .*0\.\.2\*\*32-1"):
        build_config({}, [f"train.seed={seed}"])


def test_the_seed_range_ends_are_accepted():
    assert build_config({}, ["train.seed=0"]).train.seed == 0
    assert build_config({}, [f"train.seed={2**32 - 1}"]).train.seed == 2**32 - 1


# --- 3. corrupt checkpoint files --------------------------------------------------------------------------------


def _parts(seed=0):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    from flowgrpo.ema import EMA

    return model, opt, sched, GroupSampler(30, 8, seed), EMA(list(model.parameters()), 0.9)


def _saved(tmp_path):
    model, opt, sched, sampler, ema = _parts()
    save_checkpoint(tmp_path, 0, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler, ema=ema)
    return tmp_path / "epoch_0"


def _load(tmp_path, sampler=None):
    model, opt, sched, own, ema = _parts()
    return load_checkpoint(tmp_path, model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler or own,
                           ema=ema)


@pytest.mark.parametrize("name", ["trainable.safetensors", "ema.safetensors", "optimizer.pt", "rng.pt",
                                  "state.json"])
def test_a_truncated_checkpoint_file_is_named_as_corrupt(tmp_path, name):
    folder = _saved(tmp_path)
    f = folder / name
    f.write_bytes(f.read_bytes()[:min(1000, f.stat().st_size // 2)])
    with pytest.raises(CheckpointError, match=rf"{name}' is corrupt or unreadable"):
        _load(tmp_path)


def test_a_garbage_safetensors_file_is_named_as_corrupt(tmp_path):
    folder = _saved(tmp_path)
    (folder / "trainable.safetensors").write_bytes(b"\x00" * 1000)
    with pytest.raises(CheckpointError, match=r"trainable.safetensors' is corrupt or unreadable"):
        _load(tmp_path)


def test_a_state_json_without_its_entries_is_named_as_corrupt(tmp_path):
    folder = _saved(tmp_path)
    (folder / "state.json").write_text(json.dumps({"epoch": 0}))
    with pytest.raises(CheckpointError, match=r"state.json' is corrupt or unreadable .*'lr_scheduler'"):
        _load(tmp_path)


def test_a_missing_checkpoint_file_is_named(tmp_path):
    folder = _saved(tmp_path)
    (folder / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete: optimizer.pt is missing"):
        _load(tmp_path)


def test_an_intact_checkpoint_still_loads(tmp_path):
    _saved(tmp_path)
    assert _load(tmp_path) == 0


# --- 4. a resume that changes the prompt sampler ----------------------------------------------------------------


def test_a_resume_with_other_prompts_per_epoch_is_explained_in_config_terms():
    state = {"position": 24, "seed": 0, "n": 30, "p": 8}
    with pytest.raises(ValueError, match=r"the checkpoint's prompt sampler drew 8 prompts an epoch from 30 prompts "
                                         r".*this run asks for train.prompts_per_epoch=16 from 30 prompts .*a resume "
                                         r"cannot change train.prompts_per_epoch.*changed here: "
                                         r"train.prompts_per_epoch$"):
        GroupSampler(30, 16, 0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"changed here: train.seed, the training prompt set$"):
        GroupSampler(31, 8, 1).load_state_dict(state)
    ok = GroupSampler(30, 8, 0)
    ok.load_state_dict(state)
    assert ok.position == 24


def test_load_checkpoint_reports_the_sampler_mismatch(tmp_path):
    _saved(tmp_path)
    with pytest.raises(ValueError, match="train.prompts_per_epoch=16"):
        _load(tmp_path, sampler=GroupSampler(30, 16, 0))


# --- 5. digits left out of the judge's diversity ----------------------------------------------------------------


def _judge_metrics(labels, caplog):
    import numpy as np
    from flowgrpo_rewards.digits_judge import DigitJudge

    from flowgrpo.tasks.digits.data import digits_to_images, load_digit_split

    x, y = load_digit_split("all")
    idx = [int(np.flatnonzero(y == d)[k]) for k, d in enumerate(labels)]
    images = digits_to_images(torch.from_numpy(x[idx]).double())
    with caplog.at_level(logging.WARNING, logger="flowgrpo_rewards.digits_judge"):
        return DigitJudge().batch_metrics(images, [""] * len(labels), [{"digit": d} for d in labels])


def test_the_judge_names_digits_left_out_of_diversity(caplog):
    labels = [d for d in range(10) for _ in range(2 if d < 5 else 1)]  # eval_num_prompts=15
    out = _judge_metrics(labels, caplog)
    assert "leave out digits [5, 6, 7, 8, 9] (one image: [5, 6, 7, 8, 9])" in caplog.text
    assert "multiple of 10 with at least 2 per digit" in caplog.text
    assert out["diversity"] == out["diversity"]  # still measured over digits 0-4


def test_the_judge_names_absent_digits_too(caplog):
    _judge_metrics([0, 0, 1, 1, 2], caplog)
    assert "one image: [2], no image: [3, 4, 5, 6, 7, 8, 9]" in caplog.text


def test_the_judge_is_quiet_with_two_images_of_every_digit_and_keeps_the_none_warning(caplog):
    _judge_metrics([d for d in range(10) for _ in range(2)], caplog)
    assert "digit_judge" not in caplog.text
    caplog.clear()
    out = _judge_metrics(list(range(10)), caplog)
    assert "no digit has two samples" in caplog.text and "leave out" not in caplog.text
    assert out["diversity"] != out["diversity"]  # NaN
