"""GenEval: object-focused text-to-image evaluation (Ghosh et al. 2023, arXiv 2310.11513) for flowgrpo models.

Generate 4 images per GenEval prompt with the ODE sampler and score them::

    python eval/geneval.py --model black-forest-labs/FLUX.1-dev [--lora RUN/lora] --outdir out/geneval

or score a folder already in GenEval's layout (``<index>/metadata.jsonl``, ``<index>/samples/NNNN.png``)::

    python eval/geneval.py --images out/geneval/images

Writes ``results.jsonl`` (one line per image), ``summary.json`` and ``summary.md`` (accuracy per task, the
overall mean of the six, the share of prompts with at least one correct image) and prints the table.

``--tiny`` swaps in a tiny random Mask2Former and CLIP built offline (and, with no ``--model``, flowgrpo's
tiny embedded FLUX): every stage runs on a CPU without downloads; the score is meaningless (about 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from flowgrpo_rewards.geneval import evaluation as ev
from flowgrpo_rewards.geneval.colors import DEFAULT_CLIP_MODEL, DEFAULT_CLIP_PRETRAINED, build_tiny_clip
from flowgrpo_rewards.geneval.detector import DEFAULT_DETECTOR, DEFAULT_SCALE, build_tiny_mask2former
from flowgrpo_rewards.geneval.reward import GenEvalScorer, to_pil
from flowgrpo_rewards.geneval.rules import TASKS, RuleConfig, details, evaluation_metadata, validate_metadata

from flowgrpo.argtypes import OneLineParser
from flowgrpo.cli import DefaultsHelpFormatter
from flowgrpo.rewards.base import MissingWeightsError
from flowgrpo.writing.outputs import check_folder, claim_folder, write_text_file

logger = logging.getLogger("geneval")

TINY_SCALE = (64, 64)
TINY_IMAGE_SIZE = 64


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    src = p.add_argument_group("what to evaluate (one of)")
    src.add_argument("--model", help="diffusers folder or hub id (or 'tiny', 'digits') to generate with")
    src.add_argument("--images", type=Path, help="score this existing folder in GenEval's layout instead")
    p.add_argument("--outdir", type=Path, help="results folder, empty or made by this script; generated images go "
                   "to <outdir>/images (default with --images: <images>_geneval beside the image folder)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random detector and CLIP, offline (and model 'tiny' when no --model)")

    gen = p.add_argument_group("generation")
    gen.add_argument("--lora", type=Path,
                     help="a LoRA folder saved by flowgrpo (pytorch_lora_weights.safetensors)")
    gen.add_argument("--metadata", type=Path, help="prompt specs JSONL (default: GenEval's 553 prompts)")
    gen.add_argument("--per-task", type=int, help="only the first N prompts of each task (quick checks)")
    gen.add_argument("--samples", type=int, default=4, help="images per prompt (GenEval: 4)")
    gen.add_argument("--steps", type=int, default=28, help="ODE sampling steps (FLUX.1: 28; SD3.5: 40)")
    gen.add_argument("--guidance", type=float, default=3.5, help="guidance scale (FLUX.1: 3.5; SD3.5: 4.5)")
    gen.add_argument("--seed", type=int, default=0, help="image j of prompt i uses seed (seed, i, j)")
    gen.add_argument("--height", type=int, help="image height (default: the model's)")
    gen.add_argument("--width", type=int, help="image width (default: the model's)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    gen.add_argument("--gen-batch-size", type=int, default=8, help="images per sampler batch")

    sc = p.add_argument_group("scoring")
    sc.add_argument("--detector", help=f"Mask2Former checkpoint (default {DEFAULT_DETECTOR})")
    sc.add_argument("--clip-model", help=f"open_clip model for colours (default {DEFAULT_CLIP_MODEL})")
    sc.add_argument("--clip-pretrained",
                    help=f"open_clip pretrained tag or file (default {DEFAULT_CLIP_PRETRAINED})")
    sc.add_argument("--image-scale", type=int, nargs=2, metavar=("LONG", "SHORT"),
                    help=f"detector resize limits (default {DEFAULT_SCALE[0]} {DEFAULT_SCALE[1]}, as mmdet)")
    sc.add_argument("--batch-size", type=int, default=8, help="images per detector batch")
    sc.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="scoring device")
    defaults = RuleConfig()
    sc.add_argument("--threshold", type=float, default=defaults.threshold)
    sc.add_argument("--counting-threshold", type=float, default=defaults.counting_threshold)
    sc.add_argument("--max-objects", type=int, default=defaults.max_objects)
    sc.add_argument("--nms-threshold", type=float, default=defaults.nms_threshold,
                    help="1.0 = no NMS (GenEval)")
    sc.add_argument("--position-threshold", type=float, default=defaults.position_threshold)
    args = p.parse_args(argv)

    if args.model is not None and args.images is not None:
        p.error("give --model (generate, then score) or --images (score an existing folder), not both")
    if args.model is None and args.images is None:
        if not args.tiny:
            p.error("give --model (generate, then score) or --images (score an existing folder)")
        args.model = "tiny"
    if args.model == "tiny":  # the embedded tiny FLUX is trained on nothing: 64 px is plenty
        args.height = args.height or TINY_IMAGE_SIZE
        args.width = args.width or TINY_IMAGE_SIZE
    if args.model is not None and args.outdir is None:
        p.error("--outdir is required when generating")
    if args.per_task is not None and args.per_task < 1:
        p.error(f"--per-task must be >= 1, got {args.per_task}")
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    return args


# --------------------------------------------------------------------------------------------------
# Prompts and generation


def load_specs(path: Path | None) -> list[dict]:
    """GenEval specs from a JSONL file (default: the bundled 553 evaluation prompts).

    Raises:
        ValueError: a malformed line or spec, naming the file and line.
    """
    if path is None:
        return evaluation_metadata()
    from flowgrpo.data.prompts import iter_jsonl

    specs = []
    for lineno, spec in iter_jsonl(path):
        validate_metadata(spec, f"{path}:{lineno}")
        if "prompt" not in spec:
            raise ValueError(f"{path}:{lineno}: missing field 'prompt'")
        specs.append(spec)
    return specs


def select_prompts(specs: list[dict], per_task: int | None) -> list[tuple[int, dict]]:
    """(index, spec) pairs: all, or the first ``per_task`` of each task; index = the spec's row."""
    if per_task is None:
        return list(enumerate(specs))
    taken = dict.fromkeys(TASKS, 0)
    out = []
    for i, spec in enumerate(specs):
        if taken[spec["tag"]] < per_task:
            taken[spec["tag"]] += 1
            out.append((i, spec))
    return out


