"""Image-conditioned prompt records: paths resolved against the prompt file, clear errors, and conditioning
encoded once per distinct (prompt, images) and shared by the group."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from flowgrpo.data.prompts import load_prompts
from flowgrpo.models.base import PromptEmbeds
from flowgrpo.sampling.rollout import encode_rows


def _png(path, colour):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_image_paths_are_resolved_against_the_prompt_file(tmp_path):
    _png(tmp_path / "data" / "src" / "a.png", "red")
    _png(tmp_path / "data" / "src" / "b.png", "blue")
    f = _jsonl(tmp_path / "data" / "edits.jsonl", [
        {"prompt": "make it blue", "image": "src/a.png", "tag": 1},
        {"prompt": "merge them", "images": ["src/a.png", "src/b.png"]},
        {"prompt": "a plain prompt"},
    ])
    ps = load_prompts(str(f))
    assert ps.prompts == ["make it blue", "merge them", "a plain prompt"]
    src = tmp_path / "data" / "src"
    assert ps.metadata[0] == {"tag": 1, "images": [str((src / "a.png").resolve())]}
    assert ps.metadata[1] == {"images": [str((src / "a.png").resolve()), str((src / "b.png").resolve())]}
    assert ps.metadata[2] == {}


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "x", "image": "missing.png"}, r"edits.jsonl:1: conditioning image 'missing.png' not found"),
    ({"prompt": "x", "image": "a.png", "images": ["a.png"]}, "not both"),
    ({"prompt": "x", "images": []}, "non-empty list of paths"),
    ({"prompt": "x", "image": 3}, "must be a path"),
])
def test_bad_image_fields_are_errors_naming_the_line(tmp_path, record, message):
    _png(tmp_path / "a.png", "red")
    with pytest.raises(ValueError, match=message):
        load_prompts(str(_jsonl(tmp_path / "edits.jsonl", [record])))


class _EditStub:
    """An image-conditioned adapter that records what it is asked to encode; row i's embedding is i."""

    image_conditioned = True

    def __init__(self):
        self.calls = []

    def encode_prompts(self, prompts, images=None):
        self.calls.append((list(prompts), [[im.getpixel((0, 0)) for im in imgs] for imgs in images]))
        return PromptEmbeds({"e": torch.arange(len(prompts), dtype=torch.float32)[:, None]})


def test_each_distinct_prompt_and_source_is_encoded_once(tmp_path):
    _png(tmp_path / "a.png", (255, 0, 0))
    _png(tmp_path / "b.png", (0, 0, 255))
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    # two groups with the same instruction on different sources, G = 2 each
    prompts = ["make it green"] * 4
    meta = [{"images": [a]}, {"images": [a]}, {"images": [b]}, {"images": [b]}]
    stub = _EditStub()
    rows = encode_rows(stub, prompts, meta)
    assert stub.calls == [(["make it green"] * 2, [[(255, 0, 0)], [(0, 0, 255)]])]
    assert rows["e"][:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]  # the group shares its row; the sources differ


def test_an_editing_model_needs_a_source_per_record():
    with pytest.raises(ValueError, match="conditions every sample on an image \\(the image it edits\\), but the prompt "
                       "record 'make it green' has none: write the prompt file as JSONL .* e.g. \\{\"prompt\": "
                       "\"make it green\", \"image\": \"sources/0001.png\"\\}"):
        encode_rows(_EditStub(), ["make it green"], [{}])
