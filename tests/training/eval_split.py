"""``[torchrun --nproc_per_node W] tests/training/eval_split.py OUT_DIR N CONTEXT [CACHE]``: one evaluation
(:meth:`flowgrpo.training.evaluation.Evaluation.evaluate`) of ``N`` prompts ``p0 … p<N-1>`` with the context
degree ``CONTEXT`` (and ``eval_sampling.cache.name`` ``CACHE``, default none), the sampler replaced by a
recorder, and writes ``OUT_DIR/rank_<global rank>.json``:

* ``calls``: each call of the sampler on this process: [its prompts, its seeds, whether it decoded];
* ``scored``: the prompts the point-wise reward scored on this process; ``whole``: how many images the
  whole-set reward was shown on this process (0: not called);
* ``metrics``: the returned figures; ``images``: the returned images' first value of each image; ``bad``: what the
  health check was called with.

The recorder's image i is filled with ``value(seed_i)`` (:func:`value`), the sampler's latents when it does not
decode with -1: a test derives every figure from the seeds alone. Without torchrun it runs as one process.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from flowgrpo.distributed import dist  # noqa: E402
from flowgrpo.rewards.compose import ComposedReward  # noqa: E402
from flowgrpo.training import evaluation  # noqa: E402

CALLS: list = []
SCORED: list[str] = []
WHOLE: list[int] = []


def value(seed: int) -> float:
    """The pixel value of the recorder's image of ``seed``: in [0, 1)."""
    return (seed % 9973) / 9973


def recorder(adapter, prompts, seeds, *, decode=True, **kwargs):
    CALLS.append([list(prompts), [int(s) for s in seeds], decode])
    if not decode:
        return torch.full((len(prompts), 2, 2, 2), -1.0)
    return torch.stack([torch.full((3, 4, 4), value(int(s))) for s in seeds])


class Brightness:
    """Point-wise: the mean pixel value; NaN for prompt ``p1`` (not applicable)."""

    def __call__(self, images, prompts, metadata):
        SCORED.extend(prompts)
        out = images.mean(dim=(1, 2, 3))
        return torch.where(torch.tensor([p == "p1" for p in prompts]), float("nan"), out)


class Spread:
    """Whole-set figures: the largest minus the smallest pixel value, and the count of images shown."""

    def __call__(self, images, prompts, metadata):
        return images.mean(dim=(1, 2, 3))

    def batch_metrics(self, images, prompts, metadata):
        WHOLE.append(images.shape[0])
        return {"spread": float(images.max() - images.min()), "task/count": float(images.shape[0])}


class _Prompts(list):
    """A prompt set: ``prompts`` and ``metadata`` (``len`` its size)."""

    def __init__(self, n: int) -> None:
        super().__init__(range(n))
        self.prompts, self.metadata = [f"p{i}" for i in range(n)], [{"i": i} for i in range(n)]


class _Optim:
    def eval_mode(self):
        pass

    def eval_weights(self):
        return contextlib.nullcontext()


def run(out: Path, n: int, context: int, cache: str = "none") -> None:
    dist.set_context_degree(context)
    evaluation.generate_images = recorder
    cfg = SimpleNamespace(
        data=SimpleNamespace(eval_num_prompts=n), batch_size=n, train=SimpleNamespace(seed=7, rollout_batch_size=2),
        eval_sampling=SimpleNamespace(num_steps=2, guidance_scale=1.0, cache=SimpleNamespace(name=cache)),
        logging=SimpleNamespace(progress=False))
    prompts = _Prompts(n)
    rewards = ComposedReward({"bright": Brightness(), "spread": Spread()}, {"bright": 1.0, "spread": 1.0})
    ev = evaluation.Evaluation(cfg, adapter=None, optim=_Optim(), rewards=rewards, eval_rewards=None,
                               prompts=prompts, eval_prompts=prompts, main=dist.rank() == 0)
    bad = []
    metrics, images, _ = ev.evaluate("test", bad.append)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank_{dist.rank()}.json").write_text(json.dumps({
        "calls": CALLS, "scored": SCORED, "whole": sum(WHOLE), "metrics": metrics,
        "images": images[:, 0, 0, 0].tolist(), "bad": bad}))


if __name__ == "__main__":
    import os

    if "WORLD_SIZE" in os.environ:
        torch.distributed.init_process_group("gloo")
    run(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
    dist.end_worker()
