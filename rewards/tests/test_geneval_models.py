"""GenEval's detector wrapper and colour classifier on tiny random models of the real architectures, offline.

Expected values: mmdetection's Mask2Former post-processing evaluated by hand on small logits, and a naive
per-(query, class) loop in numpy over the tiny model's own outputs; the colour scores as CLIP's zero-shot
formula written out on the tiny open_clip model's own embeddings.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flowgrpo_rewards.geneval.colors import (  # noqa: E402
    ClipColorClassifier,
    build_tiny_clip,
    color_templates,
    object_crops,
)
from flowgrpo_rewards.geneval.detector import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    Mask2FormerDetector,
    build_tiny_mask2former,
    instance_postprocess,
    mask_to_box,
    rescale_size,
)
from flowgrpo_rewards.geneval.rules import COLORS, Detection  # noqa: E402
from PIL import Image  # noqa: E402


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------------------------
# Detector pieces


@pytest.mark.parametrize(
    ("size", "scale", "expected"),
    [
        ((512, 512), (1333, 800), (800, 800)),
        ((1024, 1024), (1333, 800), (800, 800)),
        ((1024, 768), (1333, 800), (1067, 800)),  # min(1333/1024, 800/768) = 1.04167; 1066.67 → 1067
        ((2000, 500), (1333, 800), (1333, 333)),  # factor min(1333/2000, 800/500) = 0.6665; 333.25 → 333
        ((40, 30), (64, 48), (64, 48)),
    ],
)
def test_rescale_size(size, scale, expected):
    assert rescale_size(*size, scale) == expected


def test_mask_to_box():
    masks = torch.zeros(3, 8, 10, dtype=torch.bool)
    masks[0, 2:5, 3:7] = True  # rows 2..4, cols 3..6
    masks[1, 7, 9] = True  # a single pixel in the corner
    boxes = mask_to_box(masks)
    assert boxes.tolist() == [[3, 2, 7, 5], [9, 7, 10, 8], [0, 0, 0, 0]]


def test_instance_postprocess_by_hand():
    # Q = 2 queries, C = 2 classes (+ no-object); logits = log probabilities, so softmax gives them back
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]])
    masks = torch.full((2, 4, 4), -3.0)
    masks[0, 0:2, 1:3] = torch.tensor([[1.0, 3.0], [1.0, 3.0]])  # 4 pixels, mean sigmoid (σ(1) + σ(3)) / 2
    masks[1, 3, 0] = 2.0  # 1 pixel
    det = instance_postprocess(probs.log(), masks, top_k=3)
    m0 = (sigmoid(1) + sigmoid(3)) / 2
    expected = {  # (label, score, box): top 3 of {0.6 (q0,c0), 0.3 (q0,c1), 0.2 (q1,c0), 0.7 (q1,c1)}
        (0, 0.6 * m0, (1, 0, 3, 2)),
        (1, 0.7 * sigmoid(2), (0, 3, 1, 4)),
        (1, 0.3 * m0, (1, 0, 3, 2)),
    }
    rows = zip(det.labels, det.scores, det.boxes, strict=True)
    got = {(int(lab), float(s), tuple(b.tolist())) for lab, s, b in rows}
    assert len(got) == 3
    for e in expected:
        match = [g for g in got if g[0] == e[0] and g[2] == e[2] and math.isclose(g[1], e[1], rel_tol=1e-5)]
        assert match, (e, got)
    assert det.masks.shape == (3, 4, 4) and det.masks.sum() == 4 + 1 + 4
    # min_score drops what GenEval's threshold would drop anyway
    kept = instance_postprocess(probs.log(), masks, top_k=3, min_score=0.3)
    assert sorted(kept.scores.tolist()) == pytest.approx(sorted([0.6 * m0, 0.7 * sigmoid(2)]), rel=1e-5)
    none = instance_postprocess(probs.log(), masks, top_k=3, min_score=0.7)  # no class probability above 0.7
    assert none.scores.shape == (0,) and none.masks.shape == (0, 4, 4) and none.boxes.shape == (0, 4)


def test_empty_mask_scores_zero():
    det = instance_postprocess(torch.tensor([[5.0, 0.0]]), torch.full((1, 3, 3), -1.0), top_k=1)
    assert det.scores.tolist() == [0.0] and det.boxes.tolist() == [[0, 0, 0, 0]]


@pytest.fixture(scope="module")
def tiny_detector_dir(tmp_path_factory):
    return build_tiny_mask2former(tmp_path_factory.mktemp("m2f"))


def reference_detections(model, image, scale, top_k=100):
    """mmdetection's pipeline written naively: resize, normalise, pad, forward, resize masks, loop pairs."""
    rgb = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)
    h0, w0 = rgb.shape[1:]
    factor = min(max(scale) / max(h0, w0), min(scale) / min(h0, w0))
    h, w = int(h0 * factor + 0.5), int(w0 * factor + 0.5)
    x = F.interpolate(rgb[None], size=(h, w), mode="bilinear", align_corners=False)[0]
    x = (x - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)
    ph, pw = math.ceil(h / 32) * 32, math.ceil(w / 32) * 32
    padded = torch.zeros(1, 3, ph, pw)
    padded[0, :, :h, :w] = x
    with torch.no_grad():
        out = model(pixel_values=padded)
    logits = out.class_queries_logits[0].double()
    prob = (logits.exp() / logits.exp().sum(-1, keepdim=True))[:, :-1].numpy()
    m = F.interpolate(out.masks_queries_logits, size=(ph, pw), mode="bilinear", align_corners=False)
    m = F.interpolate(m[:, :, :h, :w], size=(h0, w0), mode="bilinear", align_corners=False)[0].numpy()
    n_queries, n_classes = prob.shape
    pairs = sorted(((prob[q, c], q, c) for q in range(n_queries) for c in range(n_classes)), reverse=True)
    rows = []
    for p, q, c in pairs[:top_k]:
        inside = m[q] > 0
        mean_sig = (1 / (1 + np.exp(-m[q][inside]))).sum() / (inside.sum() + 1e-6)
        ys, xs = np.nonzero(inside)
        box = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) if len(xs) else (0, 0, 0, 0)
        rows.append((c, p * mean_sig, tuple(float(v) for v in box)))
    return rows


