"""Specification of reward discovery (flowgrpo.rewards.registry: entry points, ``module:attr`` names, suggestions,
provenance, load errors). The strategies' registry (flowgrpo.strategies.registry) is specified in
tests/test_registry.py.

Discovery tests install throw-away plugin distributions (a ``*.dist-info`` folder with ``entry_points.txt`` and a
module beside it) on ``sys.path``, so the real ``importlib.metadata`` discovery runs; the installed
flowgrpo-rewards distribution is discovered beside them.
"""

from __future__ import annotations

import math
import sys
import textwrap
import uuid
from importlib.metadata import entry_points, version
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.rewards.registry import (
    GROUP,
    RewardLoadError,
    load_reward,
    registered_rewards,
    resolve_reward_factory,
)


def install_fake_dist(root, dist: str, ver: str, eps: dict[str, str], modules: dict[str, str]) -> None:
    """A minimal installed distribution under ``root``: METADATA, entry_points.txt, and top-level modules."""
    info = root / f"{dist.replace('-', '_')}-{ver}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {ver}\n")
    lines = "\n".join(f"{k} = {v}" for k, v in eps.items())
    (info / "entry_points.txt").write_text(f"[flowgrpo.rewards]\n{lines}\n")
    for mod, src in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))


GOOD_PLUGIN = """
    import torch
    from flowgrpo.rewards.base import BaseReward

    class Mean(BaseReward):
        name = "mean"

        def __init__(self, scale=1.0):
            self.scale = scale

        def score(self, images, prompts, metadata):
            return self.scale * images.mean(dim=(1, 2, 3))

    def factory(scale=1.0):
        return Mean(scale)

    class Holder:
        make = staticmethod(factory)

    class NoSetup:
        def __init__(self):
            pass

    class OnlyCall:
        def __call__(self, images, prompts, metadata):
            return [0.0] * len(prompts)
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Two fake distributions: one with a working and a broken plugin, one that reuses a name of the first."""
    tag = uuid.uuid4().hex[:8]
    good, broken, other = f"good_{tag}", f"broken_{tag}", f"other_{tag}"
    install_fake_dist(
        tmp_path / "a", "fake-plugins-a", "1.2.3",
        {f"mean_{tag}": f"{good}:Mean", f"broken_{tag}": f"{broken}:Reward", f"dup_{tag}": f"{good}:factory"},
        {good: GOOD_PLUGIN, broken: "raise ImportError('needs the missing package frobnicate')\n"},
    )
    install_fake_dist(
        tmp_path / "b", "fake-plugins-b", "0.9", {f"dup_{tag}": f"{other}:Other"},
        {other: "raise RuntimeError('must not be imported')\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    return SimpleNamespace(tag=tag, good=good, broken=broken, other=other)


def test_unknown_name_lists_registered_names_and_closest_match(plugins):
    names = sorted({ep.name for ep in entry_points(group=GROUP)})
    assert "jpeg_compressibility" in names  # the flowgrpo-rewards distribution is installed
    with pytest.raises(RewardLoadError) as info:
        resolve_reward_factory("jpeg_compresibility")
    msg = str(info.value)
    assert "did you mean 'jpeg_compressibility'" in msg
    for name in names:
        assert name in msg
    assert "module:attr" in msg
    with pytest.raises(RewardLoadError) as info:
        load_reward("jpeg_compresibility")
    msg = str(info.value)
    assert "did you mean 'jpeg_compressibility'" in msg
    for name in ("jpeg_compressibility", "jpeg_incompressibility", "remote", f"mean_{plugins.tag}"):
        assert repr(name) in msg
    assert "module:attr" in msg


def test_entry_point_name_loads_the_plugin_lazily_with_its_origin(plugins):
    reward, origin = load_reward("jpeg_compressibility", quality=80)
    assert type(reward).__name__ == "JpegCompressibility" and reward.quality == 80
    assert origin.target == "flowgrpo_rewards.jpeg:JpegCompressibility"
    assert origin.distribution == "flowgrpo-rewards" and origin.version
    t = plugins.tag
    reward, origin = load_reward(f"mean_{t}", scale=2.0)
    images = torch.rand(3, 3, 8, 8)
    torch.testing.assert_close(reward(images, ["a"] * 3, [{}] * 3), 2.0 * images.mean(dim=(1, 2, 3)))
    assert (origin.name, origin.target) == (f"mean_{t}", f"{plugins.good}:Mean")
    assert (origin.distribution, origin.version) == ("fake-plugins-a", "1.2.3")
    # the broken plugin and the other distribution's module were never imported
    assert plugins.broken not in sys.modules and plugins.other not in sys.modules


def test_module_attr_names_load_without_the_registry(plugins):
    from flowgrpo_rewards.jpeg import JpegCompressibility

    reward, origin = load_reward("flowgrpo_rewards.jpeg:JpegCompressibility")
    assert isinstance(reward, JpegCompressibility)
    assert origin.name == origin.target == "flowgrpo_rewards.jpeg:JpegCompressibility"
    # an installed package's module:attr records its distribution and version
    assert (origin.distribution, origin.version) == ("flowgrpo-rewards", version("flowgrpo-rewards"))
    reward, origin = load_reward(f"{plugins.good}:Holder.make", scale=3.0)
    images = torch.rand(2, 3, 4, 4)
    torch.testing.assert_close(reward(images, ["a", "b"], [{}, {}]), 3.0 * images.mean(dim=(1, 2, 3)))
    assert origin.target == f"{plugins.good}:Holder.make"


@pytest.mark.parametrize(("name", "needle"), [
    ("flowgrpo_rewards.jpeg:NoSuchReward", "NoSuchReward"),
    ("no_such_module_xyz:Reward", "no_such_module_xyz"),
    ("{good}:Nope", "Nope"),
    ("{broken}:Reward", "frobnicate"),
    (":Mean", "both parts"),
])
def test_bad_module_attr_is_a_load_error(plugins, name, needle):
    with pytest.raises(RewardLoadError, match=needle):
        load_reward(name.format(good=plugins.good, broken=plugins.broken))


def test_a_plugin_that_fails_to_import_breaks_only_runs_that_name_it(plugins):
    from flowgrpo.preflight import build_rewards

    t = plugins.tag
    composed, origins = build_rewards([SimpleNamespace(name=f"mean_{t}", weight=1.0, kwargs={})])
    assert list(composed.rewards) == [f"mean_{t}"] and origins[0].distribution == "fake-plugins-a"
    with pytest.raises(RewardLoadError, match=rf"broken_{t}.*fake-plugins-a 1\.2\.3.*frobnicate"):
        load_reward(f"broken_{t}")


def test_duplicate_name_is_an_error_naming_both_packages(plugins):
    t = plugins.tag
    with pytest.raises(RewardLoadError) as info:
        resolve_reward_factory(f"dup_{t}")
    msg = str(info.value)
    assert "fake-plugins-a 1.2.3" in msg and "fake-plugins-b 0.9" in msg and "registered twice" in msg
    with pytest.raises(RewardLoadError, match="registered twice"):
        registered_rewards()
    # names nobody else registers still load while the clash exists
    load_reward(f"mean_{t}")
    assert plugins.other not in sys.modules


def test_rejected_kwargs_and_non_rewards_are_load_errors(plugins):
    with pytest.raises(RewardLoadError, match="qualty"):
        load_reward("jpeg_compressibility", qualty=3)
    with pytest.raises(RewardLoadError, match="rejected its kwargs"):
        load_reward(f"mean_{plugins.tag}", colour="red")
    with pytest.raises(RewardLoadError, match=r"without setup\(device\) and __call__"):
        load_reward(f"{plugins.good}:NoSetup")
    with pytest.raises(RewardLoadError, match=r"OnlyCall without setup\(device\); a reward has both") as info:
        load_reward(f"{plugins.good}:OnlyCall")  # its __call__ is there: the message names only what is missing
    assert "__call__" not in str(info.value)


def test_the_readme_example_plugin_declares_and_loads_its_reward(monkeypatch):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[2] / "examples" / "reward_plugin"
    eps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["flowgrpo.rewards"]
    assert eps == {"colorfulness": "flowgrpo_colorfulness.reward:Colorfulness"}
    monkeypatch.syspath_prepend(str(root))  # as if installed: the same target through module:attr
    reward, _ = load_reward(eps["colorfulness"], scale=2.0)
    reward.setup("cpu")
    red = torch.zeros(1, 3, 4, 4)
    red[:, 0] = 1.0  # solid red: 0.3 * sqrt(255² + 127.5²) (Hasler & Süsstrunk M^(3)), halved by scale 2
    assert math.isclose(reward(red, ["r"], [{}]).item(), 0.3 * math.hypot(255, 127.5) / 2, rel_tol=1e-6)


def test_core_registers_the_remote_reward_and_the_server_command():
    assert registered_rewards()["remote"].value == "flowgrpo.rewards.remote:RemoteReward"
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("flowgrpo-reward-server") == "flowgrpo.rewards.server:main"
