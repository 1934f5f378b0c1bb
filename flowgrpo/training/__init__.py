"""Training, by job: the loop of timed phases (:mod:`.loop`, :class:`~flowgrpo.training.loop.Trainer`), the
training-layout forward (:mod:`.forward`), the update's schedule of micro-batches and optimizer steps
(:mod:`.schedule`), the one place a gradient is applied (:mod:`.optim`), the run folder's life
(:mod:`.run_folder`) and the end-of-run report (:mod:`.report`)."""
