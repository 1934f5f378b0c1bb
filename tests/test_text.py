"""The canonical text form (flowgrpo.text.fold_text) against values worked out by hand, and its one rule for an
empty prompt (flowgrpo.data.prompts) and for quoted text (the OCR prompt set and the OCR reward)."""

from __future__ import annotations

import pytest

from flowgrpo.text import fold_text


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
    # unit marks are not quote marks when the prompt quotes its text elsewhere (issue 42, case 4)
    ('a shop sign 5\u2033 wide reading "SALE"', "SALE"),  # the case: double prime (inches)
    ("a shop sign 5\u2036 wide reading \u201cSALE\u201d", "SALE"),  # reversed double prime
    ('a shop sign 5" wide reading "SALE"', "SALE"),  # a straight inch mark after a number
    ('a 5" by 7" card reading "SALE"', "SALE"),
    ('a 12.5" ruler', None),
    ('a 5" by 7" card', None),  # two inch marks quote nothing
    ('a sign reading "2024"', "2024"),  # a quote closed after a digit
    ('a race lasting 9.58\u2033 on a board "FAST"', "FAST"),  # seconds
    ("a sign \u2033SALE\u2033", "SALE"),  # double primes typed as the only quotes are quotes
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
