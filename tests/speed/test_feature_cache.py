"""sampling.cache / eval_sampling.cache: diffusers' feature caches where no log-prob reads the velocity.

Expected values are independent of the cache code: the uncached sampler's output (threshold 0 must equal it bit for
bit, FirstBlockCache computes every block whenever the first block's residual changed at all), the count of the last
transformer block's calls (a skipped step does not call it), and the plain transformer's forward."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.config import ConfigError, build_config
from flowgrpo.models.flux import FluxAdapter
from flowgrpo.sampling.config import FeatureCacheConfig
from flowgrpo.sampling.feature_cache import feature_cache
from flowgrpo.sampling.rollout import generate_images
from tests.training.test_forward_runs import _config

PROMPTS = ["a red cube", "a blue ball"]


def _tail_calls(adapter) -> list:
    """Calls of the last block's output projection: a block the cache skips is not run (its own forward hook would
    still fire, the cache replaces the forward it wraps)."""
    calls = []
    handle = adapter.transformer.single_transformer_blocks[-1].proj_out.register_forward_hook(
        lambda *a: calls.append(1))
    return calls, handle


def _eval(adapter, cache, steps=4):
    return generate_images(adapter, PROMPTS, [1, 2], num_steps=steps, guidance_scale=3.5, batch_size=2, cache=cache)


def test_threshold_zero_equals_the_uncached_sampler_and_a_skipping_cache_skips(tiny_flux):
    tail, handle = _tail_calls(tiny_flux)
    try:
        _check_skips(tiny_flux, tail)
    finally:
        handle.remove()


def _check_skips(tiny_flux, tail):
    plain = _eval(tiny_flux, None)
    assert len(tail) == 4  # one call per step of the one batch of 2
    tail.clear()
    exact = _eval(tiny_flux, FeatureCacheConfig(name="first_block", kwargs={"threshold": 0.0}))
    assert torch.equal(exact, plain) and len(tail) == 4  # nothing skipped: bit for bit the uncached images
    tail.clear()
    skipping = _eval(tiny_flux, FeatureCacheConfig(name="first_block", kwargs={"threshold": 1e9}))
    assert len(tail) == 1  # only the first step ran the remaining blocks; the others reused their residual
    assert not torch.equal(skipping, plain)
    assert not tiny_flux.transformer.is_cache_enabled  # off again after the sampler


def test_the_cache_is_off_outside_its_scope_even_after_an_error(tiny_flux):
    x = torch.randn(1, tiny_flux.initial_latents(1, None).shape[1], tiny_flux.initial_latents(1, None).shape[2])
    embeds = tiny_flux.encode_prompts(PROMPTS[:1])
    sigma = torch.tensor([0.5])
    plain = tiny_flux.velocity(x, sigma, embeds, 3.5)
    with pytest.raises(RuntimeError, match="boom"):
        with feature_cache(tiny_flux, FeatureCacheConfig(name="first_block", kwargs={"threshold": 1e9}), 2) as st:
            st.step(0.5)
            tiny_flux.velocity(x, sigma, embeds, 3.5)
            raise RuntimeError("boom")
    assert not tiny_flux.transformer.is_cache_enabled
    assert torch.equal(tiny_flux.velocity(x, sigma, embeds, 3.5), plain)


def test_a_cache_is_refused_for_the_sde_ratio_rollout_in_one_line():
    cache = {"cache": {"name": "first_block", "kwargs": {"threshold": 0.1}}}
    with pytest.raises(ConfigError) as err:
        build_config({"sampling": cache})  # the default objective, sde_ratio
    (line,) = str(err.value).splitlines()
    assert "sampling.cache='first_block' is refused with objective.name='sde_ratio'" in line and "log-probs" in line
    build_config({"eval_sampling": cache})  # evaluation records no log-prob: allowed with any objective
    build_config({"objective": "nft", "sampling": cache, "train": {"group_size": 4, "rollout_batch_size": 8}})


@pytest.mark.parametrize("cache, match", [
    ({"name": "first_block", "kwargs": {"thresh": 1}}, r"cache 'first_block' has no setting 'thresh'; allowed: "
                                                       r"\['threshold'\]"),
    ({"name": "mag", "kwargs": {"num_inference_steps": 5}}, "num_inference_steps is set from the sampler"),
    ({"name": "none", "kwargs": {"threshold": 1}}, "given with name none"),
    ({"name": "first_blok"}, "first_blok"),
])
def test_bad_cache_settings_are_refused_naming_the_value(cache, match):
    with pytest.raises(ConfigError, match=match):
        build_config({"eval_sampling": {"cache": cache}})


def test_the_cached_nft_rollout_trains_an_epoch_and_the_update_is_uncached(tmp_path, tiny_flux_dir, monkeypatch):
    from flowgrpo.runner import run
    from flowgrpo.writing.metrics import read_metrics

    seen = []  # (gradient enabled, cache enabled) of every velocity
    real = FluxAdapter.velocity

    def spy(self, *args, **kwargs):
        seen.append((torch.is_grad_enabled(), self.transformer.is_cache_enabled))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FluxAdapter, "velocity", spy)
    cache = {"name": "first_block", "kwargs": {"threshold": 1e9}}
    run(_config(tmp_path, tiny_flux_dir, "nft", sampling={"cache": cache}, eval_sampling={"cache": cache}))
    rec = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["objective/rows"] > 0 and rec["policy/grad_norm"] > 0
    trained = [c for g, c in seen if g]
    assert trained and not any(trained)  # every forward with gradient (the update's) ran the plain transformer
    assert sum(c for g, c in seen if not g) >= 6  # the rollout's (2 micro-batches x 3 steps) and eval ran cached


def _request(b: int, steps: int, kind: str = "flow_sde", cache=None):
    from flowgrpo.config import SamplingConfig
    from flowgrpo.sampling.rollout import RolloutRequest

    return RolloutRequest(PROMPTS * (b // 2), [{}] * b, torch.tensor([0, 1] * (b // 2)), torch.arange(b) // 2,
                          settings=SamplingConfig(num_steps=steps, guidance_scale=3.5, sde_kind=kind, noise_level=0.7),
                          batch_size=b, seed=3, epoch=0, ode_cache=cache)


def _at_epoch(request, epoch: int):
    from dataclasses import replace

    return replace(request, epoch=epoch)


def _recomputed(adapter, traj, step: int, shared: bool = False) -> torch.Tensor:
    """The log-probs of every row's transition ``step`` under the training forward (plain transformer)."""
    from flowgrpo.config import SamplingConfig
    from flowgrpo.sampling.packed_forward import packed_forward

    settings = SamplingConfig(num_steps=traj.num_steps, guidance_scale=3.5, sde_kind="flow_sde", noise_level=0.7)
    rows = torch.nonzero(traj.stochastic[:, step]).flatten()
    out = packed_forward(adapter, traj, [(rows, (step,))], settings, with_ref=False,
                         shared_inputs=[traj.group_ids[rows]] if shared else None)[0]
    return out.log_probs[:, 0].cpu(), rows