def load_generator(model: str, lora: Path | None, *, dtype: str, height: int | None, width: int | None,
                   device: str):
    """A flowgrpo model adapter on ``device``, with the LoRA loaded when given."""
    from flowgrpo.models import load_model

    adapter = load_model(model, dtype=dtype, height=height, width=width)
    if lora is not None:
        if not (lora / "pytorch_lora_weights.safetensors").is_file():
            weights = lora / "pytorch_lora_weights.safetensors"
            raise FileNotFoundError(f"missing {weights} (the --lora folder must be a LoRA saved by flowgrpo)")
        adapter.pipe.load_lora_weights(str(lora))
    adapter.pipe.to(device)
    return adapter


def generate(adapter, prompts: list[tuple[int, dict]], folder: Path, *, samples: int, steps: int,
             guidance: float, seed: int, batch_size: int) -> None:
    """Write ``samples`` ODE images per prompt into ``folder`` in GenEval's layout; prompts whose images all
    exist already (same spec) are skipped, so an interrupted run resumes."""
    from flowgrpo.rng import derive_seed
    from flowgrpo.sampling.rollout import generate_images

    todo = []
    for index, spec in prompts:
        d = ev.prompt_dir(folder, index)
        if (d / "metadata.jsonl").is_file():
            existing = ev.read_metadata(d / "metadata.jsonl")
            if existing != spec:
                raise ValueError(
                    f"{d / 'metadata.jsonl'} holds another prompt than spec {index}; use a new --outdir"
                )
            if all((d / "samples" / f"{j:04d}.png").is_file() for j in range(samples)):
                continue
        ev.write_metadata(folder, index, spec)
        todo.extend((index, spec["prompt"], j) for j in range(samples))
    logger.info("generating %d images (%d prompts × %d) with %d ODE steps", len(todo), len(todo) // samples,
                samples, steps)
    chunk = max(batch_size, 1) * 4
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        seeds = [derive_seed(seed, i, j) for i, _, j in part]
        images = generate_images(adapter, [p for _, p, _ in part], seeds, num_steps=steps,
                                 guidance_scale=guidance, batch_size=batch_size)  # (n, 3, H, W) in [0, 1]
        for (index, _, j), image in zip(part, to_pil(images), strict=True):
            ev.write_sample(folder, index, j, image)
        logger.info("generated %d / %d images", start + len(part), len(todo))


# --------------------------------------------------------------------------------------------------
# Scoring


