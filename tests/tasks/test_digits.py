"""The digits task: data transforms, the two classifiers, the judge, diversity, pretraining (the rewards built on
them are specified in rewards/tests/test_digits_reward.py).

Expected values come from outside the code under test: scikit-learn's own ``predict``/``score`` for the
classifiers, ``torch.nn.functional.interpolate`` for the upscaling,
``scipy.spatial.distance.pdist`` and hand-built 8×8 grids with known distances for the diversity, and folders
loaded back through ``FluxPipeline.from_pretrained`` for pretraining. The full pretraining never runs here: the
pretraining tests take one or two optimizer steps.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch

from flowgrpo.tasks.digits import data
from flowgrpo.tasks.digits import model as digits
from flowgrpo.tasks.digits import scoring as de


@pytest.fixture(scope="module")
def test_digits():
    """30 real held-out digits, 3 of each class: (grids (30, 8, 8) 0–16, labels (30,), images (30, 3, 32, 32))."""
    x, y = data.load_digit_split("test")
    idx = np.concatenate([np.flatnonzero(y == d)[:3] for d in range(10)])
    return x[idx], y[idx], data.digits_to_images(x[idx])


# --------------------------------------------------------------------------------------------- prompts, data
def test_prompt_files_name_the_digit_of_their_metadata():
    train, evals = data.prompt_records("train"), data.prompt_records("eval")
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    for rec in train + evals:
        tokens = rec["prompt"].split()
        named = {words.index(t) for t in tokens if t in words} | {int(t) for t in tokens if t.isdigit()}
        assert named == {rec["digit"]}, rec
    assert sorted(r["digit"] for r in evals) == list(range(10))
    assert [r["digit"] for r in train].count(7) == len(data.PHRASINGS)
    assert {r["prompt"] for r in evals} <= {r["prompt"] for r in train}
    assert data.digit_prompt(7) == "a handwritten digit seven"
    with pytest.raises(ValueError, match="eval"):
        data.prompt_records("heldout")


def test_splits_are_disjoint_stratified_and_cover_the_data():
    from sklearn.datasets import load_digits

    ref = load_digits()
    parts = {k: data._split_indices()[k] for k in ("reward", "judge", "test")}
    allidx = np.concatenate(list(parts.values()))
    assert len(allidx) == len(set(allidx.tolist())) == 1797
    for name, idx in parts.items():
        counts = np.bincount(ref.target[idx], minlength=10)
        share = counts / np.bincount(ref.target, minlength=10)
        assert np.allclose(share, data.SPLIT_FRACTIONS[name], atol=0.01), (name, share)
    x, y = data.load_digit_split("train")
    assert len(y) == len(parts["reward"]) + len(parts["judge"])
    np.testing.assert_array_equal(x, ref.images[np.sort(np.concatenate([parts["reward"], parts["judge"]]))])
    with pytest.raises(ValueError, match="'test'"):
        data.load_digit_split("validation")


def test_upscaling_is_bilinear_ink_on_white_and_inverted_exactly(test_digits):
    grids, _, images = test_digits
    g = torch.from_numpy(grids).float()
    ref = 1 - torch.nn.functional.interpolate(g[:, None] / 16, size=32, mode="bilinear", align_corners=False)
    assert images.shape == (30, 3, 32, 32) and images.dtype == torch.float32
    torch.testing.assert_close(images, ref.expand(-1, 3, -1, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(data.images_to_digits(images), g, atol=1e-4, rtol=0)
    # by hand: a white page carries no ink, a uniformly mid-grey one 8/16 everywhere; colour is averaged
    assert torch.all(data.images_to_digits(torch.ones(1, 3, 32, 32)).abs() < 1e-5)
    torch.testing.assert_close(data.images_to_digits(torch.full((1, 3, 32, 32), 0.5)),
                               torch.full((1, 8, 8), 8.0), atol=1e-4, rtol=0)
    rgb = torch.stack([torch.zeros(32, 32), torch.ones(32, 32), torch.ones(32, 32)])[None]  # grey 2/3
    torch.testing.assert_close(data.images_to_digits(rgb), torch.full((1, 8, 8), 16 / 3), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="square"):
        data.images_to_digits(torch.ones(1, 3, 32, 16))
    with pytest.raises(ValueError, match=r"\(N, 8, 8\)"):
        data.digits_to_images(np.zeros((2, 64)))


# ------------------------------------------------------------------------------------------------ classifiers
def test_both_classifiers_reach_095_on_held_out_real_digits_and_differ():
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import SVC

    x, y = data.load_digit_split("test")
    f = x.reshape(len(x), -1) / 16
    reward_acc = float(np.mean(de.reward_classifier().predict(f) == y))
    judge_acc = float(np.mean(de.judge_classifier().predict(f) == y))
    assert reward_acc >= 0.95 and judge_acc >= 0.95, (reward_acc, judge_acc)
    assert de.classifier_accuracies() == pytest.approx({"reward": reward_acc, "judge": judge_acc})
    assert isinstance(de.reward_classifier(), LogisticRegression) and isinstance(de.judge_classifier(), SVC)
    # the judge was fitted on the judge split: its support vectors are rows of it and of no other split
    rows = {k: {r.tobytes() for r in data.load_digit_split(k)[0].reshape(-1, 64).astype(np.float64) / 16}
            for k in ("reward", "judge", "test")}
    sv = {r.tobytes() for r in de.judge_classifier().support_vectors_}
    assert sv <= rows["judge"] and not sv & (rows["reward"] | rows["test"])


def test_judge_correctness_is_the_svm_prediction_against_the_label(test_digits):
    grids, labels, images = test_digits
    expected = de.judge_classifier().predict(grids.reshape(30, -1) / 16) == labels
    got = de.judge_correctness(images, torch.from_numpy(labels))
    assert got.dtype == torch.bool and got.shape == (30,)
    np.testing.assert_array_equal(got.numpy(), expected)
    wrong = (labels + 1) % 10
    assert not de.judge_correctness(images, wrong.tolist())[expected].any()
    with pytest.raises(ValueError, match=r"labels\[0\] must be an integer digit 0–9, got 10"):
        de.judge_correctness(images[:1], [10])
    with pytest.raises(ValueError, match="2 images but 1 labels"):
        de.judge_correctness(images[:2], [1])


# --------------------------------------------------------------------------------------------------- diversity
def test_diversity_by_hand():
    a, b = np.zeros((8, 8)), np.full((8, 8), 16.0)  # ‖a − b‖ = √(64·16²) = 128
    c = np.zeros((8, 8))
    c[0, :4] = 16.0  # ‖a − c‖ = √(4·16²) = 32
    grids = np.stack([a, b, a, c])
    images = data.digits_to_images(grids)
    assert de.intra_digit_diversity(images, [3, 3, 5, 5]) == pytest.approx((128 + 32) / 2, rel=1e-4)
    # three samples of one digit: the mean of 128, 32 and ‖b − c‖ = √(60·16²) = 16·√60
    assert de.intra_digit_diversity(data.digits_to_images(np.stack([a, b, c])), [1, 1, 1]) == pytest.approx(
        (128 + 32 + 16 * math.sqrt(60)) / 3, rel=1e-4)
    # a digit with a single sample is skipped
    assert de.intra_digit_diversity(data.digits_to_images(np.stack([a, b, c])), [1, 1, 2]) == pytest.approx(
        128, rel=1e-4)
    with pytest.raises(ValueError, match="at least two samples"):
        de.intra_digit_diversity(images[:2], [3, 4])


def test_diversity_of_identical_copies_is_zero_and_of_real_digits_matches_pdist(test_digits):
    from scipy.spatial.distance import pdist

    _, _, images = test_digits
    copies = images[[0] * 5 + [12] * 5]
    assert de.intra_digit_diversity(copies, [0] * 5 + [4] * 5) == pytest.approx(0.0, abs=1e-3)
    x, y = data.load_digit_split("all")
    expected = np.mean([pdist(x[y == d].reshape(-1, 64)).mean() for d in range(10)])
    assert de.real_diversity() == pytest.approx(expected, rel=1e-6)
    assert de.real_diversity() > 20


# ------------------------------------------------------------------------------------------------- pretraining
def _digest(folder) -> dict[str, str]:
    return {p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*/*.safetensors"))}


@pytest.fixture(scope="module")
def pretrained_tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits") / "pipe"
    return digits.pretrain(out, seed=3, vae_steps=2, steps=2, batch_size=8, vae_batch_size=8, progress=False)


def test_pretrain_saves_a_flux_folder_that_samples_digit_sized_images(pretrained_tiny):
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

    pipe = FluxPipeline.from_pretrained(pretrained_tiny)
    assert isinstance(pipe.transformer, FluxTransformer2DModel) and isinstance(pipe.vae, AutoencoderKL)
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels == 16
    assert not pipe.transformer.config.guidance_embeds
    assert pipe.tokenizer_2.model_max_length == digits.MAX_SEQUENCE_LENGTH
    assert not pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift == 1.0
    info = digits.read_model_info(pretrained_tiny)
    assert info["seed"] == 3 and info["height"] == 32 and info["max_sequence_length"] == 16
    # every prompt word is one T5 piece (no <unk>)
    for rec in data.prompt_records("train"):
        ids = pipe.tokenizer_2(rec["prompt"]).input_ids
        assert pipe.tokenizer_2.unk_token_id not in ids and len(ids) == len(rec["prompt"].split()) + 1
    # the VAE's shift/scale normalise the training latents, recomputed here from the saved VAE
    x, _ = data.load_digit_split("train")
    with torch.no_grad():
        lat = pipe.vae.encode(data.digits_to_images(x) * 2 - 1).latent_dist.mean
    z = (lat - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    assert abs(float(z.mean())) < 1e-3 and float(z.std()) == pytest.approx(1.0, abs=1e-3)
    images = pipe(["a handwritten digit seven", "the number 3 written by hand"], height=32, width=32,
                  num_inference_steps=2, max_sequence_length=16, output_type="pt",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (2, 3, 32, 32) and 0 <= images.min() and images.max() <= 1


def test_the_built_bytes_depend_only_on_the_seed_not_on_the_launching_process(tmp_path, monkeypatch):
    """Issue 38, case 8: ``accelerate launch`` sets ``OMP_NUM_THREADS=1`` for its process, ``python`` uses a thread
    a core, and one thread and two give other weights. The CLI (as the cache) builds in a pinned child process:
    two builds from parents with one and two threads are byte-identical, and record the pinned environment."""
    recipe = ["--seed", "3", "--vae-steps", "2", "--steps", "2", "--batch-size", "8", "--vae-batch-size", "8",
              "--no-progress"]
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):  # plain python on two cores; then what accelerate launch sets
            torch.set_num_threads(threads)
            monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
            digits.main([str(tmp_path / f"threads{threads}"), *recipe])
    finally:
        torch.set_num_threads(before)
    assert digits.is_complete(tmp_path / "threads1")
    assert _digest(tmp_path / "threads2") == _digest(tmp_path / "threads1")
    info = digits.read_model_info(tmp_path / "threads1")
    numerics = info["numerics"]
    assert numerics["pinned"] and numerics["threads"] == 1
    assert numerics["cpu"]["model"] and numerics["blas"]  # the CPU and the BLAS library the bytes depend on
    assert info["sha256"] == {k: v for k, v in _digest(tmp_path / "threads1").items() if k in ("transformer", "vae")}
    assert numerics["cpu_capability"] in ("AVX2", "DEFAULT")  # AVX2 on x86-64 (a CPU without it: DEFAULT)


def test_pretrain_reaches_every_random_draw_with_its_seed(pretrained_tiny, tmp_path):
    # the seed reaches every random draw: even the untrained (frozen) text encoders differ for another seed
    other = digits.pretrain(tmp_path / "other", seed=4, vae_steps=0, steps=0, progress=False)
    assert _digest(other)["text_encoder"] != _digest(pretrained_tiny)["text_encoder"]
    assert _digest(other)["text_encoder_2"] != _digest(pretrained_tiny)["text_encoder_2"]
    with pytest.raises(ValueError, match="steps must be an integer ≥ 0, got -1"):
        digits.pretrain(tmp_path / "bad", steps=-1)


def test_ensure_digits_model_builds_once_atomically_into_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_pretrain(out, seed=0, progress=True):
        calls.append(seed)
        (out / "model_index.json").write_text("{}")
        (out / digits.MARKER_FILE).write_text(json.dumps({"seed": seed}))
        return out

    monkeypatch.setenv("FLOWGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digits, "pretrain_pinned", fake_pretrain)
    target = digits.ensure_digits_model(seed=5)
    assert target == tmp_path / "cache" / f"digits-v{digits.RECIPE_VERSION}-seed5" == digits.default_model_dir(5)
    assert digits.is_complete(target) and calls == [5]
    assert digits.ensure_digits_model(seed=5) == target and calls == [5]  # reused, not rebuilt
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temporary folder left

    def failing(out, seed=0, progress=True):
        (out / "model_index.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(digits, "pretrain_pinned", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        digits.ensure_digits_model(seed=6)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # nothing half-written remains
    (tmp_path / "half").mkdir()
    with pytest.raises(FileExistsError, match="not a finished model folder"):
        digits.ensure_digits_model(folder=tmp_path / "half")


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FLOWGRPO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert digits.cache_root() == tmp_path / "flowgrpo"
    monkeypatch.setenv("FLOWGRPO_CACHE", str(tmp_path / "x"))
    assert digits.cache_root() == tmp_path / "x"
    assert digits.default_model_dir(2) == tmp_path / "x" / f"digits-v{digits.RECIPE_VERSION}-seed2"


# ------------------------------------------------------------------------------------------------ per-digit figures
def test_min_diversity_ratio_is_the_worst_digit_against_its_own_real_diversity():
    from flowgrpo.tasks.digits.scoring import min_diversity_ratio

    assert min_diversity_ratio({0: 20.0, 1: 20.0}, {0: 25.0, 1: 40.0}) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="digits \\[2\\]"):
        min_diversity_ratio({2: 1.0}, {0: 1.0})
    with pytest.raises(ValueError, match="at least one digit"):
        min_diversity_ratio({}, {0: 1.0})
