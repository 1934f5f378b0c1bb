"""The held-out evaluation is split over the data ranks (:meth:`flowgrpo.training.evaluation.Evaluation.evaluate`):
each data rank samples only its share of the set (the last share padded, so every rank makes the same transformer
calls), a context group decodes and scores once (on its first rank), and every process returns the figures and
the images of the whole set. The sampler is replaced by a recorder (``tests/training/eval_split.py``) whose image
i is filled with a value of its seed ``derive_seed(7, "eval", i)``, so the expected figures below come from the
seeds alone. The real model's figures on 2 processes against one are in ``tests/training/test_sharding.py``
(FSDP2), ``tests/training/test_distributed.py`` (DDP) and ``tests/training/test_context_parallel.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo.distributed import dist
from flowgrpo.rng import derive_seed
from tests.training.eval_split import value
from tests.training.test_distributed import _free_port
from tests.training.test_sharding import ENV, REPO


def _launch(out: Path, n: int, procs: int, context: int = 1, cache: str = "none") -> list[dict]:
    args = ["tests/training/eval_split.py", str(out), str(n), str(context), cache]
    if procs == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port",
               _free_port(), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(procs)]


def _expected(n: int) -> dict[str, float]:
    """The figures of the recorder's N images: the mean pixel value without p1 (its score is NaN), the spread of
    the values, the count of images."""
    v = [value(derive_seed(7, "eval", i)) for i in range(n)]
    kept = [x for i, x in enumerate(v) if i != 1]
    return {"eval/bright/mean": sum(kept) / len(kept), "eval/spread": max(v) - min(v), "eval/task/count": float(n)}


def _same_figures(got: dict, n: int) -> None:
    want = _expected(n)
    assert got["metrics"].keys() == want.keys()
    for k, v in want.items():
        assert got["metrics"][k] == pytest.approx(v, rel=1e-6), k
    assert got["images"] == pytest.approx([value(derive_seed(7, "eval", i)) for i in range(n)], rel=1e-6)
    assert got["bad"] == [0.0]


def _seeds(idx: list[int]) -> list[int]:
    return [derive_seed(7, "eval", i) for i in idx]


def test_one_process_makes_and_scores_the_whole_set(tmp_path):
    (one,) = _launch(tmp_path, 3, 1)
    assert one["calls"] == [[["p0", "p1", "p2"], _seeds([0, 1, 2]), True]]
    assert one["scored"] == ["p0", "p1", "p2"] and one["whole"] == 3
    _same_figures(one, 3)


def test_each_data_rank_makes_only_its_share_of_an_uneven_set(tmp_path):
    """3 prompts over 2 ranks: ceil(3/2) = 2 each, rank 1's second a repeat of its last (the same calls on both
    ranks), dropped before scoring; the whole-set figures are the main process's, sent to the other."""
    r0, r1 = _launch(tmp_path, 3, 2)
    assert r0["calls"] == [[["p0", "p1"], _seeds([0, 1]), True]]
    assert r1["calls"] == [[["p2", "p2"], _seeds([2, 2]), True]]
    assert (r0["scored"], r1["scored"]) == (["p0", "p1"], ["p2"])
    assert (r0["whole"], r1["whole"]) == (3, 0)
    for got in (r0, r1):
        _same_figures(got, 3)


def test_a_rank_without_a_share_keeps_in_step(tmp_path):
    """1 prompt over 2 ranks: rank 1 samples a repeat of image 0 (it must join the collectives) and scores none."""
    r0, r1 = _launch(tmp_path, 1, 2)
    assert r0["calls"] == r1["calls"] == [[["p0"], _seeds([0]), True]]
    assert (r0["scored"], r1["scored"]) == (["p0"], [])
    for got in (r0, r1):
        assert got["metrics"]["eval/bright/mean"] == pytest.approx(value(derive_seed(7, "eval", 0)), rel=1e-6)
        assert got["metrics"]["eval/task/count"] == 1.0


def test_with_a_feature_cache_every_rank_makes_the_whole_set(tmp_path):
    """A cache's skipped steps depend on the batch: the set is not split (the one-process batches on every rank,
    so under FSDP2 every rank skips the same blocks), and each process scores it as one process does."""
    for got in _launch(tmp_path, 3, 2, cache="first_block"):
        assert got["calls"] == [[["p0", "p1", "p2"], _seeds([0, 1, 2]), True]]
        assert got["scored"] == ["p0", "p1", "p2"] and got["whole"] == 3
        _same_figures(got, 3)


@pytest.mark.slow
def test_context_groups_decode_and_score_once(tmp_path):
    """4 processes, context degree 2: two data ranks of two (global ranks 0, 1 and 2, 3). Both ranks of a group
    sample the group's share together; only the first decodes and scores it."""
    got = _launch(tmp_path, 3, 4, context=2)
    for r, share in ((0, [0, 1]), (1, [0, 1]), (2, [2, 2]), (3, [2, 2])):
        assert got[r]["calls"] == [[[f"p{i}" for i in share], _seeds(share), r % 2 == 0]], r
    assert [g["scored"] for g in got] == [["p0", "p1"], [], ["p2"], []]
    assert [g["whole"] for g in got] == [3, 0, 0, 0]
    for g in got:
        _same_figures(g, 3)


def test_padded_share_covers_the_items_once_in_order():
    """On one process the share is everything (nothing padded)."""
    assert dist.padded_share(3) == ([0, 1, 2], 3)
    with pytest.raises(ValueError, match="total=0"):
        dist.padded_share(0)
