"""Specifications of the flowgrpo command's subcommands (flowgrpo.cli): sample, push."""
