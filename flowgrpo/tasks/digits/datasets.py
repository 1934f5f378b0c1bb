"""The digits task's datasets for the dataset objectives (``sft``, ``dpo_offline``), in the layouts of
:mod:`flowgrpo.data.image_sets`, built once into the cache and named by embedded sets:

- ``digits_real`` (:func:`build_real_set`): the real digits of the ``train`` split (the reward ∪ judge halves,
  1,438 digits; the ``test`` fifth held out), each a 32×32 PNG (:func:`~flowgrpo.tasks.digits.data.digits_to_images`)
  with a prompt of its digit, the three phrasings in turn, and its ``digit`` (the reward's metadata): SFT on the
  real digits.
- ``digits_pairs`` (:func:`build_preference_set`): the base model's own samples scored by the reward: for each of
  the 30 training prompts, ``rounds`` groups of ``group_size`` seeded 8-step ODE samples of the base digits model,
  scored by ``digit_correctness`` (the classifier's probability of the prompt's digit, uncapped), the best of each
  group chosen over its worst (a group whose scores are equal gives none): offline DPO's preference set.

Command line (either set; the embedded names build them on first use)::

    python -m flowgrpo.tasks.digits.datasets real OUT_DIR
    python -m flowgrpo.tasks.digits.datasets pairs OUT_DIR [--rounds 4 --group-size 8 --seed 0]
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from flowgrpo.argtypes import OneLineParser
from flowgrpo.builds.cache_folder import build_once, cache_dir
from flowgrpo.data.image_sets import ImageItem, PreferencePair, write_image_set, write_preference_set
from flowgrpo.tasks.digits.data import PHRASINGS, digit_prompt, digits_to_images, load_digit_split, prompt_records
from flowgrpo.writing.outputs import OutputRefused, check_folder

__all__ = ["build_real_set", "build_preference_set", "ensure_real_set", "ensure_preference_set", "main"]

SETS_VERSION = 1  # bump when a set's recipe changes: the cache folder name carries it


def _png(image: torch.Tensor) -> bytes:
    """(3, H, W) float in [0, 1] → PNG bytes (8-bit RGB)."""
    from PIL import Image

    arr = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def build_real_set(out_dir: str | Path, split: str = "train") -> Path:
    """Write the real digits of ``split`` as an image set (module docstring); returns the JSONL's path."""
    grids, labels = load_digit_split(split)
    images = digits_to_images(grids)
    items = [ImageItem(digit_prompt(int(d), i % len(PHRASINGS)), _png(img), {"digit": int(d)})
             for i, (img, d) in enumerate(zip(images, labels.tolist(), strict=True))]
    return write_image_set(items, out_dir)


@torch.no_grad()
def build_preference_set(out_dir: str | Path, *, seed: int = 0, rounds: int = 4, group_size: int = 8,
                         model_seed: int = 0) -> Path:
    """Write the base model's scored samples as a preference set (module docstring); returns the JSONL's path.

    Samples: prompt p, round k, sample j is the ODE image of :func:`flowgrpo.sampling.rollout.generate_images` with
    seed ``((seed·1000 + k)·100 + p)·100 + j`` (8 steps, guidance 1, the base digits model of ``model_seed``).

    Raises:
        ValueError: ``rounds`` < 1 or ``group_size`` < 2.
    """
    if rounds < 1 or group_size < 2:
        raise ValueError(f"rounds must be >= 1 and group_size >= 2, got {rounds}, {group_size}")
    from flowgrpo.models import load_model
    from flowgrpo.sampling.rollout import generate_images
    from flowgrpo.tasks.digits.model import MAX_SEQUENCE_LENGTH, ensure_digits_model
    from flowgrpo.tasks.digits.scoring import digit_probabilities

    adapter = load_model(str(ensure_digits_model(model_seed, progress=False)), height=32, width=32,
                         max_sequence_length=MAX_SEQUENCE_LENGTH, progress=False)
    records = prompt_records("train")
    pairs = []
    for k in range(rounds):
        for p, rec in enumerate(records):
            prompts = [rec["prompt"]] * group_size
            seeds = [((seed * 1000 + k) * 100 + p) * 100 + j for j in range(group_size)]
            images = generate_images(adapter, prompts, seeds, num_steps=8, guidance_scale=1.0,
                                     batch_size=group_size)
            scores = digit_probabilities(images)[:, rec["digit"]]  # the digit_correctness reward, uncapped
            best, worst = int(torch.argmax(scores)), int(torch.argmin(scores))
            if scores[best] > scores[worst]:
                pairs.append(PreferencePair(rec["prompt"], _png(images[best]), _png(images[worst]),
                                            {"digit": rec["digit"], "chosen_score": float(scores[best]),
                                             "rejected_score": float(scores[worst])}))
    return write_preference_set(pairs, out_dir)


def _complete(folder: Path) -> bool:
    return (folder / "data.jsonl").is_file()


def ensure_real_set() -> Path:
    """The cached ``digits_real`` set's JSONL, built on first use (seconds)."""
    folder = cache_dir() / f"digits-real-v{SETS_VERSION}"
    build_once(folder, build_real_set, is_complete=_complete)
    return folder / "data.jsonl"


def ensure_preference_set() -> Path:
    """The cached ``digits_pairs`` set's JSONL (the defaults of :func:`build_preference_set`), built on first use
    (under a minute on 2 CPU cores)."""
    folder = cache_dir() / f"digits-pairs-v{SETS_VERSION}-seed0"
    build_once(folder, build_preference_set, is_complete=_complete)
    return folder / "data.jsonl"


def main(argv: list[str] | None = None) -> None:
    """Write the digits task's image set (``real``) or preference set (``pairs``) into a folder."""
    ap = OneLineParser(prog="python -m flowgrpo.tasks.digits.datasets", description=main.__doc__)
    ap.add_argument("set", choices=["real", "pairs"])
    ap.add_argument("out")
    ap.add_argument("--split", default="train", help="real: the digits split")
    ap.add_argument("--rounds", type=int, default=4, help="pairs: groups per prompt")
    ap.add_argument("--group-size", type=int, default=8, help="pairs: samples per group")
    ap.add_argument("--seed", type=int, default=0, help="pairs: the sampling seed")
    a = ap.parse_args(argv)
    try:  # before the digits are read or the base model sampled (a minute): flowgrpo's write rule
        check_folder(a.out, "out", "image set" if a.set == "real" else "preference set")
    except OutputRefused as err:
        ap.exit(2, f"{ap.prog}: error: {err}\n")
    if a.set == "real":
        path = build_real_set(a.out, a.split)
    else:
        path = build_preference_set(a.out, seed=a.seed, rounds=a.rounds, group_size=a.group_size)
    print(path)  # noqa: T201 - the command's result: the dataset file to name in data.train_prompts


if __name__ == "__main__":
    main()
