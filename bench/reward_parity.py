"""How far each reward's preprocessing is from its reference pipeline, in pixels and in score.

    python bench/reward_parity.py            # prints the markdown table of docs/rewards.md

For every built-in image reward, the reference pipeline is rebuilt from its published settings (PIL 8-bit
processors for transformers' CLIPImageProcessor, open_clip's and ImageReward's transforms; float-tensor
torchvision transforms for HPSv2 and Flow-GRPO's CLIP score) and run on 28 images: smooth colour fields, a sharp
white square on black, 8-pixel black/white blocks (like rendered text) and uniform pixel noise, at 224², 256²,
512², 1024², 1216x832, 832x1216 and 1344x704. The images are given once on the 8-bit grid (k/255, as decoded
images are once saved) and once as arbitrary floats. A first table gives the torch-vs-PIL resize alone, by image.

Reported per reward and input kind: the largest pixel difference (in 1/255 units, before normalisation) over the
square and over the non-square sizes, and the largest score difference as a percentage of the spread (max - min)
of the reference scores over all images, with a random tiny ViT (2 layers, width 64) at the real input size
(224, or 378 for DFN5B) standing in for the released model: its scores mean nothing, but they respond to pixel
changes as a ViT does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from flowgrpo.images import to_uint8

SQUARE = [(224, 224), (256, 256), (512, 512), (1024, 1024)]
NON_SQUARE = [(1216, 832), (832, 1216), (1344, 704)]


def images(height: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """The three image kinds at one size, (1, 3, H, W) float in [0, 1] (not quantised)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(1, 3, max(height // 32, 2), max(width // 32, 2), generator=g)
    smooth = F.interpolate(low, size=(height, width), mode="bilinear", align_corners=False)
    sharp = torch.zeros(1, 3, height, width)
    sharp[..., height // 3 : height - height // 3, width // 3 : width - width // 3] = 1.0
    noise = torch.rand(1, 3, height, width, generator=g)
    # 8 x 8 pixel black/white blocks, like rendered text: many sharp edges at every phase
    cells = (torch.rand(1, 1, -(-height // 8), -(-width // 8), generator=g) > 0.5).float()
    blocks = cells.repeat_interleave(8, 2).repeat_interleave(8, 3)[..., :height, :width].expand(1, 3, -1, -1)
    return {"smooth": smooth, "sharp": sharp, "blocks": blocks.contiguous(), "noise": noise}


def pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray(to_uint8(image[0]))


def references():
    """name -> (reference followed, ours: (1,3,H,W) -> normalised, reference: (1,3,H,W) float -> normalised,
    input size, mean, std)."""
    import open_clip
    import torchvision.transforms as tv
    import transformers
    from flowgrpo_rewards._clip_common import OPENAI_CLIP_MEAN as MEAN
    from flowgrpo_rewards._clip_common import OPENAI_CLIP_STD as STD
    from flowgrpo_rewards._clip_common import ImagePreprocess
    from flowgrpo_rewards.clip_score import flowgrpo_tensor_preprocess
    from flowgrpo_rewards.hps import HPSV2_PREPROCESS
    from flowgrpo_rewards.image_reward import preprocess as image_reward_preprocess

    processor_cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    hf = processor_cls()  # the released processors' settings: shortest edge 224, crop 224, bicubic
    dfn = open_clip.image_transform(378, is_train=False, resize_mode="squash")
    blip = tv.Compose([tv.Resize(224, interpolation=tv.InterpolationMode.BICUBIC), tv.CenterCrop(224), tv.ToTensor(),
                       tv.Normalize(MEAN, STD)])
    flowgrpo = tv.Compose([tv.Resize(224), tv.CenterCrop(224), tv.Normalize(MEAN, STD)])

    def hpsv2(x):  # preprocess_val gets a PIL image (hpsv2's img_score, Flow-GRPO's scorer): ToTensor of 8 bits
        x = torch.from_numpy(to_uint8(x[0])).permute(2, 0, 1).float() / 255
        height, width = x.shape[1:]
        scale = 224 / float(max(height, width))
        if scale != 1.0:
            size = [round(d * scale) for d in (height, width)]
            x = tv.functional.resize(x, size, interpolation=tv.InterpolationMode.BICUBIC, antialias=True)
            ph, pw = 224 - size[0], 224 - size[1]
            x = tv.functional.pad(x, [pw // 2, ph // 2, pw - pw // 2, ph - ph // 2], fill=0)
        return tv.Normalize(MEAN, STD)(x)[None]

    return {
        "hpsv2": ("HPSv2 `preprocess_val` (8-bit PIL to tensor, resized as float)",
                  ImagePreprocess(size=224, **HPSV2_PREPROCESS), hpsv2, 224),
        "pickscore, clip_score `openai`, aesthetic": (
            "transformers `CLIPImageProcessor` (8-bit PIL)", ImagePreprocess(size=224),
            lambda x: hf(images=[pil(x)], return_tensors="pt")["pixel_values"].float(), 224),
        "clip_score `flowgrpo`": ("Flow-GRPO `clip_scorer.py` (torchvision on the float tensor)",
                                  flowgrpo_tensor_preprocess(ImagePreprocess(size=224)), flowgrpo, 224),
        "clip_score `dfn5b`": ("open_clip `image_transform`, squash (8-bit PIL)",
                               ImagePreprocess(size=378, resize_mode="squash", crop_offset="round"),
                               lambda x: dfn(pil(x))[None], 378),
        "image_reward": ("ImageReward `_transform` (8-bit PIL)", image_reward_preprocess,
                         lambda x: blip(pil(x))[None], 224),
        "pickscore, clip_score `openai`, aesthetic with `resize_backend: pil`": (
            "transformers `CLIPImageProcessor` (8-bit PIL)", ImagePreprocess(size=224, resize_backend="pil"),
            lambda x: hf(images=[pil(x)], return_tensors="pt")["pixel_values"].float(), 224),
        "clip_score `dfn5b` with `resize_backend: pil`": (
            "open_clip `image_transform`, squash (8-bit PIL)",
            ImagePreprocess(size=378, resize_mode="squash", crop_offset="round", resize_backend="pil"),
            lambda x: dfn(pil(x))[None], 378),
        "image_reward with `resize_backend: pil`": (
            "ImageReward `_transform` (8-bit PIL)", lambda x: image_reward_preprocess(x, 224, "pil"),
            lambda x: blip(pil(x))[None], 224),
    }, STD


def tiny_vit(size: int) -> torch.nn.Module:
    import open_clip

    torch.manual_seed(0)
    patch = 32 if size == 224 else 42
    return open_clip.CLIP(embed_dim=16, vision_cfg={"image_size": size, "layers": 2, "width": 64, "head_width": 32,
                                                    "patch_size": patch},
                          text_cfg={"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}).eval()


@torch.no_grad()
def measure() -> list[dict]:
    refs, std = references()
    scale = torch.tensor(std).view(1, 3, 1, 1) * 255  # normalised units -> 1/255 pixel units
    text = F.normalize(torch.randn(16, generator=torch.Generator().manual_seed(1)), dim=0)
    rows = []
    for name, (source, ours, ref, size) in refs.items():
        model = tiny_vit(size)
        result = {"reward": name, "reference": source}
        for kind in ("8-bit", "float"):
            px = {"square": 0.0, "non-square": 0.0}
            ours_scores, ref_scores = [], []
            for group, sizes in (("square", SQUARE), ("non-square", NON_SQUARE)):
                for i, (h, w) in enumerate(sizes):
                    for x in images(h, w, seed=i).values():
                        x = torch.from_numpy(to_uint8(x)).permute(0, 3, 1, 2).float() / 255 if kind == "8-bit" else x
                        a, b = ours(x), ref(x)
                        px[group] = max(px[group], float(((a - b) * scale).abs().max()))
                        ours_scores.append(float(F.normalize(model.encode_image(a), dim=-1)[0] @ text))
                        ref_scores.append(float(F.normalize(model.encode_image(b), dim=-1)[0] @ text))
            o, r = np.array(ours_scores), np.array(ref_scores)
            result[kind] = (px["square"], px["non-square"], 100 * np.abs(o - r).max() / (r.max() - r.min()))
        rows.append(result)
    return rows


@torch.no_grad()
def resize_bound() -> list[str]:
    """Torch-vs-PIL bicubic resize on 8-bit images, by image kind and size: transformers' processor (shortest
    edge 224, crop) against ImagePreprocess, max pixel difference in 1/255."""
    refs, std = references()
    _, ours, ref, _ = refs["pickscore, clip_score `openai`, aesthetic"]
    scale = torch.tensor(std).view(1, 3, 1, 1) * 255
    sizes = SQUARE[1:] + NON_SQUARE
    lines = ["| image | " + " | ".join(f"{h}x{w}" for h, w in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for kind in ("smooth", "sharp", "blocks", "noise"):
        cells = []
        for i, (h, w) in enumerate(sizes):
            x = images(h, w, seed=i)[kind]
            x = torch.from_numpy(to_uint8(x)).permute(0, 3, 1, 2).float() / 255
            cells.append(f"{float(((ours(x) - ref(x)) * scale).abs().max()):.2f}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    print("\n".join(resize_bound()) + "\n")  # noqa: T201 - the benchmark's result table
    rows = measure()
    lines = [
        "| reward | reference followed | 8-bit input: max pixel diff, square / non-square | 8-bit: max score diff "
        "(% of spread) | float input: max pixel diff, square / non-square | float: max score diff (% of spread) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for kind in ("8-bit", "float"):
            sq, nsq, score = r[kind]
            cells += [f"{sq:.2f} / {nsq:.2f}", f"{score:.2f}"]
        lines.append(f"| {r['reward']} | {r['reference']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))  # noqa: T201 - the benchmark's result table


if __name__ == "__main__":
    main()
