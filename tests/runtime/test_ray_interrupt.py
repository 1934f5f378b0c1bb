"""Ctrl-C on a ``runtime.engine: ray`` run (docs/async.md, "Launch"): the terminal's SIGINT reaches the whole
foreground process group (the driver and the local Ray instance's daemons and workers started from it). The run
ends as a torchrun run does: exit status 130, one "interrupted …; resume: …" line, the last checkpoint intact (the
printed command resumes from it), and no process of the run's Ray instance left behind."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests.runtime.test_ray_identity import REPO

pytest.importorskip("ray")

SMALL = ["train.prompts_per_epoch=2", "train.group_size=4", "train.rollout_batch_size=4", "data.eval_num_prompts=2",
         "logging.save_every=1"]


def _default_sigint() -> None:
    """In the child: SIGINT back to its default (a suite started in the background has it ignored; see
    tests/inputs/test_run_folder.py)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _marked(mark: str) -> list[psutil.Process]:
    """The live processes whose environment carries ``FLOWGRPO_TEST_RUN=mark``: the run and everything it started,
    whoever their parent is now (a daemon whose parent died is adopted by init)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("FLOWGRPO_TEST_RUN") == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _cli(args: list[str], env: dict, cwd, log) -> subprocess.Popen:
    """``python -m flowgrpo.cli ARGS`` in a session of its own, its output in the file ``log`` (not a pipe: a
    process left behind holding the pipe would keep the test waiting instead of failing it)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "flowgrpo.cli", *args], cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                                preexec_fn=_default_sigint)


@pytest.mark.slow
def test_ctrl_c_on_ray_ends_the_run_with_its_line_and_no_ray_process_left(tmp_path):
    mark = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWGRPO_TEST_RUN": mark,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "rewards"), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "run"
    args = ["train", str(REPO / "configs" / "tiny_jpeg.yaml"), "runtime.engine=ray", "train.num_epochs=500",
            *SMALL, f"output_dir={out}"]
    proc = _cli(args, env, tmp_path, tmp_path / "run.log")
    latest = out / "checkpoints" / "latest"
    while not latest.exists() and proc.poll() is None:  # no deadline: as long as the machine takes
        time.sleep(0.5)
    names = " ".join(p.name() for p in _marked(mark))
    assert "raylet" in names and "gcs_server" in names, names  # the mark reaches Ray's processes: the check can fail
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    proc.wait()
    err = (tmp_path / "run.log").read_text()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("interrupted ")]
    assert len(lines) == 1, err[-3000:]
    assert re.match(r"interrupted in epoch [1-9]\d*/500; last checkpoint .* is intact; resume: flowgrpo train ",
                    lines[0]), lines[0]
    # no process of the run's Ray instance is left, whoever its parent is now: none carrying the run's mark (given
    # time to exit, not to do any work)
    _, alive = psutil.wait_procs(_marked(mark), timeout=60)
    left = [(p.pid, p.name()) for p in alive if p.is_running()]
    for p in alive:  # not left for the next test to find
        p.kill()
    assert not left, left
    _resume_works(lines[0], out, env, tmp_path)


def _resume_works(line: str, out, env: dict, cwd) -> None:
    """Run the printed resume command for one more epoch: it starts from the checkpoint left (epoch k), trains
    epoch k + 1 and ends with status 0, no process of its Ray instance left."""
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / "state.json").is_file() and (ckpt / "trainable.safetensors").is_file()
    k = int(ckpt.name.split("_")[-1])
    words = shlex.split(line.split("; resume: ", 1)[1])
    assert words[:2] == ["flowgrpo", "train"], words
    proc = _cli([*words[1:], f"train.num_epochs={k + 2}"], env, cwd, cwd / "resume.log")
    proc.wait()
    err = (cwd / "resume.log").read_text()
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed from {ckpt} " in err, err[-3000:]  # from the checkpoint left, not started over
    assert (out / "checkpoints" / f"epoch_{k + 1}" / "trainable.safetensors").is_file(), err[-3000:]
    _, alive = psutil.wait_procs(_marked(env["FLOWGRPO_TEST_RUN"]), timeout=60)
    assert not alive, [p.name() for p in alive]
