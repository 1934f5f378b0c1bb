"""Training, by job: the loop of timed phases (:mod:`.loop`, :class:`~flowgrpo.training.loop.Trainer`), the held-out
evaluation (:mod:`.evaluation`), the update loop of every objective (:mod:`.update`: inner epochs, optimizer steps,
gradient accumulation and scaling), the one place a gradient is applied (:mod:`.optim`), the trained weights' EMA
(:mod:`.ema`), the run folder's life (:mod:`.run_folder`), the end-of-run report (:mod:`.report`) and the pushed
weights' model card (:mod:`.model_card`). The run's health watch is :mod:`flowgrpo.watch.run_health`."""