@torch.no_grad()
def test_ode_steps_are_cached_and_every_trained_transition_equals_the_training_forward(tiny_flux):
    """MixGRPO (window) and E-GRPO (entropy_merge) rollouts with a cache that skips every ODE step it may
    (first_block with an unreachable threshold): the ODE steps are cached (the latents entering the trained
    transitions differ from the uncached rollout's), while every recorded log-prob equals the plain training
    forward's at the recorded latents bit for bit (mismatch exactly 0.0)."""
    from flowgrpo.algo.chunkers import build_chunker, chunker_settings

    skip_all = FeatureCacheConfig(name="first_block", kwargs={"threshold": 1e9})
    window = build_chunker(chunker_settings("window", window_size=2, window_end="stay"))  # epoch 3: steps 3, 4
    calls, handle = _tail_calls(tiny_flux)
    try:
        plain = window.rollout(tiny_flux, _at_epoch(_request(4, 6), 3))
        calls.clear()
        cached = window.rollout(tiny_flux, _at_epoch(_request(4, 6, cache=skip_all), 3))
        # steps 0-2 (a run: the first computed, 2 skipped), 3-4 SDE (computed), 5 (a fresh run: computed)
        assert len(calls) == 4
    finally:
        handle.remove()
    assert not tiny_flux.transformer.is_cache_enabled
    assert cached.stochastic[0].tolist() == [False, False, False, True, True, False]
    assert not torch.equal(cached.latents[:, 3], plain.latents[:, 3])  # the ODE prefix was cached
    for t in (3, 4):
        lp, rows = _recomputed(tiny_flux, cached, t)
        assert float((lp - cached.log_probs[rows, t]).abs().max()) == 0.0

    merge = build_chunker(chunker_settings("entropy_merge", merge_steps=[3]))
    plain = merge.rollout(tiny_flux, _request(4, 6))
    cached = merge.rollout(tiny_flux, _request(4, 6, cache=skip_all))
    assert not tiny_flux.transformer.is_cache_enabled
    assert not torch.equal(cached.latents[:, 3], plain.latents[:, 3])  # the anchor prefix was cached
    lp, rows = _recomputed(tiny_flux, cached, 3, shared=True)
    assert float((lp - cached.log_probs[rows, 3]).abs().max()) == 0.0


