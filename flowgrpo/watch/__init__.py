"""The training watchers: when a run has diverged and its one-line stop (:mod:`.divergence`), the rollout's x₀ norm
and its drift warning (:mod:`.x0_norm`), and the run's health watch applied around the epochs (:mod:`.run_health`)."""
