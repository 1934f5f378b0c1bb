"""Sharded checkpoints (``parallel.sharding: fsdp2``): each process writes only its own shards of the trained
weights, the optimizer state, the EMA and the objective's old copy (torch's distributed checkpoint), and a
checkpoint moves between process counts both ways, whole (a one-process checkpoint) or sharded.

One torchrun of two CPU processes (gloo) and a few one-process jobs in this process, on the small block model of
``tests/training/sharded_checkpoint.py`` (AdamW, EMA, old copy). Expected values come from another path than the
checkpoint's: the whole tensors gathered with ``full_state_dict`` by the run that wrote the checkpoint; a step
after a resume is compared to the same step taken by one process (1e-6 relative: the two processes' gradients are
reduced in another order).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.training.test_distributed import _free_port
from tests.training.test_sharding import ENV, REPO

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "training" / "sharded_checkpoint.py"


def _in_process(root: Path, *jobs: str) -> None:
    """The one-process jobs, on one thread as the torchrun children (``OMP_NUM_THREADS=1``): a matrix product split
    over another number of threads rounds otherwise (on an AMD EPYC, where MKL ignores its reproducibility branch,
    the EMA after a resumed step then differed by 1.1e-5 relative under pytest's default threads)."""
    sys.path.insert(0, str(WORKER.parent))
    from tests.training import sharded_checkpoint

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sharded_checkpoint.main(root, list(jobs))
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sharded_checkpoint")
    _in_process(root, "step", "one")  # one process: a whole checkpoint
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
         str(WORKER), str(root), "resume", "one", "two", "resume", "two", "three"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    _in_process(root, "resume", "two", "four", "resume", "one", "five", "fsdp2", "resume", "two", "six")
    return root


def _close(a: dict, b: dict, rtol: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        scale = a[k].abs().max().clamp(min=1e-30)
        assert float((a[k] - b[k]).abs().max() / scale) <= rtol, (what, k)


def test_each_process_writes_only_its_own_shards(runs):
    from torch.distributed.checkpoint import FileSystemReader

    folder = runs / "two" / "epoch_0"
    assert not any((folder / f).exists() for f in ("trainable.safetensors", "optimizer.pt", "ema.safetensors",
                                                   "objective.safetensors"))
    files = sorted(p.name for p in (folder / "sharded").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    whole = load_file(runs / "two.expected.safetensors")  # every tensor of the state, whole
    whole_bytes = sum(v.numel() * 4 for k, v in whole.items() if not k.endswith(".step"))
    for f in files[1:]:  # about half the bytes each (the files' own per-tensor overhead is a few per cent)
        size = (folder / "sharded" / f).stat().st_size
        assert 0.45 * whole_bytes < size < 0.6 * whole_bytes, (f, size, whole_bytes)
    meta = FileSystemReader(folder / "sharded").read_metadata()
    file_of = {(i.fqn, tuple(i.offset)): s.relative_path for i, s in meta.storage_data.items()}
    split = 0
    for key, md in meta.state_dict_metadata.items():
        if key.endswith(".step"):  # a scalar, the same on every process: written once
            continue
        # the rows of every tensor are split between the two processes' files, none written twice
        assert sorted(c.offsets[0] for c in md.chunks) == [0, md.size[0] // 2], key
        assert sum(c.sizes[0] for c in md.chunks) == md.size[0], key
        assert {file_of[(key, tuple(c.offsets))] for c in md.chunks} == {"__0_0.distcp", "__1_0.distcp"}, key
        split += 1
    assert split == len(whole) - sum(k.endswith(".step") for k in whole)


def test_a_sharded_run_reads_no_whole_file_on_other_processes(runs):
    """Resuming the one-process (whole) checkpoint on two processes: the main process reads the files and sends
    the other its shards; the other reads only the RNG state."""
    reads = json.loads((runs / "reads_1.json").read_text())
    assert not {"trainable.safetensors", "optimizer.pt", "ema.safetensors", "objective.safetensors"} & set(reads)
    assert {"trainable.safetensors", "optimizer.pt", "ema.safetensors", "objective.safetensors"} <= set(
        json.loads((runs / "reads_0.json").read_text()))


def test_checkpoints_move_between_one_and_two_processes(runs):
    # one process whole -> two sharded; two -> two; two -> one unsharded; two -> one sharded (another mesh)
    for src, loaded in (("one", "two"), ("two", "three"), ("two", "four"), ("two", "six")):
        expected = load_file(runs / f"{src}.expected.safetensors")  # the writer's own state, gathered
        got = load_file(runs / f"{loaded}.loaded.safetensors")
        assert expected.keys() == got.keys() and len(expected) > 50, (src, loaded)
        assert all(torch.equal(expected[k], got[k]) for k in expected), (src, loaded)
    # the step after a resume: two processes (from the whole checkpoint) as one process takes it
    _close(load_file(runs / "five.expected.safetensors"), load_file(runs / "two.expected.safetensors"), 1e-6,
           "a step after resuming on two processes")
