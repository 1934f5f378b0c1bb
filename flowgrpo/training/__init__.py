"""Training, by job: the loop of timed phases (:mod:`.loop`, :class:`~flowgrpo.training.loop.Trainer`), the held-out
evaluation (:mod:`.evaluation`), the run's health watch (:mod:`.health_watch`), the update loop of every objective
(:mod:`.update`: inner epochs, optimizer steps, gradient accumulation and scaling), the one place a gradient is
applied (:mod:`.optim`), the run folder's life (:mod:`.run_folder`) and the end-of-run report (:mod:`.report`)."""