def test_detector_matches_naive_mmdet_pipeline(tiny_detector_dir):
    from transformers import Mask2FormerForUniversalSegmentation

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)),  # ×1.6, padded 48→64
              Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))]
    detector = Mask2FormerDetector(tiny_detector_dir, scale=(64, 48))
    detector.setup("cpu")
    got = detector.detect(images)
    model = Mask2FormerForUniversalSegmentation.from_pretrained(tiny_detector_dir).eval()
    for image, dets in zip(images, got, strict=True):
        ref = reference_detections(model, image, (64, 48))
        assert dets.masks.shape[1:] == (image.height, image.width)
        rows = zip(dets.labels.tolist(), dets.scores.tolist(), map(tuple, dets.boxes.tolist()), strict=True)
        mine = sorted(rows, key=lambda r: (-r[1], r[0]))
        ref = sorted(ref, key=lambda r: (-r[1], r[0]))
        assert len(mine) == len(ref) == 100
        for a, b in zip(mine, ref, strict=True):
            assert a[0] == b[0] and a[2] == b[2]
            assert a[1] == pytest.approx(b[1], rel=1e-4, abs=1e-7)


def test_detector_rejects_a_non_coco_instance_model(tmp_path):
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    backbone = SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1],
                          num_heads=[1, 1, 1, 1], window_size=4,
                          out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32,
                               encoder_feedforward_dim=32, encoder_layers=1, decoder_layers=1,
                               num_attention_heads=2, dim_feedforward=32, num_queries=4,
                               id2label={i: f"c{i}" for i in range(133)})
    Mask2FormerForUniversalSegmentation(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has 133 classes"):
        Mask2FormerDetector(str(tmp_path)).setup("cpu")


# ------------------------------------------------------------------------------------------------------------
# Colours


def test_color_templates_are_geneval_s():
    assert [t.format(c="orange") for t in color_templates("teddy bear")] == [
        "a photo of a orange teddy bear",
        "a photo of a orange-colored teddy bear",
        "a photo of a orange object",
    ]


def test_object_crop_pastes_the_mask_on_grey():
    pixels = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    mask = np.zeros((4, 6), dtype=bool)
    mask[1, 2] = mask[2, 3] = True
    crop = object_crops(Image.fromarray(pixels), [Detection((2, 1, 4, 3), 0.9, mask)])[0]
    got = np.asarray(crop)
    expected = np.full((2, 2, 3), 0x99, dtype=np.uint8)  # "#999" = (153, 153, 153)
    expected[0, 0] = pixels[1, 2]
    expected[1, 1] = pixels[2, 3]
    np.testing.assert_array_equal(got, expected)
    no_mask = object_crops(Image.fromarray(pixels), [Detection((0.4, 0.6, 2.6, 3.4), 0.9, None)])[0]
    np.testing.assert_array_equal(np.asarray(no_mask), pixels[1:3, 0:3])  # PIL rounds the box to (0, 1, 3, 3)
    with pytest.raises(ValueError, match="mask is"):
        object_crops(Image.fromarray(pixels), [Detection((0, 0, 2, 2), 0.9, np.ones((3, 3), bool))])


def test_clip_color_scores_are_zero_shot_logits(tmp_path):
    import open_clip

    name = build_tiny_clip(tmp_path / "clip")
    clf = ClipColorClassifier(name)
    clf.setup("cpu")
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
    mask = np.zeros((40, 50), dtype=bool)
    mask[5:25, 10:30] = True
    objects = [Detection((10, 5, 30, 25), 0.9, mask), Detection((0, 0, 50, 40), 0.8, None)]
    scores = clf.scores(image, "fire hydrant", objects)
    assert scores.shape == (2, 10)

    model, _, preprocess = open_clip.create_model_and_transforms(name)
    tokenizer = open_clip.get_tokenizer(name)
    model.eval()
    with torch.no_grad():
        text = []
        for c in COLORS:
            prompts = [f"a photo of a {c} fire hydrant", f"a photo of a {c}-colored fire hydrant",
                       f"a photo of a {c} object"]
            e = model.encode_text(tokenizer(prompts)).double()
            e = e / e.norm(dim=-1, keepdim=True)
            mean = e.mean(0)
            text.append(mean / mean.norm())
        text = torch.stack(text, 1)  # (D, 10)
        arr = np.asarray(image).copy()
        grey = np.full_like(arr, 153)
        first = np.where(mask[..., None], arr, grey)[5:25, 10:30]
        crops = [Image.fromarray(np.ascontiguousarray(first)), image]
        feats = model.encode_image(torch.stack([preprocess(c) for c in crops])).double()
        feats = feats / feats.norm(dim=-1, keepdim=True)
        expected = (100 * feats @ text).numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-3)
    scorer = clf.scorer(image)
    np.testing.assert_allclose(scorer("fire hydrant", objects), scores)
