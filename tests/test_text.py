"""The shared 8-bit quantisation (flowgrpo.images.to_uint8) and the canonical text form (flowgrpo.text.fold_text),
against values worked out by hand."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.images import to_uint8
from flowgrpo.text import fold_text


def test_to_uint8_is_round_255_x_clamped_channels_last():
    x = torch.zeros(1, 3, 1, 6)
    x[0, 0, 0] = torch.tensor([-0.2, 0.0, 1 / 255, 0.5, 1.0, 1.7])
    x[0, 1, 0] = torch.tensor([0.5 / 255, 1.5 / 255, 2.5 / 255, 254.4 / 255, 254.6 / 255, 0.25])
    out = to_uint8(x)
    assert out.dtype == np.uint8 and out.shape == (1, 1, 6, 3) and out.flags["C_CONTIGUOUS"]
    # 0.5 * 255 = 127.5 rounds half to even -> 128; 0.25 * 255 = 63.75 -> 64
    assert out[0, 0, :, 0].tolist() == [0, 0, 1, 128, 255, 255]
    # 0.5, 1.5, 2.5 (as float32 products) round half to even: 0, 2, 2
    assert out[0, 0, :, 1].tolist() == [0, 2, 2, 254, 255, 64]
    assert to_uint8(x[0]).shape == (1, 6, 3)  # a single (3, H, W) image


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, 1, 4, 4),
                                 torch.full((1, 3, 2, 2), float("nan")), np.zeros((1, 3, 2, 2))])
def test_to_uint8_refuses_what_has_no_8bit_form(bad):
    with pytest.raises(ValueError, match="to_uint8"):
        to_uint8(bad)


def test_every_writer_of_8bit_pixels_uses_the_same_quantisation():
    """The PNG wire format, JPEG sizes and saved samples all see to_uint8's pixels."""
    from flowgrpo.rewards.remote import images_to_png_b64, png_b64_to_images

    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    back = png_b64_to_images(images_to_png_b64(images))
    assert torch.equal((back * 255).round().to(torch.uint8).permute(0, 2, 3, 1), torch.from_numpy(to_uint8(images)))
    jpeg = pytest.importorskip("flowgrpo_rewards.jpeg")
    buf = io.BytesIO()
    Image.fromarray(to_uint8(images[0])).save(buf, format="JPEG", quality=95)
    assert float(jpeg.jpeg_size_kb(images[:1])[0]) == pytest.approx(buf.tell() / 1000.0)


@pytest.mark.parametrize("text,expected", [
    ("Hello World", "hello world"),
    ("  Hello \t\n World  ", "hello world"),  # whitespace runs
    ("Hello\u00a0World", "hello world"),  # no-break space
    ("Hello\u3000World", "hello world"),  # ideographic space
    ("Hello\u2009World", "hello world"),  # thin space
    ("Hel\u200blo", "hello"),  # zero-width space (format character) removed
    ("soft\u00adhyphen", "softhyphen"),
    ("\u201cQuoted\u201d", '"quoted"'),
    ("\u201eGerman\u201c \u00abFrench\u00bb \uff02Wide\uff02", '"german" "french" "wide"'),
    ("Joe\u2019s \u2018x\u2019", "joe's 'x'"),
    ("a\u2013b\u2014c\u2212d\u2011e", "a-b-c-d-e"),
    ("\uff21\uff11\uff01", "a1!"),  # full-width letters, digit, exclamation mark
    ("Wait\u2026", "wait..."),
    ("\ufb01ne", "fine"),  # ligature
    ("Stra\u00dfe", "strasse"),  # case folding
    ("\u7ec8\u3002\u597d\u3001", "\u7ec8.\u597d,"),  # ideographic full stop and comma
    ("Open!", "open!"),  # punctuation itself is kept
])
def test_fold_text_by_hand(text, expected):
    assert fold_text(text) == expected


def test_fold_text_is_idempotent_and_rejects_non_strings():
    for text in ["\u201cA\u00a0b\u201d", "x\u2026", "\uff21"]:
        assert fold_text(fold_text(text)) == fold_text(text)
    with pytest.raises(TypeError, match="str"):
        fold_text(b"bytes")


# --- one rule for an empty prompt and for quoted text (issue 38, case 6) ----------------------------------------
@pytest.mark.parametrize("blank", ["", "   ", "\t\n", "\u00a0\u3000", "\u200b", "\ufeff \u200d"])
def test_a_blank_jsonl_prompt_is_an_error_naming_file_and_line(tmp_path, blank):
    import json

    from flowgrpo.data.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a cat"}) + "\n\n" + json.dumps({"prompt": blank, "x": 1}) + "\n",
                    encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}:3: the prompt .* is empty"):
        load_prompts(str(path))


def test_a_text_files_blank_lines_are_skipped_by_the_same_rule(tmp_path):
    from flowgrpo.data.prompts import load_prompts

    path = tmp_path / "p.txt"
    path.write_text("a cat\n\n   \n\u200b\n\u3000\n  a dog  \n", encoding="utf-8")
    assert load_prompts(str(path)).prompts == ["a cat", "a dog"]


@pytest.mark.parametrize("prompt, quoted", [
    ('a sign "OPEN" and "CLOSED"', "OPEN"),
    ("a sign \u201cCaf\u00e9\u201d", "Caf\u00e9"),  # typographic quotes
    ("ein Schild \u201eHallo\u201c", "Hallo"),
    ("une affiche \u00abBonjour\u00bb", "Bonjour"),
    ("a mug \uff02Tea\uff02", "Tea"),
    ('a mug printed with ""', None),
    ("a blank sign \u201c \u200b \u201d", None),
    ('one "quote only', None),
    ("Joe\u2019s diner, no double quotes", None),
])
def test_quoted_text_is_one_rule_for_the_prompt_set_and_the_reward(tmp_path, prompt, quoted):
    from flowgrpo.data.public_prompts import ocr_prompts
    from flowgrpo.text import quoted_text

    assert quoted_text(prompt) == quoted
    src = tmp_path / "ocr.txt"
    src.write_text(prompt + "\n", encoding="utf-8")
    assert ocr_prompts([src]) == ([prompt] if quoted else [])
    ocr = pytest.importorskip("flowgrpo_rewards.ocr")
    if quoted is None:
        with pytest.raises(ValueError, match="ocr reward"):
            ocr.quoted_text(prompt)
    else:
        assert ocr.quoted_text(prompt) == quoted
