"""What a run and the toolkit's other writers put on disk: the one rule every writer checks before any slow work
(:mod:`.outputs`), a run's lock on its ``output_dir`` (:mod:`.run_lock`), and the metrics sink (:mod:`.metrics`)."""
