"""bench/learning.py's ``--base-seed`` (no training, no base built): every (row, base, RL seed) runs from its own
base, in that order, into its own folder; the base's seed and sha256 are recorded and checked on ``--resume``; bad
base seeds are parser errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.bench.test_learning import fake_run, learning, parser_error  # noqa: F401 - the module fixture

#: hand-made stand-ins for three bases: their folders are never read, their digests are arbitrary hex strings
DIGESTS = {b: {"transformer": f"{b}" * 64, "vae": "f" * 64} for b in (1, 2, 7)}


@pytest.fixture
def fake_bases(learning, monkeypatch, tmp_path):  # noqa: F811
    """locate_base without a build: base b's folder ``tmp/base<b>``, its digest :data:`DIGESTS`\\[b]."""
    located = []

    def locate(seed):
        located.append(seed)
        return learning.Base(seed=seed, folder=tmp_path / f"base{seed}", sha256=DIGESTS[seed])

    monkeypatch.setattr(learning, "locate_base", locate)
    return located


def test_every_base_and_seed_runs_from_its_base(learning, fake_bases, monkeypatch, capsys, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    calls = []
    fig = learning.seed_figures(fake_run(tmp_path / "r", 0.99, {4: 0.98}))

    def fake_run_one(name, overrides, seed, out_root, base=None):
        calls.append((name, base.seed, seed, overrides))
        return {"row": name, "seed": seed, "overrides": overrides, "base_seed": base.seed,
                "base_sha256": base.sha256, **fig}

    monkeypatch.setattr(learning, "run_one", fake_run_one)
    monkeypatch.setattr(sys, "argv", ["learning.py", "--rows", "default", "--base-seed", "2", "7", "--seed", "0", "1",
                                      "--eval-every", "10", "--out", str(out)])
    learning.main()
    assert fake_bases == [2, 7]  # each base located (built if absent) once, before any run
    # base by base, RL seed by RL seed; the recorded overrides do not carry the machine's cache path
    assert [c[:3] for c in calls] == [("default", 2, 0), ("default", 2, 1), ("default", 7, 0), ("default", 7, 1)]
    assert all(c[3] == ["logging.eval_every=10"] for c in calls)
    printed = capsys.readouterr().out
    assert "| default | 2/0 2/1 7/0 7/1 |" in printed  # the row's runs, labelled base/RL seed
    assert "| default | 7 | `77777777…` | 1 |" in printed  # the per-run table names base 7 by its digest


def test_run_folder_and_override_point_at_the_base(learning, tmp_path):  # noqa: F811
    base = learning.Base(seed=7, folder=tmp_path / "digits-v2-seed7", sha256=DIGESTS[7])
    assert learning.run_path(tmp_path, "nft", 2, 7) == tmp_path / "nft" / "base7" / "seed2"
    assert learning.run_path(tmp_path, "nft", 2) == tmp_path / "nft" / "seed2"  # without --base-seed: as before
    assert learning.base_override(base) == [f"model.pretrained={tmp_path / 'digits-v2-seed7'}"]
    assert learning.base_override(None) == []
    # the override, applied after the row's, is what the run's config trains from
    cfg = learning.row_config(learning.base_override(base), 0, tmp_path / "run", "nft")
    assert cfg.model.pretrained == str(tmp_path / "digits-v2-seed7")


def test_resume_keeps_a_finished_run_of_the_same_base_only(learning, fake_bases, monkeypatch, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    overrides = ["logging.eval_every=10"]
    fig = learning.seed_figures(fake_run(tmp_path / "r", 0.99, {4: 0.98}))
    path = out / "default" / "base7" / "seed0.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"row": "default", "seed": 0, "overrides": overrides, "base_seed": 7,
                                "base_sha256": DIGESTS[7], **fig}))
    monkeypatch.setattr(learning, "run_one", lambda *a, **k: pytest.fail("a finished run was trained again"))
    argv = ["learning.py", "--rows", "default", "--base-seed", "7", "--seed", "0", "--eval-every", "10",
            "--out", str(out), "--resume"]
    monkeypatch.setattr(sys, "argv", argv)
    learning.main()
    # the same base seed rebuilt with other bytes (another machine): its figures are not this base's
    path.write_text(json.dumps({"row": "default", "seed": 0, "overrides": overrides, "base_seed": 7,
                                "base_sha256": DIGESTS[1], **fig}))
    with pytest.raises(ValueError, match="was run from base seed 7 with sha256"):
        learning.main()
    # a run without --base-seed has no base record: not a finished run of base 7 either
    path.write_text(json.dumps({"row": "default", "seed": 0, "overrides": overrides, **fig}))
    with pytest.raises(ValueError, match="was run from base seed None"):
        learning.main()


@pytest.mark.parametrize(("args", "words"), [
    (["--base-seed", "-1"], ("--base-seed", "0 and 2**32 - 1")),
    (["--base-seed", str(2**32)], ("--base-seed", "0 and 2**32 - 1")),
    (["--base-seed", "1", "2", "1"], ("--base-seed names 1 more than once",)),
    (["--seed", "0", "0"], ("--seed names 0 more than once",)),
    (["--base-seed", "1", "--set", "model.pretrained=/some/folder"], ("model.pretrained", "--base-seed")),
])
def test_bad_base_seeds_are_parser_errors(learning, fake_bases, monkeypatch, capsys, tmp_path, args,  # noqa: F811
                                          words):
    line = parser_error(learning, monkeypatch, capsys, ["--rows", "default", *args, "--out", str(tmp_path)])
    assert all(w in line for w in words), line
    assert fake_bases == []  # refused before any base is built


def test_base_seed_parses(learning, tmp_path):  # noqa: F811
    args, shared = learning.parse_args(["--rows", "default", "--base-seed", "0", "1", str(2**32 - 1)])
    assert args.base_seed == [0, 1, 2**32 - 1]
    assert learning.parse_args(["--rows", "default"])[0].base_seed is None  # default: the config's model
    assert Path(learning.make_parser().parse_args([]).out) == Path("runs/learning")
