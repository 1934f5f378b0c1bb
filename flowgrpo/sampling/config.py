"""The sampler's settings: how trajectories are sampled for training (``sampling:``), how evaluation images are
(``eval_sampling:``), and the feature cache of either; the run's :class:`~flowgrpo.config.Config` holds them as its
sections. They live beside the sampler that reads them, so the sampler needs nothing from the config package."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from flowgrpo.sampling.sde import FINAL_DECODES, SDE_KINDS
from flowgrpo.strategies.settings import Section, registered_name

SdeKindName = registered_name(SDE_KINDS, "sampling.sde_kind")
FinalDecodeName = registered_name(FINAL_DECODES, "sampling.final_decode")


class FeatureCacheConfig(Section):
    """A diffusers feature cache on the transformer while sampling (flowgrpo.sampling.feature_cache): skipped
    steps reuse earlier features, so it is allowed only where no log-prob reads the velocity."""

    name: Literal["none", "first_block", "mag", "taylor_seer", "faster"] = Field(
        "none", description="none; first_block (FirstBlockCacheConfig: skip the other blocks while the first "
        "block's residual changes by at most threshold, relative), mag (MagCacheConfig), taylor_seer "
        "(TaylorSeerCacheConfig) or faster (FasterCacheConfig)"
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="the diffusers config's settings, e.g. {threshold: 0.05} for first_block "
        "(mag's num_inference_steps and faster's timestep callback come from the sampler)"
    )

    @model_validator(mode="after")
    def _check_kwargs(self):
        if self.name == "none":
            if self.kwargs:
                raise ValueError(f"cache kwargs {self.kwargs!r} given with name none; set a cache name")
        else:
            from flowgrpo.sampling.feature_cache import cache_config

            cache_config(self.name, self.kwargs)
        return self


class SamplingConfig(Section):
    """How trajectories are sampled for training."""

    num_steps: int = Field(10, ge=1, description="T, denoising steps per trajectory")
    guidance_scale: float = Field(
        3.5, ge=0, description="the guidance embedding's input for guidance-distilled models (FLUX.1-dev, FLUX.2), "
        "the classifier-free guidance scale for the others (SD3.5, Qwen-Image, Wan, LTX-2, ...); per family: "
        "docs/models.md"
    )
    sde_kind: SdeKindName = Field("flow_sde", description="the rollout's SDE kind (flowgrpo.sampling.sde.SDE_KINDS)")
    noise_level: float = Field(
        0.7, ge=0, description="SDE noise: a for flow_sde and cps (cps: in [0, 1]), eta for dance_sde"
    )
    logprob_reduction: Literal["mean", "sum"] = Field("mean", description="reduce log-probs over latent dims")
    cps_simplified_logprob: bool = Field(
        False, description="CPS reference code's -(x-mean)^2 surrogate log-prob (needs a ~1e-5 clip range)"
    )
    same_noise_in_group: bool = Field(False, description="all G samples of a group start from one initial noise")
    sigma_one_guard: Literal["grid", "next"] = Field(
        "grid", description="flow_sde at sigma = 1, where s = a*sqrt(sigma/(1-sigma)) is infinite: 1-sigma uses the "
        "grid's second sigma (grid: the releases' sigma_max = sigmas[1]) or the transition's sigma_next (next); "
        "they differ only on a merged jump from sigma = 1 (E-GRPO)"
    )
    final_decode: FinalDecodeName = Field(
        "sample", description="latents decoded into the rewarded image: sample (the last SDE sample, Flow-GRPO) or "
        "x0_pred (x - sigma*v predicted at the last step, DanceGRPO/GCPO/MixGRPO/E-GRPO)"
    )
    cache: FeatureCacheConfig = Field(
        default_factory=FeatureCacheConfig, description="feature cache of the rollout: objective nft, awm or dgpo "
        "(their rollout records no log-prob), or sde_ratio with chunker window or entropy_merge, on their ODE steps "
        "only (off at every step whose velocity enters a log-prob); refused for the other chunkers; the update's "
        "forwards are never cached"
    )


class EvalSamplingConfig(Section):
    """How images are sampled for evaluation (ODE: no noise)."""

    num_steps: int = Field(40, ge=1, description="denoising steps for evaluation images")
    guidance_scale: float = Field(3.5, ge=0, description="guidance for evaluation images")
    cache: FeatureCacheConfig = Field(
        default_factory=FeatureCacheConfig, description="feature cache of the evaluation sampler (any objective)"
    )
