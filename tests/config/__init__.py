"""Specifications of flowgrpo.config (schema, loading, --help) and of the shipped configs/."""
