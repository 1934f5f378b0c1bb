"""Checkpoints: writing and reading one (:mod:`.save_load`), a checkpoints root's health, rotation and resume
choice (:mod:`.health`), and the training state whole or as each process holds it (:mod:`.state_dicts`)."""
