"""Feature caching through diffusers' cache hooks, only where no log-probability depends on the velocity.

diffusers 0.42 caches transformer features between denoising steps (``CacheMixin.enable_cache`` with a
``FirstBlockCacheConfig``, ``MagCacheConfig``, ``TaylorSeerCacheConfig`` or ``FasterCacheConfig``): a skipped step
reuses (or extrapolates) features of an earlier one, so its velocity is an approximation of the model's.

Where it is allowed (``sampling.cache`` and ``eval_sampling.cache``, :class:`~flowgrpo.config.FeatureCacheConfig`):

* the evaluation sampler (:func:`~flowgrpo.sampling.rollout.generate_images`): an ODE sample scored by the
  evaluation rewards; no gradient or ratio reads it;
* the rollout of the forward-process objectives (``nft``, ``awm``, ``dgpo``;
  :func:`~flowgrpo.sampling.final_rollout.solver_rollout`): only its final latent x₀ is kept, and the update
  trains on fresh noise around it with the real velocity.

* the ODE steps of an SDE-ratio rollout, whose velocity enters no log-prob: MixGRPO's steps outside the SDE
  window (chunker ``window``) and E-GRPO's shared anchor prefix and ODE continuations (``entropy_merge``), through
  :func:`ode_step_cache`: the cache is on only over each run of consecutive ODE steps, enabled fresh at its first
  step and disabled (its state dropped) before any step whose velocity enters a log-prob (an SDE step, an
  E-GRPO branch step). A cached ODE step changes which latent the next trained transition starts from, and the
  record holds that latent; the update recomputes the trained transition's velocity at it with the plain
  transformer, as the rollout did, so the recorded log-probs equal the training forward's bit for bit.

Where it is refused (one line, :func:`check_cache_allowed`): an SDE-ratio rollout whose every step's velocity
enters a recorded log-probability (the other chunkers: per_step, chunk, trajectory sample every step with the
SDE); a cached velocity there is not the one the update recomputes, so the on-policy ratio would no longer be 1.
``mag`` is refused on ODE segments: it maps its calibrated ratios by step index, which restarts at each segment.

The cache is on only inside :func:`feature_cache` (one micro-batch of trajectories: enabled at its start, with
fresh state, and disabled at its end); every other forward, the update's above all, runs the plain transformer.
Each transformer call inside a step gets its own cache context (``call0``, ``call1``, …: a CFG adapter's
conditional and unconditional forwards keep separate state), as the diffusers pipelines name theirs.

A cache decides for the whole batch of a call (first_block compares the batch's mean residual change), so a cached
sample depends on its batch-mates: the same batching reproduces it, another may not.

Exactness: ``first_block`` with ``threshold: 0`` skips no step (a step is skipped only when the first block's
residual changed by at most the threshold, relative) and gives the uncached sampler's output bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

#: ``sampling.cache.name`` -> the diffusers config class (by name, imported when used)
CACHE_CONFIGS = {
    "first_block": "FirstBlockCacheConfig",
    "mag": "MagCacheConfig",
    "taylor_seer": "TaylorSeerCacheConfig",
    "faster": "FasterCacheConfig",
}

#: config fields flowgrpo fills from the sampler (a user value is refused: it would disagree with the sampler)
_FILLED = {"mag": ("num_inference_steps",), "faster": ("current_timestep_callback",)}


def cache_config(name: str, kwargs: dict, num_steps: int | None = None, timestep=None):
    """The diffusers cache config ``name`` (:data:`CACHE_CONFIGS`) built from ``kwargs``; ``mag`` gets
    ``num_inference_steps = num_steps`` and ``faster`` its ``current_timestep_callback = timestep`` (the sampler's
    σ·1000) when given.

    Raises:
        ValueError: an unknown name, a key the config does not take or flowgrpo fills, or a value it refuses; one
            line naming the value.
    """
    import diffusers

    if name not in CACHE_CONFIGS:
        raise ValueError(f"cache name must be one of {sorted(CACHE_CONFIGS)} (or none), got {name!r}")
    cls = getattr(diffusers, CACHE_CONFIGS[name])
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    filled = _FILLED.get(name, ())
    for key in kwargs:
        if key in filled:
            raise ValueError(f"cache {name!r}: {key} is set from the sampler; remove it")
        if key not in fields or key.startswith("_"):
            allowed = sorted(f for f in fields - set(filled) if not f.startswith("_"))
            raise ValueError(f"cache {name!r} has no setting {key!r}; allowed: {allowed}")
    extra = {}
    if name == "mag" and num_steps is not None:
        extra["num_inference_steps"] = num_steps
    if name == "faster" and timestep is not None:
        extra["current_timestep_callback"] = timestep
    try:
        return cls(**kwargs, **extra)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cache {name!r} refuses {kwargs!r}: {' '.join(str(err).split())}") from None


@dataclass
class FeatureCache:
    """The open cache of one sampling loop (:func:`feature_cache`): call :meth:`step` before each step's velocity.

    Attributes:
        timestep: the current step's σ·1000 (``faster``'s timestep callback).
        calls: transformer calls in the current step so far (each gets context ``call<k>``).
    """

    timestep: float = 1000.0
    calls: int = 0

    def step(self, sigma: float) -> None:
        """A new denoising step at σ = ``sigma``: its transformer calls get contexts ``call0``, ``call1``, …"""
        self.timestep, self.calls = float(sigma) * 1000.0, 0


@contextlib.contextmanager
def feature_cache(adapter, cache, num_steps: int) -> Iterator[FeatureCache | None]:
    """Run the block with ``cache`` (a :class:`~flowgrpo.config.FeatureCacheConfig`, or None / name ``none``: no
    cache, yields None) enabled on ``adapter.transformer``, fresh, for a loop of ``num_steps`` steps; disabled on
    exit, whatever happens.

    Raises:
        ValueError: the transformer has no diffusers cache hooks (not a ``CacheMixin``), or a cache is already
            enabled on it.
    """
    if cache is None or cache.name == "none":
        yield None
        return
    from diffusers.models.cache_utils import CacheMixin

    transformer = adapter.transformer
    if not isinstance(transformer, CacheMixin):
        raise ValueError(f"cache {cache.name!r}: {type(transformer).__name__} has no diffusers cache hooks "
                         "(CacheMixin); set the cache's name to none")
    if transformer.is_cache_enabled:
        raise ValueError(f"cache {cache.name!r}: a cache is already enabled on the transformer")
    state = FeatureCache()
    transformer.enable_cache(cache_config(cache.name, dict(cache.kwargs), num_steps, lambda: state.timestep))
    open_contexts: list = []

    def before(module, args, kwargs):
        ctx = transformer.cache_context(f"call{state.calls}")
        ctx.__enter__()
        open_contexts.append(ctx)
        state.calls += 1

    def after(module, args, kwargs, output):
        open_contexts.pop().__exit__(None, None, None)

    handles = [transformer.register_forward_pre_hook(before, with_kwargs=True),
               transformer.register_forward_hook(after, with_kwargs=True, always_call=True)]
    try:
        yield state
    finally:
        for h in handles:
            h.remove()
        while open_contexts:
            open_contexts.pop().__exit__(None, None, None)
        transformer.disable_cache()



class OdeStepCache:
    """The feature cache of one sampling loop, on only over runs of ODE steps (:func:`ode_step_cache`): call
    :meth:`step` before each step's velocity, with ``cached`` False for a step whose velocity enters a log-prob.

    Attributes:
        segments: runs of cached ODE steps opened so far (each with fresh cache state).
        cached_steps: steps run with the cache on.
    """

    def __init__(self, adapter, cache, num_steps: int) -> None:
        self.adapter, self.cache, self.num_steps = adapter, cache, num_steps
        self._open = None
        self._state: FeatureCache | None = None
        self.segments = 0
        self.cached_steps = 0

    def step(self, sigma: float, cached: bool) -> None:
        """A new step at σ = ``sigma``: with ``cached`` the cache is on for its transformer calls (opened fresh at
        the first step of a run), otherwise it is closed first (its hooks removed, its state dropped)."""
        if not cached:
            self.close()
            return
        if self._open is None:
            self._open = feature_cache(self.adapter, self.cache, self.num_steps)
            self._state = self._open.__enter__()
            self.segments += 1
        self._state.step(sigma)
        self.cached_steps += 1

    def close(self) -> None:
        """Disable the cache if it is on (the plain transformer from now on)."""
        if self._open is not None:
            ctx, self._open, self._state = self._open, None, None
            ctx.__exit__(None, None, None)


@contextlib.contextmanager
def ode_step_cache(adapter, cache, num_steps: int) -> Iterator[OdeStepCache | None]:
    """An :class:`OdeStepCache` for a loop of ``num_steps`` steps with ``cache`` (a
    :class:`~flowgrpo.config.FeatureCacheConfig`, or None / name ``none``: yields None); the cache is off on exit,
    whatever happens.

    Raises:
        ValueError: ``mag`` (its step index would restart at every run of ODE steps).
    """
    if cache is None or cache.name == "none":
        yield None
        return
    if cache.name == "mag":
        raise ValueError("cache 'mag' is refused on ODE steps: its step index would restart at every run of them")
    steps = OdeStepCache(adapter, cache, num_steps)
    try:
        yield steps
    finally:
        steps.close()
