"""The epoch line (flowgrpo.writing.metrics.epoch_line): progress, elapsed time and ETA, the reward, the trained share,
the later updates' figures, the first-update mismatch when it is news. Expected values are worked out by hand."""

from __future__ import annotations


def test_epoch_line_shows_progress_eta_reward_and_later_updates():
    from flowgrpo.writing.metrics import epoch_line

    record = {"reward/total/mean": 0.625, "reward/total/std": 0.25, "adv/kept_frac": 0.75, "plan/trained_frac": 0.5,
              "policy/clipfrac": 0.0, "policy/approx_kl": 0.0, "policy/logprob_mismatch_max": 0.0,
              "policy_later/clipfrac": 0.125, "policy_later/approx_kl": 3e-6}
    line = epoch_line(record, 4, 80, elapsed=65.0, eta=75 * 13.0)
    assert line.startswith("epoch 5/80 · 1:05 elapsed · ETA 16:15")  # 975 s = 16 min 15 s
    assert "reward 0.625 ± 0.25" in line
    assert "trained 75% of samples, 50% of steps" in line
    assert "later clip 0.125 kl 3e-06" in line
    assert "mismatch" not in line and "policy/clipfrac" not in line  # the on-policy step's 0 is not news
    line = epoch_line({**record, "adv/learning_frac": 0.75}, 4, 80, elapsed=65.0, eta=0.0)
    assert "trained 75% of samples, 50% of steps" in line  # every kept sample carries a signal: no note
    line = epoch_line({**record, "adv/learning_frac": 0.0}, 4, 80, elapsed=65.0, eta=0.0)
    assert "trained 75% of samples (0% with a learning signal), 50% of steps" in line  # a constant reward
    # an objective that does not train on the advantages (sft: each record drawn G times, equal rewards) has no
    # lack of signal to show
    line = epoch_line({**record, "adv/learning_frac": 0.0}, 4, 80, elapsed=65.0, eta=0.0, advantages=False)
    assert "trained 75% of samples, 50% of steps" in line and "learning signal" not in line
    # a forward objective (DiffusionNFT …) trains no chunker transitions: no "of steps" (its sample share is
    # plan/trained_samples_frac, not shown as steps)
    forward = {k: v for k, v in record.items() if k != "plan/trained_frac"} | {"plan/trained_samples_frac": 0.75}
    line = epoch_line(forward, 4, 80, elapsed=65.0, eta=0.0)
    assert "trained 75% of samples ·" in line and "of steps" not in line
    line = epoch_line({**record, "policy/logprob_mismatch_max": 1.2e-7}, 0, 3, elapsed=3725.0, eta=0.0)
    assert line.startswith("epoch 1/3 · 1:02:05 elapsed · ETA 0:00")
    assert line.endswith("first-update mismatch 1.2e-07")
