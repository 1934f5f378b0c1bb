"""GenEval-style training prompts: disjoint from the evaluation set, seeded, parseable; the overlap check."""

from __future__ import annotations

import itertools
import json

import pytest
from flowgrpo_rewards.geneval.prompts import (
    TRAINING_TASKS,
    check_overlap,
    generate_training_prompts,
    main,
    parse_prompt,
    prompt_key,
)
from flowgrpo_rewards.geneval.rules import evaluation_metadata, object_names, validate_metadata


def unordered(spec):
    """Object-order-free identity of a spec, written independently of prompt_key."""
    return spec["tag"], frozenset((c["class"], c["count"], c.get("color")) for c in spec["include"])


def test_parser_recovers_every_evaluation_spec_exactly():
    for spec in evaluation_metadata():
        parsed = parse_prompt(spec["prompt"])
        assert parsed is not None, spec["prompt"]
        assert parsed["tag"] == spec["tag"]
        assert parsed["include"] == spec["include"], spec["prompt"]
        assert parsed.get("exclude") == spec.get("exclude"), spec["prompt"]


def test_parser_examples_and_non_geneval_text():
    assert parse_prompt("A photo of three buses.")["include"] == [{"class": "bus", "count": 3}]
    assert parse_prompt("a photo of an orange")["tag"] == "single_object"
    orange_car = [{"class": "car", "count": 1, "color": "orange"}]
    assert parse_prompt("a photo of an orange car")["include"] == orange_car
    assert parse_prompt("a photo of an orange and a car")["tag"] == "two_object"
    assert parse_prompt("a dog sitting on a sofa") is None
    assert parse_prompt("a photo of a unicorn") is None


def test_generated_prompts_avoid_the_evaluation_set_and_are_valid():
    specs = generate_training_prompts(per_task=150, seed=0)
    assert len(specs) == 150 * len(TRAINING_TASKS)
    eval_ids = {unordered(s) for s in evaluation_metadata()}
    eval_pairs = {frozenset(c["class"] for c in s["include"])
                  for s in evaluation_metadata() if s["tag"] == "position"}
    for task in TRAINING_TASKS:
        mine = [s for s in specs if s["tag"] == task]
        assert len(mine) == 150 and len({unordered(s) for s in mine}) == 150
    for s in specs:
        validate_metadata(s, s["prompt"])
        assert unordered(s) not in eval_ids
        if s["tag"] == "position":  # no relation at all between an evaluated pair
            assert frozenset(c["class"] for c in s["include"]) not in eval_pairs
        if s["tag"] in ("colors", "color_attr"):
            assert all(c["class"] != "person" for c in s["include"])
        assert parse_prompt(s["prompt"])["include"] == s["include"]  # the text says what the metadata says
    assert check_overlap(specs) == []
    assert check_overlap([s["prompt"] for s in specs]) == []


def test_generator_is_seeded():
    a = generate_training_prompts(per_task=20, seed=3)
    assert a == generate_training_prompts(per_task=20, seed=3)
    assert a != generate_training_prompts(per_task=20, seed=4)


def test_counting_space_is_exhausted_exactly():
    # all (object, n) for n in 2..4, minus the evaluation ones: computed here from the data
    evaluated = {(s["include"][0]["class"], s["include"][0]["count"]) for s in evaluation_metadata()
                 if s["tag"] == "counting"}
    free = {(k, n) for k, n in itertools.product(object_names(), (2, 3, 4))} - evaluated
    specs = generate_training_prompts(per_task=len(free), seed=0, tasks=["counting"])
    assert {(s["include"][0]["class"], s["include"][0]["count"]) for s in specs} == free
    assert all(s["exclude"] == [{"class": s["include"][0]["class"], "count": s["include"][0]["count"] + 1}]
               for s in specs)
    with pytest.raises(ValueError, match=f"only {len(free)} distinct.*allow_fewer"):
        generate_training_prompts(per_task=len(free) + 1, seed=0, tasks=["counting"])
    capped = generate_training_prompts(per_task=1000, seed=0, tasks=["counting", "colors"], allow_fewer=True)
    assert {(s["include"][0]["class"], s["include"][0]["count"]) for s in capped if s["tag"] == "counting"} == free
    assert sum(s["tag"] == "colors" for s in capped) == 79 * 10 - 94  # no person; all 94 colour prompts differ


