"""When the Ray engine sends weights and which epochs it issues ahead (no Ray needed: the schedule is decided alike on
every rank; here a rank without workers). The expected sequences are worked out by hand from the rule of
docs/async.md: epoch e trains version e; a group may lag at most S versions; weights go out every ``sync_every``
versions, an epoch sampled ahead that would lag more than S waits, and the epoch about to train forces a sync."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowgrpo.config.schema import RuntimeConfig
from flowgrpo.data.prompts import GroupSampler
from flowgrpo.runtime.ray_engine import RayRollouts


def _schedule(staleness: int, sync_every: int, epochs: int = 6, workers: int = 1) -> list[tuple[list, list]]:
    """Per epoch: (the versions synced, the epochs issued)."""
    settings = RuntimeConfig(engine="ray", max_staleness=staleness, sync_every=sync_every, rollout_workers=workers)
    engine = RayRollouts(settings, epochs, workers=None)
    model = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(epoch=0, sampler=GroupSampler(10, 2, 0), objective=object(),
                              cfg=SimpleNamespace(train=SimpleNamespace(group_size=2)),
                              optim=SimpleNamespace(unwrapped=model))
    synced, out = [], []
    engine._sync = lambda trainer, ws, version: (synced.append(version), [engine.synced.__setitem__(w, version)
                                                                            for w in ws])
    for e in range(epochs):
        trainer.epoch = e
        before, synced[:] = set(engine.issued), []
        engine.issue_window(trainer, trainer.sampler.next_prompt_ids())
        out.append((list(synced), sorted(set(engine.issued) - before)))
    return out


def test_staleness_zero_syncs_and_issues_each_epoch_itself():
    assert _schedule(0, 1) == [([e], [e]) for e in range(6)]


def test_staleness_one_issues_the_next_epoch_on_the_current_weights():
    assert _schedule(1, 1) == [([0], [0, 1])] + [([e], [e + 1]) for e in range(1, 5)] + [([], [])]


def test_sync_every_two_thins_the_syncs_and_the_epoch_ahead_waits():
    # epoch 1 cannot sample epoch 2 from version 0 (lag 2 > 1) and no sync is due: epoch 2 waits for its own
    assert _schedule(1, 2) == [([0], [0, 1]), ([], []), ([2], [2, 3]), ([], []), ([4], [4, 5]), ([], [])]


@pytest.mark.parametrize("staleness, sync_every", [(0, 3), (2, 2), (2, 5)])
def test_no_epoch_lags_more_than_the_staleness(staleness, sync_every):
    version_of = {}  # epoch -> the version its worker held when it was issued
    held = -1
    for e, (synced, issued) in enumerate(_schedule(staleness, sync_every, epochs=12)):
        held = synced[-1] if synced else held
        version_of.update({t: held for t in issued})
        assert all(e <= t for t in issued)
    assert sorted(version_of) == list(range(12))  # every epoch issued once
    assert all(0 <= t - v <= staleness for t, v in version_of.items())
