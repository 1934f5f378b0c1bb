"""The digits task's rewards: ``digit_correctness`` (the reward classifier's probability of the prompted digit) and
the ``digit_judge`` evaluation metrics (the independent judge's correctness and intra-digit diversity).

Expected values come from outside the code under test: scikit-learn's own ``predict_proba``/``predict`` for the
classifiers (the reward recomputes the softmax in torch), and pairwise distances written out with
``itertools``/numpy for the diversity.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from flowgrpo_rewards.digits import DigitCorrectness, DigitCorrectnessStrict

from flowgrpo.rewards.registry import load_reward
from flowgrpo.tasks.digits import data
from flowgrpo.tasks.digits import scoring as de
from flowgrpo.testing.rewards import RewardConformance


@pytest.fixture(scope="module")
def test_digits():
    """30 real held-out digits, 3 of each class: (grids (30, 8, 8) 0–16, labels (30,), images (30, 3, 32, 32))."""
    x, y = data.load_digit_split("test")
    idx = np.concatenate([np.flatnonzero(y == d)[:3] for d in range(10)])
    return x[idx], y[idx], data.digits_to_images(x[idx])


def meta(labels) -> list[dict]:
    return [{"digit": int(v)} for v in labels]


@pytest.fixture(scope="module")
def reward():
    r = DigitCorrectness()
    r.setup(torch.device("cpu"))
    return r


def test_reward_is_the_logistic_regression_probability_of_the_metadata_digit(reward, test_digits):
    grids, labels, images = test_digits
    proba = de.reward_classifier().predict_proba(grids.reshape(30, -1) / 16)  # sklearn's own softmax
    prompts = ["a handwritten digit zero"] * 30  # the prompt text is not read
    scores = reward(images, prompts, meta(labels))
    assert scores.dtype == torch.float32 and scores.shape == (30,) and scores.device.type == "cpu"
    np.testing.assert_allclose(scores.numpy(), proba[np.arange(30), labels], atol=1e-5)
    strict = DigitCorrectnessStrict()(images, prompts, meta(labels))
    np.testing.assert_array_equal(strict.numpy(), (proba.argmax(1) == labels).astype(np.float32))
    np.testing.assert_array_equal(DigitCorrectness(strict=True)(images, prompts, meta(labels)).numpy(),
                                  strict.numpy())


def test_reward_reads_the_label_from_metadata_not_the_batch_position(reward, test_digits):
    _, labels, images = test_digits
    prompts = [data.digit_prompt(int(d)) for d in labels]
    base = reward(images, prompts, meta(labels))
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(0))
    together = reward(images[perm], [prompts[i] for i in perm], meta(labels[perm.numpy()]))
    torch.testing.assert_close(together, base[perm], atol=1e-6, rtol=0)
    # images permuted but metadata left in place: each image is scored against the digit now beside it
    apart = reward(images[perm], prompts, meta(labels))
    probs = de.digit_probabilities(images[perm])
    torch.testing.assert_close(apart, probs[torch.arange(30), torch.from_numpy(labels)], atol=1e-6, rtol=0)
    assert (apart - together).abs().max() > 0.5


def test_reward_probabilities_sum_to_one_over_the_ten_labels(reward, test_digits):
    _, _, images = test_digits
    for i in (0, 13, 29):
        one = images[i : i + 1].expand(10, -1, -1, -1)
        total = reward(one, [""] * 10, meta(range(10))).sum()
        assert total.item() == pytest.approx(1.0, abs=1e-5)
        assert DigitCorrectnessStrict()(one, [""] * 10, meta(range(10))).sum().item() == 1.0


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ([{}], r"needs metadata\['digit'\] \(an integer digit 0–9\).*sample 0 has no metadata fields"),
        ([{"digit": 3}, {"label": 3}], r"sample 1 has fields \['label'\]"),
        ([{"digit": 10}], r"metadata\['digit'\] of sample 0 must be an integer 0–9, got 10"),
        ([{"digit": -1}], "got -1"),
        ([{"digit": "7"}], "got '7'"),
        ([{"digit": 7.0}], "got 7.0"),
        ([{"digit": True}], "got True"),
        ([{"digit": None}], "got None"),
    ],
)
def test_bad_metadata_is_a_clear_error(reward, metadata, match):
    images = torch.ones(len(metadata), 3, 32, 32)
    with pytest.raises(ValueError, match=match):
        reward(images, [""] * len(metadata), metadata)


@pytest.mark.parametrize("name", ["digit_correctness", "digit_correctness_strict", "digit_judge"])
def test_bad_metadata_is_refused_before_any_image_by_the_prompt_check(name):
    """``check_prompts`` (the hook the trainer calls before the model loads) refuses what scoring would refuse."""
    from flowgrpo.data.prompts import PromptSet

    r, _ = load_reward(name)
    r.check_prompts(PromptSet(["a handwritten digit seven"], [{"digit": 7}], "ok"))  # a good set passes
    with pytest.raises(ValueError, match=rf"{name}: metadata\['digit'\] of sample 1 must be an integer 0–9, got 11"):
        r.check_prompts(PromptSet(["seven", "eleven"], [{"digit": 7}, {"digit": 11}], "bad"))


def test_reward_loads_through_the_entry_points():
    plain, origin = load_reward("digit_correctness")
    assert type(plain) is DigitCorrectness and not plain.strict and origin.distribution == "flowgrpo-rewards"
    strict, _ = load_reward("digit_correctness_strict")
    assert isinstance(strict, DigitCorrectnessStrict) and strict.strict and strict.name == "digit_correctness_strict"
    assert load_reward("digit_correctness", strict=True)[0].strict
    with pytest.raises(ValueError, match="strict must be true or false"):
        DigitCorrectness(strict="yes")


class TestDigitCorrectnessConformance(RewardConformance):
    reward_factory = DigitCorrectness
    metadata_factory = staticmethod(lambda n: [{"digit": i % 10} for i in range(n)])
    required_metadata_fields = ("digit",)
    image_size = (32, 32)


def _real_grids(per_digit: int):
    from flowgrpo.tasks.digits.data import load_digit_split

    x, y = load_digit_split("all")
    idx = np.concatenate([np.flatnonzero(y == d)[:per_digit] for d in range(10)])
    return torch.from_numpy(x[idx]).double(), y[idx]


def test_digit_judge_batch_metrics_per_digit_and_min_ratio():
    from flowgrpo_rewards.digits_judge import DigitJudge

    from flowgrpo.tasks.digits.data import digits_to_images, images_to_digits
    from flowgrpo.tasks.digits.scoring import judge_predict

    grids, labels = _real_grids(4)
    grids[labels == 3] = grids[labels == 3][0]  # digit 3 collapsed to one prototype: diversity 0
    images = digits_to_images(grids)
    back = images_to_digits(images).double()  # the grids the measure sees (exact up to rounding)
    meta = [{"digit": int(d)} for d in labels]
    out = DigitJudge().batch_metrics(images, [""] * len(labels), meta)

    x, y = _real_all()
    predicted = judge_predict(images).numpy()
    expected_div = {}
    for d in range(10):
        g = back[torch.from_numpy(labels == d)]
        pairs = [float(torch.linalg.vector_norm(a - b)) for a, b in itertools.permutations(g, 2)]
        expected_div[d] = sum(pairs) / len(pairs)
        real = x[y == d].reshape(-1, 64)
        real_pairs = np.linalg.norm(real[:, None] - real[None], axis=-1)
        n = len(real)
        assert out[f"digit_{d}/diversity_real"] == pytest.approx(real_pairs.sum() / (n * (n - 1)), rel=1e-9)
        assert out[f"digit_{d}/diversity"] == pytest.approx(expected_div[d], abs=1e-4)
        assert out[f"digit_{d}/correctness"] == pytest.approx(float((predicted[labels == d] == d).mean()))
    assert out["digit_3/diversity"] == pytest.approx(0.0, abs=1e-4)
    assert out["diversity_min_ratio"] == pytest.approx(0.0, abs=1e-5)
    assert out["diversity"] == pytest.approx(np.mean(list(expected_div.values())), abs=1e-4)
    assert out["correctness"] == pytest.approx(float((predicted == labels).mean()))


def _real_all():
    from flowgrpo.tasks.digits.data import load_digit_split

    x, y = load_digit_split("all")
    return x.astype(np.float64), y
