"""Specification of the name → object registry of strategies (flowgrpo.strategies.registry): names listed, a typo
answered
with the registered names and the closest match, a name registered twice refused. Reward discovery is specified in
tests/rewards/test_registry.py."""

from __future__ import annotations

import pytest

from flowgrpo.strategies.registry import Registry


def test_registry_lists_names_suggests_and_refuses_duplicates():
    reg: Registry = Registry("widget")
    reg.register("alpha")(1)
    reg.register("beta")(2)
    assert reg.get("beta") == 2 and reg.names() == ["alpha", "beta"] and "alpha" in reg
    with pytest.raises(KeyError) as err:
        reg.get("alpah")
    assert "unknown widget 'alpah'" in str(err.value) and "['alpha', 'beta']" in str(err.value)
    assert "did you mean 'alpha'" in str(err.value)
    with pytest.raises(ValueError, match="twice"):
        reg.register("alpha")(3)


def test_an_alias_resolves_to_its_name_and_is_listed_when_a_name_is_unknown():
    reg: Registry = Registry("widget")
    reg.register("alpha")(1)
    reg.alias("first", "alpha")
    assert reg.get("first") == 1 and reg.canonical("first") == "alpha" and reg.canonical("alpha") == "alpha"
    assert "first" in reg and reg.names() == ["alpha"]
    with pytest.raises(KeyError) as err:
        reg.get("frist")
    assert "'first' = 'alpha'" in str(err.value) and "did you mean 'first'" in str(err.value)
    with pytest.raises(ValueError, match="already"):
        reg.alias("alpha", "alpha")
