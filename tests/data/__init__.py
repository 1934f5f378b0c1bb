"""Specifications of flowgrpo.data: prompt files and records, the public prompt sets."""
