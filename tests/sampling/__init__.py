"""Specifications of flowgrpo.sampling: the SDE transition and the rollout solvers."""