def _settings(registry, name: str):
    """The settings of the registered strategy ``name`` (unvalidated: the cache check reads only its declarations
    and name)."""
    return registry.get(name).Config.model_construct(name=name)


def test_a_cache_on_ode_steps_is_allowed_for_window_and_entropy_merge_only():
    from flowgrpo.algo.chunkers import CHUNKERS
    from flowgrpo.algo.objectives import OBJECTIVES
    from flowgrpo.config.schema import check_cache_allowed

    sde_ratio = _settings(OBJECTIVES, "sde_ratio")
    for chunker in ("window", "entropy_merge"):
        check_cache_allowed(sde_ratio, "first_block", chunker=_settings(CHUNKERS, chunker))
        with pytest.raises(ValueError, match="mag is refused with chunker") as err:
            check_cache_allowed(sde_ratio, "mag", chunker=_settings(CHUNKERS, chunker))
        assert "\n" not in str(err.value)
    for chunker in ("per_step", "chunk", "trajectory"):
        with pytest.raises(ValueError, match="every step of its rollout is an SDE step") as err:
            check_cache_allowed(sde_ratio, "taylor_seer", chunker=_settings(CHUNKERS, chunker))
        assert "\n" not in str(err.value)
    for objective in ("dpo", "dpo_offline", "sft", "refl", "srpo", "opd"):  # no chunker of theirs has ODE steps
        for chunker in ("per_step", "window"):
            with pytest.raises(ValueError, match=rf"refused with objective.name='{objective}': caching is for the "
                                                 "awm, dgpo, nft rollouts .* the ODE steps of sde_ratio's "
                                                 "entropy_merge and window chunkers") as err:
                check_cache_allowed(_settings(OBJECTIVES, objective), "first_block",
                                    chunker=_settings(CHUNKERS, chunker))
            assert "\n" not in str(err.value) and "SDE step" not in str(err.value)
    for objective in ("nft", "awm", "dgpo"):
        check_cache_allowed(_settings(OBJECTIVES, objective), "mag", chunker=_settings(CHUNKERS, "per_step"))


def test_a_plugin_objective_whose_rollout_records_no_log_prob_is_allowed_a_cache():
    """The objective's settings answer whether its rollout may be cached (``caches_rollout``), never its name: a
    plugin objective registered here that declares so gets a cache, through the config's own check; one that does
    not declare it is refused."""
    from typing import ClassVar, Literal

    from flowgrpo.algo.objectives import OBJECTIVES, BaseObjective, ObjectiveConfig

    class PluginConfig(ObjectiveConfig):
        name: Literal["test_plugin_final_only"] = "test_plugin_final_only"
        caches_rollout: ClassVar[bool] = True

    class QuietConfig(ObjectiveConfig):
        name: Literal["test_plugin_quiet"] = "test_plugin_quiet"

    OBJECTIVES.register("test_plugin_final_only")(type("Plugin", (BaseObjective,), {"Config": PluginConfig}))
    OBJECTIVES.register("test_plugin_quiet")(type("Quiet", (BaseObjective,), {"Config": QuietConfig}))
    cache = {"cache": {"name": "first_block", "kwargs": {"threshold": 0.1}}}
    try:
        config = build_config({"objective": "test_plugin_final_only", "sampling": cache})
        assert config.sampling.cache.name == "first_block"
        with pytest.raises(ConfigError, match="sampling.cache='first_block' is refused with "
                                              "objective.name='test_plugin_quiet': caching is for the "
                                              "awm, dgpo, nft, test_plugin_final_only rollouts"):
            build_config({"objective": "test_plugin_quiet", "sampling": cache})
    finally:
        OBJECTIVES.unregister("test_plugin_final_only")
        OBJECTIVES.unregister("test_plugin_quiet")
