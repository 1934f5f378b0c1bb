"""``eval/geneval.py`` and the ``geneval`` reward: the official folder layout, the summary arithmetic, clear
errors on bad folders, and the whole pipeline end to end on tiny random models, offline."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from flowgrpo_rewards.geneval import evaluation as ev  # noqa: E402
from flowgrpo_rewards.geneval.rules import TASKS, evaluation_metadata  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load_cli():
    spec = importlib.util.spec_from_file_location("geneval_cli", ROOT / "eval" / "geneval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = load_cli()


def first_of_each_task():
    """(index, spec) of the first evaluation prompt of each task."""
    seen, out = set(), []
    for i, s in enumerate(evaluation_metadata()):
        if s["tag"] not in seen:
            seen.add(s["tag"])
            out.append((i, s))
    return out


def write_random_folder(folder, prompts, samples=2, size=48, seed=0):
    rng = np.random.default_rng(seed)
    for index, spec in prompts:
        ev.write_metadata(folder, index, spec)
        for j in range(samples):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            ev.write_sample(folder, index, j, Image.fromarray(pixels))


# ------------------------------------------------------------------------------------------------------------
# Summary arithmetic


def test_summary_of_a_hand_made_results_file(tmp_path):
    # (tag, prompt, per-image verdicts)
    table = [
        ("single_object", "A", [True, False]), ("single_object", "B", [False, False]),  # 1/4
        ("two_object", "C", [True, True]),  # 2/2
        ("counting", "D", [False, False]),  # 0/2
        ("colors", "E", [True, False]),  # 1/2
        ("position", "F", [False, True]), ("position", "G", [True, True]),  # 3/4
        ("color_attr", "H", [False, False]),  # 0/2
    ]
    path = tmp_path / "results.jsonl"
    with open(path, "w") as f:
        for tag, prompt, verdicts in table:
            for j, ok in enumerate(verdicts):
                meta = json.dumps({"tag": tag, "prompt": prompt})
                row = {"filename": f"{prompt}/{j}.png", "tag": tag, "prompt": prompt, "correct": ok,
                       "reason": "", "metadata": meta, "details": "{}"}
                f.write(json.dumps(row) + "\n")
    s = ev.summarize(ev.read_results(path))
    assert s["images"] == 16 and s["prompts"] == 8
    assert {t: v["accuracy"] for t, v in s["tasks"].items()} == pytest.approx(
        {"single_object": 0.25, "two_object": 1.0, "counting": 0.0, "colors": 0.5, "position": 0.75,
         "color_attr": 0.0})
    assert s["overall"] == pytest.approx(2.5 / 6)  # unweighted mean of the six, not 7/16
    assert s["correct_images"] == pytest.approx(7 / 16)
    assert s["prompts_any_correct"] == pytest.approx(5 / 8)  # A, C, E, F, G
    assert s["missing_tasks"] == []
    text = ev.format_summary(s)
    assert "| position | 0.7500 | 3 / 4 |" in text and "0.4167" in text and "62.50%" in text


def test_overall_is_numpy_mean_of_task_accuracies_in_order_of_appearance():
    """summary_scores.py: task accuracies in groupby(sort=False) order (first appearance), then np.mean. With these
    counts that differs in the last bit from an exact (fsum) sum."""
    counts = {"single_object": (5, 5), "two_object": (1, 10), "counting": (0, 7), "colors": (2, 2),
              "position": (0, 9), "color_attr": (5, 9)}
    order = ["counting", "colors", "position", "two_object", "color_attr", "single_object"]
    rows = [{"tag": t, "prompt": f"{t}{i}", "correct": i < counts[t][0]} for t in order for i in range(counts[t][1])]
    expected = float(np.mean([counts[t][0] / counts[t][1] for t in order]))
    s = ev.summarize(rows)
    assert s["overall"] == expected
    assert expected != math.fsum(counts[t][0] / counts[t][1] for t in TASKS) / 6  # an exact sum differs here
    assert list(s["tasks"]) == list(TASKS)  # the table stays in GenEval's task order


def test_summary_with_missing_tasks_and_bad_rows(tmp_path):
    rows = [{"tag": "colors", "prompt": "a", "correct": True},
            {"tag": "counting", "prompt": "b", "correct": False}]
    s = ev.summarize(rows)
    assert s["overall"] == pytest.approx(0.5)
    assert s["missing_tasks"] == ["single_object", "two_object", "position", "color_attr"]
    with pytest.raises(ValueError, match="unknown tag 'shapes'"):
        ev.summarize([{"tag": "shapes", "correct": True}])
    bad = tmp_path / "r.jsonl"
    bad.write_text('{"tag": "colors", "correct": true}\n{"tag": "colors"\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2"):
        ev.read_results(bad)


# ------------------------------------------------------------------------------------------------------------
# Folder layout


def test_official_layout_round_trip(tmp_path):
    spec = evaluation_metadata()[3]
    d = ev.write_metadata(tmp_path, 3, spec)
    for j in range(3):
        ev.write_sample(tmp_path, 3, j, Image.new("RGB", (8, 8), (j, 0, 0)))
    assert d == tmp_path / "00003"
    assert json.loads((d / "metadata.jsonl").read_text()) == spec
    assert sorted(p.name for p in (d / "samples").iterdir()) == ["0000.png", "0001.png", "0002.png"]
    (d / "grid.png").write_bytes(b"ignored")  # the original generator also writes a grid; it is not a sample
    (tmp_path / "notes").mkdir()  # non-digit folders are ignored, as in the original
    [folder] = ev.read_folder(tmp_path)
    assert folder.index == 3 and folder.metadata == spec
    assert [p.name for p in folder.images] == ["0000.png", "0001.png", "0002.png"]
    assert ev.load_image(folder.images[2]).getpixel((0, 0)) == (2, 0, 0)


def test_malformed_metadata_names_the_file(tmp_path):
    write_random_folder(tmp_path, first_of_each_task()[:2], samples=1, size=8)
    bad = tmp_path / "00080" / "metadata.jsonl"
    bad.write_text('{"tag": "two_object", "include": [')
    with pytest.raises(ValueError, match=r"00080/metadata\.jsonl: malformed metadata"):
        ev.read_folder(tmp_path)
    bad.write_text('{"tag": "two_object", "prompt": "x"}')
    with pytest.raises(ValueError, match=r"00080/metadata\.jsonl: missing field 'include'"):
        ev.read_folder(tmp_path)
    bad.unlink()
    with pytest.raises(FileNotFoundError, match=r"00080/metadata\.jsonl"):
        ev.read_folder(tmp_path)


def test_malformed_prompt_file_names_file_and_line(tmp_path):
    good = json.dumps(evaluation_metadata()[0])
    path = tmp_path / "prompts.jsonl"
    path.write_text(good + "\n" + '{"tag": "colors", "include": [}' + "\n")
    with pytest.raises(ValueError, match=r"prompts\.jsonl:2: not valid JSON"):
        cli.load_specs(path)
    path.write_text(good + "\n\n" + json.dumps({"tag": "colors", "include": [{"class": "car", "count": 1}]}))
    with pytest.raises(ValueError, match=r"prompts\.jsonl:3: missing field 'prompt'"):
        cli.load_specs(path)
    assert cli.select_prompts(cli.load_specs(None), 2)[:3] == [(0, evaluation_metadata()[0]),
                                                                (1, evaluation_metadata()[1]),
                                                                (80, evaluation_metadata()[80])]


def test_missing_image_names_the_file(tmp_path):
    write_random_folder(tmp_path, first_of_each_task()[:1], samples=3, size=8)
    (tmp_path / "00000" / "samples" / "0001.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing image .*00000/samples/0001\.png"):
        ev.read_folder(tmp_path)
    for p in (tmp_path / "00000" / "samples").iterdir():
        p.unlink()
    with pytest.raises(FileNotFoundError, match=r"00000/samples/0000\.png"):
        ev.read_folder(tmp_path)
    (tmp_path / "00000" / "samples").rmdir()
    with pytest.raises(FileNotFoundError, match=r"00000/samples"):
        ev.read_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ev.read_folder(tmp_path / "nope")
    with pytest.raises(ValueError, match="no prompt folders"):
        ev.read_folder(tmp_path / "00000")
    corrupt = tmp_path / "x.png"
    corrupt.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"x\.png: not a readable image"):
        ev.load_image(corrupt)


def test_cli_reports_a_bad_folder_before_loading_models(tmp_path, capsys):
    write_random_folder(tmp_path, first_of_each_task()[:1], samples=2, size=8)
    (tmp_path / "00000" / "samples" / "0000.png").unlink()
    with pytest.raises(SystemExit) as info:  # one line and exit status 2, no traceback (a missing image)
        cli.main(["--images", str(tmp_path), "--detector", str(tmp_path / "no-such-model")])
    assert info.value.code == 2
    assert re.match(r"geneval\.py: error: .*00000/samples/0000\.png", capsys.readouterr().err.strip())
    for bad, why in ((tmp_path / "nope", "does not exist"), (tmp_path / "00000" / "samples", "has no prompt folders")):
        with pytest.raises(SystemExit) as info:  # a missing folder, one of the wrong layout: were tracebacks
            cli.main(["--images", str(bad)])
        assert info.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--images", str(tmp_path), "--model", "tiny"])
    assert "not both" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# End to end on tiny models


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """FLOWGRPO_CACHE in a temporary folder, with the tiny scorer models built there."""
    old = os.environ.get("FLOWGRPO_CACHE")
    os.environ["FLOWGRPO_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield cli.tiny_scorer_models()
    finally:
        if old is None:
            del os.environ["FLOWGRPO_CACHE"]
        else:
            os.environ["FLOWGRPO_CACHE"] = old


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_tiny_scoring_of_an_existing_folder(tiny_cache, tmp_path):
    prompts = first_of_each_task()
    images = tmp_path / "images"
    write_random_folder(images, prompts, samples=2)
    # official thresholds: a random detector finds nothing, so every verdict is "not found"
    summary = cli.main(["--images", str(images), "--tiny", "--outdir", str(tmp_path / "a"),
                        "--device", "cpu"])
    rows = read_jsonl(tmp_path / "a" / "results.jsonl")
    assert len(rows) == 12 and summary["images"] == 12 and summary["overall"] == 0.0
    assert set(rows[0]) >= {"filename", "tag", "prompt", "correct", "reason", "details"}
    assert [r["index"] for r in rows] == [i for i, _ in prompts for _ in range(2)]
    assert all(r["reason"].startswith("expected ") and json.loads(r["details"]) == {} for r in rows)
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["tasks"].keys() == set(TASKS)
    assert (tmp_path / "a" / "summary.md").read_text().startswith("| task |")

    # thresholds 0: every detection passes, so colours and positions are classified too
    cli.main(["--images", str(images), "--tiny", "--outdir", str(tmp_path / "b"), "--threshold", "0",
              "--counting-threshold", "0"])
    rows = read_jsonl(tmp_path / "b" / "results.jsonl")
    assert all(json.loads(r["details"]) for r in rows)
    colour_checked = 0
    for r in rows:
        spec, found = json.loads(r["metadata"]), json.loads(r["details"])
        for clause in spec["include"]:
            if "color" in clause and len(found.get(clause["class"], [])) >= clause["count"]:
                colour_checked += 1
                # the verdict names the colour unless the colour was right
                wrong = f"expected {clause['color']} {clause['class']}>=" in r["reason"]
                assert wrong or r["reason"] == "" or clause["class"] not in r["reason"]
    assert colour_checked > 0


def test_tiny_generation_end_to_end(tiny_cache, tmp_path):
    pytest.importorskip("flowgrpo.sampling.rollout")
    out = tmp_path / "run"
    summary = cli.main(["--tiny", "--outdir", str(out), "--per-task", "1", "--samples", "2", "--steps", "2",
                        "--device", "cpu"])
    folders = ev.read_folder(out / "images")
    assert [(f.index, f.metadata) for f in folders] == first_of_each_task()
    assert all(len(f.images) == 2 for f in folders)
    assert Image.open(folders[0].images[0]).size == (64, 64)
    assert summary["images"] == 12 and len(read_jsonl(out / "results.jsonl")) == 12
    # a second run resumes: the images exist, nothing is regenerated
    before = {p: p.stat().st_mtime_ns for f in folders for p in f.images}
    cli.main(["--tiny", "--outdir", str(out), "--per-task", "1", "--samples", "2", "--steps", "2"])
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_tiny_generation_with_a_lora(tiny_cache, tmp_path):
    """--lora loads a LoRA saved by flowgrpo: the images are those of the adapter that was saved."""
    pytest.importorskip("flowgrpo.sampling.rollout")
    from flowgrpo_rewards.geneval.reward import to_pil

    from flowgrpo.models import load_model
    from flowgrpo.models.base import lora_disabled
    from flowgrpo.models.lora import save_lora, setup_trainable
    from flowgrpo.rng import derive_seed
    from flowgrpo.sampling.rollout import generate_images

    adapter = load_model("tiny", height=64, width=64)
    setup_trainable(adapter, finetune="lora", rank=4, alpha=8.0, target_modules=["to_q", "to_k", "to_v"],
                    need_reference=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:  # B starts at zero; make the LoRA change the output
                param.copy_(5.0 * torch.randn(param.shape, generator=gen))
    save_lora(adapter, tmp_path / "lora")
    out = tmp_path / "run"
    cli.main(["--tiny", "--lora", str(tmp_path / "lora"), "--outdir", str(out), "--per-task", "1",
              "--samples", "1", "--steps", "2"])
    prompts = first_of_each_task()
    saved = [np.asarray(Image.open(f.images[0]), dtype=np.int16) for f in ev.read_folder(out / "images")]
    texts, seeds = [s["prompt"] for _, s in prompts], [derive_seed(0, i, 0) for i, _ in prompts]
    with_lora = generate_images(adapter, texts, seeds, num_steps=2, guidance_scale=3.5)
    with lora_disabled(adapter.transformer):
        base = generate_images(adapter, texts, seeds, num_steps=2, guidance_scale=3.5)
    for png, a, b in zip(saved, to_pil(with_lora), to_pil(base), strict=True):
        assert np.abs(png - np.asarray(a, dtype=np.int16)).max() <= 1  # equal up to 8-bit rounding
        assert np.abs(png - np.asarray(b, dtype=np.int16)).mean() > 2  # and not the base model's image


def test_reward_strict_agrees_with_the_evaluation_and_partial_is_in_range(tiny_cache, tmp_path):
    from flowgrpo.rewards.registry import load_reward

    detector, clip = tiny_cache
    kwargs = dict(detector=detector, clip_model=clip, clip_pretrained=None, image_scale=[64, 64],
                  threshold=0.0, counting_threshold=0.0)
    strict, origin = load_reward("geneval_strict", **kwargs)
    partial, _ = load_reward("geneval", **kwargs)
    assert origin.distribution == "flowgrpo-rewards"
    strict.setup(torch.device("cpu"))
    partial.setup(torch.device("cpu"))
    prompts = first_of_each_task()
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (len(prompts), 3, 48, 48), generator=gen).float() / 255  # 8-bit values
    metadata = [{k: v for k, v in s.items() if k != "prompt"} for _, s in prompts]
    texts = [s["prompt"] for _, s in prompts]
    s_scores = strict(images, texts, metadata)
    p_scores = partial(images, texts, metadata)
    assert s_scores.dtype == torch.float32 and s_scores.shape == (6,)
    assert set(s_scores.tolist()) <= {0.0, 1.0}
    assert ((p_scores >= 0) & (p_scores <= 1)).all() and (p_scores >= s_scores).all()
    # the same images through the folder path of eval/geneval.py
    folder = tmp_path / "images"
    from flowgrpo_rewards.geneval.reward import to_pil

    for (index, spec), image in zip(prompts, to_pil(images), strict=True):
        ev.write_metadata(folder, index, spec)
        ev.write_sample(folder, index, 0, image)
    cli.main(["--images", str(folder), "--tiny", "--threshold", "0", "--counting-threshold", "0"])
    verdicts = [r["correct"] for r in read_jsonl(tmp_path / "images_geneval" / "results.jsonl")]  # never the input
    assert verdicts == [bool(v) for v in s_scores.tolist()]

    # behind flowgrpo's reward server (PNG over HTTP): the same scores, and bad metadata is still a ValueError
    pytest.importorskip("fastapi")
    from flowgrpo.rewards.remote import RemoteReward
    from flowgrpo.rewards.server import ServerThread, create_app

    with ServerThread(create_app(partial, reward_name="geneval", device=None)) as srv:
        remote = RemoteReward(srv.url)
        remote.setup("cpu")
        assert torch.equal(remote(images, texts, metadata), p_scores)  # the images are 8-bit already
        with pytest.raises(ValueError, match="missing field 'tag'"):
            remote(images[:1], texts[:1], [{"include": metadata[0]["include"]}])


def test_reward_input_errors():
    from flowgrpo_rewards.geneval.reward import GenEvalReward, GenEvalStrictReward

    reward = GenEvalReward()  # no weights load before setup
    with pytest.raises(ValueError, match=r"metadata\[1\]: missing field 'include'"):
        good = {"tag": "colors", "include": [{"class": "car", "count": 1}]}
        reward(torch.zeros(2, 3, 8, 8), ["a", "b"], [good, {"tag": "colors"}])
    with pytest.raises(ValueError, match="mode must be one of"):
        GenEvalReward(mode="soft")
    with pytest.raises(ValueError, match="geneval_strict"):
        GenEvalStrictReward(mode="partial")


def test_results_never_go_into_the_scored_folder_nor_a_users_folder(tmp_path, capsys):
    """flowgrpo's write rule (flowgrpo.writing.outputs), checked before any model loads. Before: results.jsonl,
    summary.json and summary.md went into the scored image folder (by default) or any --outdir."""
    images = tmp_path / "images"
    write_random_folder(images, first_of_each_task()[:1], samples=1)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.jsonl").write_text("my results\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for outdir, why in ((images, "is also an input of this command"), (mine, "is not empty and was not made by")):
        with pytest.raises(SystemExit) as info:
            cli.main(["--images", str(images), "--tiny", "--outdir", str(outdir), "--device", "cpu"])
        err = capsys.readouterr().err.strip().splitlines()
        assert info.value.code == 2 and err[-1].startswith(f"geneval.py: error: --outdir {str(outdir)!r} ")
        assert why in err[-1] and sum("error" in line for line in err) == 1
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
