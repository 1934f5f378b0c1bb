"""The dataset layouts and the converters from public formats (flowgrpo/data/image_sets.py), on files written here
by hand: Pick-a-Pic's label convention (label_0 = 1: jpg_0 preferred; 0.5 a tie, dropped; Diffusion-DPO train.py
782–784, 857), ranked lists (rank 1 the best), an imagefolder's metadata.jsonl; images of the wrong size refused.
The adapters' encode_images is the VAE's posterior mode, shifted and scaled, in the transformer's layout."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.data.image_sets import (
    load_image,
    read_imagefolder,
    read_pickapic,
    read_ranked,
    write_image_set,
    write_preference_set,
)
from flowgrpo.data.prompts import load_prompts


def _png(value: int, size=(4, 4)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((*size, 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _grey(path) -> int:
    return int(np.asarray(Image.open(path))[0, 0, 0])


def test_pickapic_rows_give_the_preferred_image_first(tmp_path):
    rows = [{"caption": "a", "jpg_0": _png(10), "jpg_1": _png(20), "label_0": 1, "best_image_uid": "u"},
            {"caption": "b", "jpg_0": _png(30), "jpg_1": _png(40), "label_0": 0},
            {"caption": "c", "jpg_0": _png(50), "jpg_1": _png(60), "label_0": 0.5}]
    src = tmp_path / "pick.jsonl"
    src.write_text("".join(json.dumps({**r, "jpg_0": base64.b64encode(r["jpg_0"]).decode(),
                                       "jpg_1": base64.b64encode(r["jpg_1"]).decode()}) + "\n" for r in rows))
    path = write_preference_set(read_pickapic(src), tmp_path / "out")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in recs] == ["a", "b"]  # the tie dropped
    got = [(_grey(path.parent / r["chosen"]), _grey(path.parent / r["rejected"])) for r in recs]
    assert got == [(10, 20), (40, 30)]
    assert recs[0]["best_image_uid"] == "u"
    ps = load_prompts(str(path))  # the layout is a prompt file: the pairs' paths are metadata
    assert ps.prompts == ["a", "b"] and ps.metadata[1]["chosen"] == recs[1]["chosen"]


def test_pickapic_refuses_other_labels(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"caption": "a", "jpg_0": "", "jpg_1": "", "label_0": 2}) + "\n")
    with pytest.raises(ValueError, match="label_0=2"):
        list(read_pickapic(src))


@pytest.mark.parametrize(("mode", "want"), [("best_worst", [(1, 3)]), ("all", [(1, 2), (1, 3), (2, 3)])])
def test_ranked_lists(tmp_path, mode, want):
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(_png(i))
    (tmp_path / "train.json").write_text(json.dumps([{"prompt": "p", "image_path": ["0.png", "1.png", "2.png"],
                                                      "rank": [3, 1, 2]}]))
    pairs = list(read_ranked(tmp_path / "train.json", mode))
    rank_of = {str((tmp_path / f"{i}.png").resolve()): r for i, r in enumerate([3, 1, 2])}
    assert [(rank_of[p.chosen], rank_of[p.rejected]) for p in pairs] == want


def test_imagefolder_to_image_set(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(7, (8, 6)))
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": "a cat", "k": 1}) + "\n")
    path = write_image_set(read_imagefolder(tmp_path), tmp_path / "out", size=(4, 4))
    rec = json.loads(path.read_text())
    assert rec["prompt"] == "a cat" and rec["k"] == 1
    img = load_image(path.parent / rec["target"], 4, 4)  # resized to the requested size
    assert img.shape == (3, 4, 4) and float(img[0, 0, 0]) == pytest.approx(7 / 255)
    with pytest.raises(ValueError, match=r"is 4x4 .* the run needs 8x8"):
        load_image(path.parent / rec["target"], 8, 8)
    with pytest.raises(ValueError, match="not found"):
        load_image(tmp_path / "missing.png", 4, 4)


def test_metadata_that_would_replace_a_written_field_is_refused(tmp_path):
    """An imagefolder line with a ``prompt`` besides its caption, or a ``target`` field, would have replaced the
    written prompt or image path (the metadata was spread after them); a Pick-a-Pic row with a ``chosen`` column
    likewise. Each is refused in one line naming the field."""
    (tmp_path / "a.png").write_bytes(_png(7))
    for extra, field in (({"prompt": "other"}, "prompt"), ({"target": "x.png"}, "target")):
        (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": "a cat", **extra}) + "\n")
        with pytest.raises(ValueError, match=rf"record 0: its metadata has the field\(s\) \['{field}'\]") as err:
            write_image_set(read_imagefolder(tmp_path), tmp_path / "out")
        assert "\n" not in str(err.value)
    rows = [{"caption": "a", "jpg_0": _png(10), "jpg_1": _png(20), "label_0": 1, "chosen": "jpg_0"}]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({**r, "jpg_0": base64.b64encode(r["jpg_0"]).decode(),
                                       "jpg_1": base64.b64encode(r["jpg_1"]).decode()}) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"its metadata has the field\(s\) \['chosen'\]"):
        write_preference_set(read_pickapic(src), tmp_path / "out2")


def test_flux_encode_images_is_the_vae_mode_packed(tiny_flux):
    from diffusers import FluxPipeline

    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    got = tiny_flux.encode_images(images)
    vae = tiny_flux.pipe.vae
    z = vae.encode(images * 2 - 1).latent_dist.mean
    want = (z - vae.config.shift_factor) * vae.config.scaling_factor
    unpacked = FluxPipeline._unpack_latents(got, 64, 64, tiny_flux.pipe.vae_scale_factor)
    assert got.shape == tiny_flux.initial_latents(2, None).shape
    assert torch.allclose(unpacked, want, atol=1e-6)
    with pytest.raises(ValueError, match=r"needs \(B, 3, 64, 64\)"):
        tiny_flux.encode_images(images[:, :, :32])
