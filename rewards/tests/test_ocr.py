"""OCR reward: text rendered with Pillow, read by RapidOCR, scored by edit distance to the quoted prompt text.

Expected values are derived by hand from Flow-GRPO's formula (1 - min(lev, len) / len, or 1 when the target is
contained, after removing spaces and lowercasing) and checked against a Levenshtein distance written out here.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch
from flowgrpo_rewards.ocr import OcrReward, images_to_bgr_uint8, normalize_text, ocr_text_reward, quoted_text
from PIL import Image, ImageDraw, ImageFont

from flowgrpo.testing.rewards import RewardConformance

HAVE_OCR_EXTRA = all(importlib.util.find_spec(m) for m in ("rapidocr_onnxruntime", "rapidfuzz"))


def levenshtein(a: str, b: str) -> int:
    """Textbook dynamic programme (Wagner-Fischer), unit costs."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def render(lines: list[str], size: int = 512, font_size: int = 56) -> torch.Tensor:
    """Black text lines centred on a white square: (3, size, size) float in [0, 1]."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    step = int(font_size * 1.6)
    top = size // 2 - step * len(lines) // 2
    for k, line in enumerate(lines):
        left, _, right, _ = draw.textbbox((0, 0), line, font=font)
        draw.text(((size - (right - left)) // 2, top + k * step), line, fill=(0, 0, 0), font=font)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


# ------------------------------------------------------------------------------------------------------------
# the formula (no OCR engine)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recognized,target,expected",
    [
        ("Hello World", "hello world", 1.0),  # equal after removing spaces and lowercasing
        ("xxHELLOworld!!", "Hello World", 1.0),  # contained
        ("Hello Wrld", "Hello World", 1 - 1 / 10),  # one deletion, len("helloworld") = 10
        ("Jello World", "Hello World", 1 - 1 / 10),  # one substitution
        ("Hxllo Wxrld", "Hello World", 1 - 2 / 10),
        ("kitten", "sitting", 1 - 3 / 7),
        ("", "cat", 0.0),  # nothing read: distance len(t)
        ("a long unrelated sentence", "cat", 0.0),  # distance capped at len(t)
    ],
)
def test_ocr_formula_by_hand(recognized, target, expected):
    pytest.importorskip("rapidfuzz")
    assert ocr_text_reward(recognized, target) == pytest.approx(expected, abs=1e-12)


def test_ocr_formula_matches_an_independent_levenshtein():
    pytest.importorskip("rapidfuzz")
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = "".join(rng.choice(list("abcde"), size=rng.integers(1, 9)))
        r = "".join(rng.choice(list("abcde "), size=rng.integers(0, 12)))
        nr, nt = normalize_text(r), normalize_text(t)
        expected = 1.0 if nt in nr else 1 - min(levenshtein(nr, nt), len(nt)) / len(nt)
        assert ocr_text_reward(r, t) == pytest.approx(expected, abs=1e-12), (r, t)


def test_quoted_text_is_the_first_double_quoted_span():
    assert quoted_text('A sign that says "Hello World" next to "Bye"') == "Hello World"
    assert quoted_text('"Open 24 Hours" neon sign') == "Open 24 Hours"


@pytest.mark.parametrize("prompt", [
    "a sign that says \u201cJoe\u2019s Diner\u201d",  # curly double quotes, curly apostrophe inside
    "a sign that says \u201eJoe's Diner\u201c",  # German quotes
    "a sign that says \u00abJoe's Diner\u00bb",  # guillemets
    "a sign that says \uff02Joe's Diner\uff02",  # full-width quotation marks
])
def test_quoted_text_accepts_every_double_quote_form(prompt):
    assert normalize_text(quoted_text(prompt)) == "joe'sdiner"


@pytest.mark.parametrize("recognized,target", [
    ("Hello World", "Hello\u00a0World"),  # no-break space
    ("Hello World", "Hello\u3000World"),  # ideographic space
    ("Hello World", "Hello\u2009\u200bWorld"),  # thin space, zero-width space
    ("Hello World", "Hello\tWorld\n"),
    ("Hello World", "\uff28\uff45\uff4c\uff4c\uff4f World"),  # full-width letters
    ("Joe's Diner", "Joe\u2019s Diner"),  # right single quotation mark as apostrophe
    ("Joe\u2018s Diner", "Joe's Diner"),  # the reading has the curly form
    ("ON-SITE", "ON\u2013SITE"),  # en dash
    ("ON-SITE", "ON\u2011SITE"),  # non-breaking hyphen
    ("Wait...", "Wait\u2026"),  # ellipsis
    ("STRASSE", "Stra\u00dfe"),  # case folding, not only lower()
])
def test_every_unicode_form_of_whitespace_quotes_and_punctuation_matches(recognized, target):
    """Reading and target in different Unicode forms of the same text: a perfect match, reward 1."""
    pytest.importorskip("rapidfuzz")
    assert normalize_text(recognized) == normalize_text(target)
    assert ocr_text_reward(recognized, target) == 1.0
    assert ocr_text_reward(target, recognized) == 1.0


def test_punctuation_itself_still_counts():
    pytest.importorskip("rapidfuzz")
    assert ocr_text_reward("Open", "Open!") == pytest.approx(1 - 1 / 5)


@pytest.mark.parametrize("prompt", ["a cat on a mat", 'one "quote only', 'empty "" target', 'spaces "   " only'])
def test_prompt_without_quoted_text_is_an_error(prompt):
    with pytest.raises(ValueError, match="ocr reward"):
        quoted_text(prompt)


def test_bad_prompt_fails_before_any_ocr():
    reward = OcrReward()  # no setup: the prompt check comes first
    with pytest.raises(ValueError, match="'no quotes here'"):
        reward(torch.ones(1, 3, 64, 64), ["no quotes here"], [{}])


def test_images_become_bgr_uint8():
    image = torch.zeros(1, 3, 2, 2)
    image[0, 0] = 1.0  # pure red in RGB
    (bgr,) = images_to_bgr_uint8(image)
    assert bgr.dtype == np.uint8 and bgr.shape == (2, 2, 3) and bgr.flags["C_CONTIGUOUS"]
    assert bgr[0, 0].tolist() == [0, 0, 255]


def test_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'flowgrpo-rewards\[ocr\]'"):
        OcrReward().setup("cpu")


def test_entry_point_registers_ocr():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="flowgrpo.rewards")}
    assert "ocr" in eps and eps["ocr"].load() is OcrReward


# ------------------------------------------------------------------------------------------------------------
# end to end with RapidOCR on rendered text
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ocr_reward():
    pytest.importorskip("rapidocr_onnxruntime")
    pytest.importorskip("rapidfuzz")
    reward = OcrReward()
    reward.setup("cpu")
    return reward


def test_ocr_reads_rendered_text_and_scores_near_misses(ocr_reward):
    prompt = 'A neon sign that says "Hello World" above a cafe door'
    cases = [  # (lines rendered, expected reward by hand for the target "helloworld", 10 letters)
        (["Hello World"], 1.0),
        (["HELLO WORLD"], 1.0),  # case does not matter
        (["Hello", "World"], 1.0),  # two detected lines are joined in reading order
        (["Hello Wrld"], 0.9),  # one letter missing
        (["Hxllo Wxrld"], 0.8),  # two letters wrong
        ([], 0.0),  # blank image: nothing read
    ]
    images = torch.stack([render(lines) for lines, _ in cases])
    scores = ocr_reward(images, [prompt] * len(cases), [{}] * len(cases))
    assert scores.dtype == torch.float32 and scores.shape == (len(cases),)
    torch.testing.assert_close(scores, torch.tensor([e for _, e in cases], dtype=torch.float32), atol=1e-6, rtol=0)


def test_a_perfect_rendering_scores_1_whatever_unicode_form_the_prompt_uses(ocr_reward):
    """The image shows the plain ASCII text; the prompts quote it with curly quotes, no-break spaces, a curly
    apostrophe, an en dash, full-width letters or zero-width spaces."""
    cases = [
        ("Hello World", "a neon sign that says \u201cHello World\u201d"),
        ("Hello World", 'a neon sign that says "Hello\u00a0World"'),
        ("Hello World", "a neon sign that says \u201e\uff28\uff45llo World\u201c"),
        ("Hello World", 'a neon sign that says "Hello\u200b World"'),
        ("Joe's Diner", "a sign that says \u00abJoe\u2019s Diner\u00bb"),
        ("ON-SITE", 'a sign that says "ON\u2013SITE"'),
    ]
    images = torch.stack([render([text]) for text, _ in cases])
    scores = ocr_reward(images, [prompt for _, prompt in cases], [{}] * len(cases))
    torch.testing.assert_close(scores, torch.ones(len(cases)), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# the Reward protocol (flowgrpo's conformance suite)
# ------------------------------------------------------------------------------------------------------------

SIGN_WORDS = ["open", "cafe", "sale", "exit"]
NEAR_MISSES = ["opem", "cafes", "salt", "ex1t", ""]


def sign_images(n: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """n signs, each a random word (a target or a near miss), so that images score differently."""
    words = SIGN_WORDS + NEAR_MISSES
    picks = torch.randint(len(words), (n,), generator=generator).tolist()
    images = []
    for k in picks:
        image = Image.new("RGB", (width, height), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        font = ImageFont.load_default(size=int(height * 0.45))
        left, top, right, bottom = draw.textbbox((0, 0), words[k], font=font)
        xy = ((width - (right - left)) // 2 - left, (height - (bottom - top)) // 2 - top)
        draw.text(xy, words[k], fill=(0, 0, 0), font=font)
        images.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255)
    return torch.stack(images)


@pytest.mark.skipif(not HAVE_OCR_EXTRA, reason="the [ocr] extra (rapidocr-onnxruntime, rapidfuzz) is not installed")
class TestOcrConformance(RewardConformance):
    # small signs and a 256 px detector input keep the ~50 OCR calls of the suite fast
    reward_factory = staticmethod(lambda: OcrReward(engine_kwargs={"det_limit_side_len": 256}))
    image_factory = staticmethod(sign_images)
    prompt_factory = staticmethod(lambda n: [f'a shop sign that says "{SIGN_WORDS[i % 4]}"' for i in range(n)])
    image_size = (96, 256)
