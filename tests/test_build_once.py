"""``flowgrpo.cache.build_once``: concurrent builders of one artefact build it once (the others wait on the lock)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from flowgrpo.cache import build_once


def _slow_build(tmp: Path, log: Path) -> None:
    with log.open("a") as fh:  # one line per build actually run
        fh.write("built\n")
    time.sleep(1.0)
    (tmp / "model_index.json").write_text("{}")


def _builder(target: str, log: str) -> None:
    build_once(Path(target), lambda tmp: _slow_build(tmp, Path(log)))


def test_concurrent_builders_build_once(tmp_path):
    target, log = tmp_path / "model", tmp_path / "builds.log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_builder, args=(str(target), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert log.read_text().splitlines() == ["built"]  # without the lock each of the three builds its own copy
    assert (target / "model_index.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.tmp-")]  # no leftover copy
