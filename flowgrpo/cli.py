"""The ``flowgrpo`` command: ``flowgrpo train …``, ``flowgrpo sample …``.

``flowgrpo sample`` draws ODE images from a base model plus (optionally) a trained LoRA or full transformer, for
given prompts and seeds, to compare before and after training. With the run's evaluation settings and seeds it
reproduces the run's evaluation images: image i uses seed ``derive_seed(train.seed, "eval", i)``
(``--run RUN_DIR`` reads them from the run's ``config.yaml``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger("flowgrpo.cli")


def _sample(args: argparse.Namespace) -> None:
    import torch

    from flowgrpo.config import load_config
    from flowgrpo.data.prompts import load_prompts
    from flowgrpo.models import load_model
    from flowgrpo.plots import sample_grid
    from flowgrpo.rng import derive_seed
    from flowgrpo.sampling.rollout import generate_images

    if args.run:
        cfg = load_config(Path(args.run) / "config.yaml")
        model, dtype = cfg.model.pretrained, cfg.model.dtype
        height, width, msl = cfg.model.height, cfg.model.width, cfg.model.max_sequence_length
        steps, guidance = cfg.eval_sampling.num_steps, cfg.eval_sampling.guidance_scale
        seed = cfg.train.seed
        weights = Path(args.run) / ("lora" if cfg.model.finetune == "lora" else "transformer")
        prompt_file = args.prompts or cfg.data.eval_prompts
        count = args.num_images or cfg.data.eval_num_prompts
    else:
        if not args.model:
            raise SystemExit("flowgrpo sample: give --run RUN_DIR or --model")
        model, dtype, height, width, msl = args.model, args.dtype, args.height, args.width, args.max_sequence_length
        steps, guidance, seed = args.num_steps, args.guidance_scale, args.seed
        weights = Path(args.lora) if args.lora else None
        prompt_file = args.prompts
        count = args.num_images
    if args.no_weights:
        weights = None
    if prompt_file is None:
        raise SystemExit("flowgrpo sample: no prompts (give --prompts FILE)")
    adapter = load_model(model, dtype=dtype, height=height, width=width, max_sequence_length=msl)
    if weights is not None:
        if (weights / "pytorch_lora_weights.safetensors").exists():
            adapter.pipe.load_lora_weights(str(weights))
        elif (weights / "config.json").exists():
            adapter.transformer.load_state_dict(type(adapter.transformer).from_pretrained(weights).state_dict())
        else:
            raise SystemExit(f"flowgrpo sample: no LoRA or transformer weights in {str(weights)!r}")
    ps = load_prompts(prompt_file)
    count = count or len(ps)
    prompts = [ps.prompts[i % len(ps)] for i in range(count)]
    seeds = [derive_seed(seed, "eval", i) for i in range(count)]
    images = generate_images(adapter, prompts, seeds, num_steps=steps, guidance_scale=guidance,
                             batch_size=args.batch_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(images, out / "images.pt")
    sample_grid(images[:40], [p[:30] for p in prompts[:40]], out / "grid.png", ncols=10)
    from PIL import Image

    from flowgrpo.images import to_uint8

    for i, img in enumerate(images):
        Image.fromarray(to_uint8(img)).save(out / f"{i:05d}.png")
    logger.info("wrote %d images to %s", len(images), out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flowgrpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train (same as flowgrpo/train.py)", add_help=False)
    s = sub.add_parser("sample", help="ODE images from a base model plus a trained LoRA")
    s.add_argument("--run", help="a run folder: model, LoRA, evaluation settings and seeds from its config.yaml")
    s.add_argument("--model", help="diffusers folder, hub id, 'digits' or 'tiny'")
    s.add_argument("--lora", help="folder with pytorch_lora_weights.safetensors (or a full transformer folder)")
    s.add_argument("--no-weights", action="store_true", help="the base model only (ignore the run's weights)")
    s.add_argument("--prompts", help="prompt file (.txt or .jsonl) or embedded set name")
    s.add_argument("--num-images", type=int, default=0, help="images (prompts cycled); 0: one per prompt")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--num-steps", type=int, default=40)
    s.add_argument("--guidance-scale", type=float, default=3.5)
    s.add_argument("--dtype", default="float32")
    s.add_argument("--height", type=int)
    s.add_argument("--width", type=int)
    s.add_argument("--max-sequence-length", type=int, default=512)
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--out", required=True, help="output folder (PNGs, grid.png, images.pt)")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "train":
        from flowgrpo.train import main as train_main

        train_main(argv[1:])
        return
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from flowgrpo.train import _quiet_libraries

    _quiet_libraries()
    _sample(args)


if __name__ == "__main__":
    main()