def tiny_scorer_models() -> tuple[str, str]:
    """(detector folder, CLIP model name) of the tiny random scorer, built once into flowgrpo's cache."""
    from flowgrpo.builds.cache_folder import cache_dir

    root = cache_dir() / "geneval-tiny-v1"
    det, clip = root / "mask2former", root / "clip"
    if not (det / "config.json").is_file():
        build_tiny_mask2former(det)
    if not (clip / "open_clip_config.json").is_file():
        build_tiny_clip(clip)
    return str(det), f"local-dir:{clip}"


def build_scorer(args: argparse.Namespace) -> GenEvalScorer:
    rules = RuleConfig(args.threshold, args.counting_threshold, args.max_objects, args.nms_threshold,
                       args.position_threshold)
    detector, clip_model, clip_pretrained = DEFAULT_DETECTOR, DEFAULT_CLIP_MODEL, DEFAULT_CLIP_PRETRAINED
    scale = DEFAULT_SCALE
    if args.tiny:
        detector, clip_model = tiny_scorer_models()
        clip_pretrained, scale = None, TINY_SCALE
    scorer = GenEvalScorer(
        detector=args.detector or detector,
        clip_model=args.clip_model or clip_model,
        clip_pretrained=args.clip_pretrained or clip_pretrained,
        image_scale=tuple(args.image_scale) if args.image_scale else scale,
        batch_size=args.batch_size,
        rules=rules,
    )
    scorer.setup(args.device)
    return scorer


def score_folder(scorer: GenEvalScorer, folder: Path, batch_size: int = 16) -> list[dict]:
    """``results.jsonl`` rows for every image of ``folder`` (GenEval layout), in prompt and sample order."""
    entries = [(p.index, p.metadata, path) for p in ev.read_folder(folder) for path in p.images]
    rows = []
    for start in range(0, len(entries), batch_size):
        part = entries[start : start + batch_size]
        images = [ev.load_image(path) for _, _, path in part]
        specs, names = [md for _, md, _ in part], [str(path) for *_, path in part]
        for (index, md, path), r in zip(part, scorer.score_images(images, specs, where=names), strict=True):
            verdict = r.verdict
            rows.append(ev.result_row(path, index, md, verdict.correct, verdict.reason, details(r.objects)))
        logger.info("scored %d / %d images", start + len(part), len(entries))
    return rows


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the CLI; returns the summary dict."""
    args = parse_args(argv)
    try:  # the inputs, read before any model loads: a missing or malformed one is one line, exit status 2
        if args.images is not None:
            folder = args.images
            outdir = args.outdir or folder.parent / f"{folder.name}_geneval"
            ev.read_folder(folder)
        else:
            outdir = args.outdir
            folder = outdir / "images"
            prompts = select_prompts(load_specs(args.metadata), args.per_task)
        # flowgrpo's write rule: a folder of its own (a resumed generation's) or an empty one, never an input
        check_folder(outdir, "--outdir", "geneval", inputs=[args.images, args.lora, args.metadata, args.model])
        claim_folder(outdir, "geneval", "--outdir")
    except (FileNotFoundError, ValueError) as err:
        print(f"geneval.py: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.images is None:
        adapter = load_generator(args.model, args.lora, dtype=args.dtype, height=args.height,
                                 width=args.width, device=args.device)
        generate(adapter, prompts, folder, samples=args.samples, steps=args.steps, guidance=args.guidance,
                 seed=args.seed, batch_size=args.gen_batch_size)
        del adapter
    try:
        scorer = build_scorer(args)
    except MissingWeightsError as err:  # one line, with this script's flag for the local path
        raise SystemExit(f"geneval.py: {err} Here: --{err.key.replace('_', '-')} DIR") from None
    rows = score_folder(scorer, folder, batch_size=max(args.batch_size, 1))
    outdir.mkdir(parents=True, exist_ok=True)
    ev.write_results(outdir / "results.jsonl", rows)
    summary = ev.summarize(rows)
    write_text_file(outdir / "summary.json", json.dumps(summary, indent=2) + "\n")
    table = ev.format_summary(summary)
    write_text_file(outdir / "summary.md", table + "\n")
    print(table)
    print(f"\nresults: {outdir / 'results.jsonl'}")
    return summary


if __name__ == "__main__":
    # our progress at INFO; other libraries (open_clip logs every loading step on the root logger) at WARNING
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for name in ("geneval", "flowgrpo", "flowgrpo_rewards"):
        logging.getLogger(name).setLevel(os.environ.get("LOGLEVEL", "INFO"))
    main()
