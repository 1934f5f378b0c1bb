"""The public API: every name ``flowgrpo`` exports resolves, and the version is the distribution's."""

from __future__ import annotations

from importlib.metadata import version

import flowgrpo


def test_every_export_resolves():
    for name in flowgrpo.__all__:
        assert getattr(flowgrpo, name) is not None, name


def test_version_matches_the_distribution():
    assert flowgrpo.__version__ == version("flowgrpo")
