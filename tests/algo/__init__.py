"""Specifications of flowgrpo.algo: advantages, chunkers, policy losses, group filters, objectives, and the
releases' formulas (fidelity)."""