def test_single_object_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="single_object"):
        generate_training_prompts(per_task=1, tasks=["single_object"])
    with pytest.raises(ValueError, match="unknown task 'shapes'"):
        generate_training_prompts(per_task=1, tasks=["shapes"])
    with pytest.raises(ValueError, match="max_count"):
        generate_training_prompts(per_task=1, max_count=1)


def test_check_overlap_ignores_object_order_and_relation():
    flagged = check_overlap([
        "a photo of a bench and a sports ball",  # an evaluation prompt verbatim
        "A photo of a sports ball and a bench.",  # reordered, other case and a full stop
        "a photo of a teddy bear left of a dog",  # evaluated: "a dog right of a teddy bear"
        "a photo of a teddy bear above a dog",  # any relation between the same two objects
        "a photo of a bench",  # every single-object prompt is evaluated
        "a photo of a giraffe and a toaster",  # not evaluated (checked below)
        "a photo of four cows",
        "a dog sitting on a sofa",
        {"prompt": "x", "tag": "two_object",
         "include": [{"class": "sports ball", "count": 1}, {"class": "bench", "count": 1}]},
    ])
    assert flagged == [
        "a photo of a bench and a sports ball",
        "A photo of a sports ball and a bench.",
        "a photo of a teddy bear left of a dog",
        "a photo of a teddy bear above a dog",
        "a photo of a bench",
        "x",
    ]
    ids = {unordered(s) for s in evaluation_metadata()}
    assert ("two_object", frozenset({("giraffe", 1, None), ("toaster", 1, None)})) not in ids
    assert ("counting", frozenset({("cow", 4, None)})) not in ids


def test_prompt_key_needs_metadata():
    with pytest.raises(ValueError, match="'include'"):
        prompt_key({"tag": "colors"})


def test_cli_writes_jsonl(tmp_path):
    out = tmp_path / "train.jsonl"
    main([str(out), "--per-task", "3", "--seed", "1", "--tasks", "colors", "position"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["tag"] for s in lines] == ["colors"] * 3 + ["position"] * 3
    assert lines == generate_training_prompts(per_task=3, seed=1, tasks=["colors", "position"])


def test_cli_replaces_an_existing_file_only_with_overwrite(tmp_path, capsys):
    """flowgrpo's write rule (flowgrpo.writing.outputs); before: OUT was replaced without a word."""
    out = tmp_path / "train.jsonl"
    out.write_text("my own specs\n")
    with pytest.raises(SystemExit) as info:
        main([str(out), "--per-task", "1", "--tasks", "colors"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert info.value.code == 2 and len(errors) == 1 and errors[0].endswith(
        f"error: out {str(out)!r} exists and flowgrpo does not replace a file unasked: nothing was written; choose "
        "another path, or give --overwrite to replace it")
    assert out.read_text() == "my own specs\n"
    main([str(out), "--per-task", "1", "--tasks", "colors", "--overwrite"])
    assert [json.loads(line)["tag"] for line in out.read_text().splitlines()] == ["colors"]


@pytest.mark.parametrize("name", ["geneval", "geneval_strict"])
def test_the_reward_warns_at_setup_when_training_prompts_overlap_the_evaluation_set(name, caplog):
    """The trainer's ``check_training_prompts`` hook (flowgrpo.rewards.base): one warning naming the prompt file,
    the count and the first overlapping prompt; silence for prompts disjoint from the evaluation set."""
    import logging

    from flowgrpo_rewards.geneval.reward import GenEvalReward, GenEvalStrictReward

    from flowgrpo.data.prompts import PromptSet

    reward = {"geneval": GenEvalReward, "geneval_strict": GenEvalStrictReward}[name]()  # no weights load
    texts = ["a dog sitting on a sofa", "A photo of a sports ball and a bench.", "a photo of a bench"]
    with caplog.at_level(logging.WARNING):
        reward.check_training_prompts(PromptSet(texts, [{}] * 3, "mine.txt"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("2 training prompts of 'mine.txt' overlap GenEval's evaluation set (e.g. "
                                  "'A photo of a sports ball and a bench.')")
    caplog.clear()
    specs = generate_training_prompts(per_task=2, seed=0)
    with caplog.at_level(logging.WARNING):
        reward.check_training_prompts(PromptSet([s["prompt"] for s in specs], [dict(s) for s in specs], "gen"))
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
