"""Images per second of each built-in model reward, on its tiny stand-in (or, for OCR, the real engine).

    python bench/rewards_speed.py [--batch 16] [--resolution 512] [--repeats 3] [--device cpu]

The CLIP-family rewards run tiny random models of the real architecture (flowgrpo_rewards.tiny_models: 2
layers, width 32, 32x32 input, the real 49,408-token vocabulary), saved in the official formats and loaded
through the real loaders, so the figures measure the reward's own overhead: preprocessing of
``--resolution``-sized images with torch ops, tokenisation, batching. The released models (ViT-H-14 /
ViT-L/14 at 224-378 px) are far slower on a CPU; on a GPU their forward pass dominates. OCR runs the real
RapidOCR PP-OCR models that ship in its wheel, on rendered text.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def build_rewards(root: Path) -> list[tuple[str, object]]:
    from flowgrpo_rewards import tiny_models as tm
    from flowgrpo_rewards.aesthetic import AestheticReward
    from flowgrpo_rewards.clip_score import ClipScoreReward
    from flowgrpo_rewards.hps import HPSv2Reward
    from flowgrpo_rewards.pickscore import PickScoreReward

    tm.save_tiny_hf_clip(root / "hf_clip", root / "hf_proc", seed=0)
    tm.save_tiny_hps_checkpoint(root / "hps" / "HPS_v2.1_compressed.pt", seed=1)
    tm.save_tiny_open_clip_dir(root / "dfn", seed=2)
    dims = (16, 32, 16, 8, 4, 1)
    tm.save_tiny_aesthetic_mlp(root / "mlp.pth", dims=dims, seed=3)
    hf = {"checkpoint": str(root / "hf_clip"), "processor": str(root / "hf_proc")}
    return [
        ("hpsv2 (tiny ViT-H-14 family)", HPSv2Reward(checkpoint=str(root / "hps"), architecture=tm.TINY_OPEN_CLIP)),
        ("pickscore (tiny CLIPModel)", PickScoreReward(**hf)),
        ("clip_score openai (tiny CLIPModel)", ClipScoreReward("openai", **hf)),
        ("clip_score flowgrpo (tiny CLIPModel)", ClipScoreReward("flowgrpo", **hf)),
        ("clip_score dfn5b (tiny open_clip)", ClipScoreReward("dfn5b", checkpoint=str(root / "dfn"))),
        (
            "aesthetic (tiny CLIPModel + MLP)",
            AestheticReward(
                clip_checkpoint=hf["checkpoint"],
                clip_processor=hf["processor"],
                mlp_checkpoint=str(root / "mlp.pth"),
                architecture={"mlp_dims": dims},
            ),
        ),
    ]


def rendered_text_images(batch: int, resolution: int) -> torch.Tensor:
    """``batch`` white images with a line of black text: (batch, 3, R, R) float in [0, 1]."""
    images = []
    for k in range(batch):
        image = Image.new("RGB", (resolution, resolution), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        draw.text(
            (resolution // 8, resolution // 2),
            f"Hello World {k}",
            fill=(0, 0, 0),
            font=ImageFont.load_default(size=resolution // 10),
        )
        images.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255)
    return torch.stack(images)


def time_reward(reward, images, prompts, repeats: int) -> float:
    """Best-of-``repeats`` images per second (after one warm-up call)."""
    metadata = [{}] * len(prompts)
    reward(images, prompts, metadata)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        reward(images, prompts, metadata)
        best = min(best, time.perf_counter() - start)
    return len(prompts) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="images per reward call")
    parser.add_argument("--resolution", type=int, default=512, help="side of the square input images")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per reward (best is reported)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ocr-batch", type=int, default=4, help="images per OCR call (OCR is slow on a CPU)")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    images = torch.rand(args.batch, 3, args.resolution, args.resolution, generator=g)
    prompts = [f'a photo of object number {i % 4} with "text"' for i in range(args.batch)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, reward in build_rewards(Path(tmp)):
            reward.setup(torch.device(args.device))
            rows.append((label, args.batch, time_reward(reward, images, prompts, args.repeats)))
    try:
        from flowgrpo_rewards.ocr import OcrReward

        ocr = OcrReward()
        ocr.setup(torch.device(args.device))
        text_images = rendered_text_images(args.ocr_batch, args.resolution)
        ocr_prompts = [f'a sign that says "Hello World {k}"' for k in range(args.ocr_batch)]
        rows.append(("ocr (real RapidOCR PP-OCRv4)", args.ocr_batch, time_reward(ocr, text_images, ocr_prompts, 1)))
    except ImportError as err:
        rows.append((f"ocr: skipped ({err})", 0, float("nan")))

    print(
        f"device {args.device}, {torch.get_num_threads()} torch threads, "
        f"{args.resolution}x{args.resolution} input images"
    )
    print("| reward (stand-in) | batch | images/s |")
    print("|---|---:|---:|")
    for label, batch, rate in rows:
        print(f"| {label} | {batch} | {rate:.1f} |")


if __name__ == "__main__":
    main()
