"""SFT: supervised fine-tuning with the flow-matching loss on a dataset of (prompt, image).

For a dataset image's clean latent x₀ (:mod:`flowgrpo.sampling.dataset_rollout`), noise ε and a training σ,
``x_σ = (1 − σ)·x₀ + σ·ε`` and the loss of a row is

    loss = mean_dims((v_θ(x_σ, σ) − (ε − x₀))²) [+ β_KL·mean_dims((v_θ − v_ref)²)]

the rectified-flow loss of SD3 (Esser et al., arXiv 2403.03206, eq. 2 with the velocity target ε − x₀ and the
weighting 1 of the logit-normal scheme, sec. 3.1; diffusers' ``examples/dreambooth/train_dreambooth_lora_sd3.py``:
``target = noise - model_input``, ``loss = mean((weighting * (model_pred - target)**2).reshape(bsz, -1), 1)``
with ``compute_loss_weighting_for_sd3`` = 1 for ``logit_normal``). The σ's are drawn as that script draws its
``u``: :func:`diffusers.training_utils.compute_density_for_timestep_sampling` (``weighting_scheme``
``logit_normal`` with ``logit_mean`` 0 and ``logit_std`` 1 by default, ``uniform``, or ``mode`` with
``mode_scale`` 1.29), used as σ directly (the script maps u to an index of its scheduler's shifted training
timesteps; here σ = u, the unshifted density — a deliberate difference, docs/fidelity_forward.md).

The "rollout" is the epoch's dataset records (``data.train_prompts`` names the dataset file, layout in
:mod:`flowgrpo.data.image_sets`): each record is a group of ``train.group_size`` samples of the same image, each
with its own σ's and noise. The rewards score the dataset images (logged; the loss does not read them).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from flowgrpo.algo.objectives.base import OBJECTIVES
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, noised, velocity_mse, velocity_target
from flowgrpo.algo.objectives.forward import (
    DATASET_INSTEAD,
    DATASET_UNREAD,
    NO_OLD_COPY_UNREAD,
    ForwardConfig,
    ForwardObjective,
    ForwardWork,
    RowDraw,
)
from flowgrpo.data.image_sets import TARGET_KEY, dataset_folder
from flowgrpo.rng import make_generator
from flowgrpo.sampling.dataset_rollout import dataset_rollout

__all__ = ["SFT", "SFTConfig", "SigmaDensityConfig", "seeded_draws", "sft_terms", "train_sigmas"]

WeightingScheme = Literal["logit_normal", "uniform", "mode"]


def train_sigmas(k: int, settings, generator: torch.Generator) -> torch.Tensor:
    """(k,) float32 host training σ's in (0, 1) from the settings' density (``weighting_scheme``, ``logit_mean``,
    ``logit_std``, ``mode_scale`` of a validated :class:`SigmaDensityConfig`), drawn by diffusers'
    ``compute_density_for_timestep_sampling`` with ``generator``."""
    from diffusers.training_utils import compute_density_for_timestep_sampling  # its import pulls diffusers' models

    return compute_density_for_timestep_sampling(settings.weighting_scheme, k, logit_mean=settings.logit_mean,
                                                 logit_std=settings.logit_std, mode_scale=settings.mode_scale,
                                                 generator=generator).float()


def seeded_draws(samples, rows: torch.Tensor, k: int, density, *parts: object) -> list[RowDraw]:
    """The K draws of micro-batch ``rows`` (K ≥ 1), each row's own: one generator per row,
    :func:`~flowgrpo.rng.make_generator` of (``parts``, the row's group id, its sample index), draws the row's K σ's
    (:func:`train_sigmas` of ``density``) and then its K noises ε (K, …) of the shape of one of ``samples.x0``, so a
    row's draws depend on its sample and the parts, never on the batching or the process.

    Args:
        samples: the rollout (``group_ids``, ``sample_index`` (B,) and ``x0`` (B, …) are read).
        rows: (n,) long host, local sample indices. density: the σ density's settings (:func:`train_sigmas`).
        parts: the generator's scope before the sample, e.g. (seed, epoch, pass, the objective's name).

    Returns:
        K :class:`~flowgrpo.algo.objectives.forward.RowDraw`, draw j holding every row's j-th σ (n,) and noise (n, …),
        float32 host.
    """
    sig, eps = [], []
    for r in rows.tolist():
        g = make_generator(*parts, int(samples.group_ids[r]), int(samples.sample_index[r]))
        sig.append(train_sigmas(k, density, g))
        eps.append(torch.randn((k, *samples.x0.shape[1:]), generator=g))
    sig_t, eps_t = torch.stack(sig), torch.stack(eps)
    return [RowDraw(rows, sig_t[:, j], eps_t[:, j]) for j in range(k)]


def sft_terms(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, settings: SFTConfig, *,
              v_ref: torch.Tensor | None = None) -> ObjectiveTerms:
    """The flow-matching loss of N rows (module docstring), float32.

    Args:
        v: (N, …) the trained velocity at x_σ, with gradient. noise: (N, …) ε. x0: (N, …) the dataset latents.
        settings: the validated :class:`SFTConfig` (``kl_beta`` is read). v_ref: (N, …) the reference velocity,
            needed when ``kl_beta > 0``.

    Returns:
        ``loss`` (N,) and the detached stats ``fm_loss`` (the flow-matching error) and ``kl_ref``.

    Raises:
        ValueError: mismatched shapes, or ``kl_beta > 0`` without ``v_ref``.
    """
    if noise.shape != v.shape or x0.shape != v.shape:
        raise ValueError(f"sft_terms shapes disagree: v {tuple(v.shape)}, noise {tuple(noise.shape)}, x0 "
                         f"{tuple(x0.shape)}")
    if settings.kl_beta > 0 and v_ref is None:
        raise ValueError(f"sft kl_beta={settings.kl_beta} needs the reference velocity v_ref")
    fm = velocity_mse(v, velocity_target(x0, noise))
    kl = velocity_mse(v, v_ref.detach()) if v_ref is not None else torch.zeros_like(fm)
    loss = fm + settings.kl_beta * kl if settings.kl_beta else fm
    return ObjectiveTerms(loss=loss, stats={"fm_loss": fm.detach(), "kl_ref": kl.detach()})


class SigmaDensityConfig(ForwardConfig):
    """The training-σ knobs ``sft``, ``dpo`` and ``dpo_offline`` share (a settings base; no objective of its own);
    :func:`train_sigmas` reads it as it is (validated once, here).

    Attributes:
        num_train_timesteps: K ≥ 1, the σ's each sample (or pair) trains per pass (diffusers' SD3 DreamBooth script
            and Flow-Factory's DPO: 1).
        weighting_scheme, logit_mean, logit_std, mode_scale: the σ density (the script's defaults: ``logit_normal``
            with mean 0 and std 1 > 0; ``mode`` with scale 1.29; ``uniform``).
    """

    num_train_timesteps: int = Field(1, ge=1, description="sft/dpo: training sigmas per sample (or pair) per pass "
                                     "(diffusers' SD3 DreamBooth script and Flow-Factory's DPO: 1)")
    weighting_scheme: WeightingScheme = Field("logit_normal", description="sft/dpo: the training sigma density "
                                              "(diffusers compute_density_for_timestep_sampling): logit_normal, "
                                              "uniform, mode")
    logit_mean: float = Field(0.0, description="sft/dpo: mean of the logit-normal sigma density")
    logit_std: float = Field(1.0, gt=0, description="sft/dpo: std of the logit-normal sigma density")
    mode_scale: float = Field(1.29, description="sft/dpo: the scale of the 'mode' sigma density")


class SFTConfig(SigmaDensityConfig):
    """``objective: {name: sft, ...}``: the flow-matching loss on the dataset ``data.train_prompts`` names
    (:mod:`flowgrpo.data.image_sets`); the σ density of diffusers' SD3 DreamBooth script. :func:`sft_terms` reads it
    as it is: ``kl_beta`` (β_KL ≥ 0 of the velocity KL to the reference; 0, the script's: none)."""

    name: Literal["sft"] = "sft"
    trains_on: ClassVar[str] = "the dataset's images"
    instead: ClassVar[dict[tuple[str, str], str]] = DATASET_INSTEAD
    unread: ClassVar[dict[str, str]] = {**DATASET_UNREAD, **NO_OLD_COPY_UNREAD,
                                        "adv_clip_max": "no advantage enters its loss"}


@OBJECTIVES.register("sft")
class SFT(ForwardObjective):
    """SFT (module docstring) in the training loop: the epoch's dataset records encoded, K σ's and noises per
    sample seeded by (seed, epoch, pass, the sample), no old copy; the reference is forwarded only for a KL."""
    #: why rollout workers (runtime.engine: ray) cannot serve it
    rollout_workers_refusal = "it trains on a dataset and samples no rollout"

    Config = SFTConfig
    uses_old_copy = False
    trains_on_advantages = False  # the dataset's images (or pairs) are the signal, whatever the rewards

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return self.o.num_train_timesteps

    def image_key(self, j: int) -> str:
        """The metadata key of sample j's image: the record's ``target``."""
        return TARGET_KEY

    def rollout(self, adapter, request):
        """The epoch's dataset images encoded (:func:`~flowgrpo.sampling.dataset_rollout.dataset_rollout`); the
        grid recorded is the model's (unused by the σ draws)."""
        return dataset_rollout(adapter, request, folder=dataset_folder(self.cfg.data.train_prompts),
                               image_key=self.image_key, sigmas=adapter.sigmas(request.settings.num_steps))

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[RowDraw]:
        """Per sample, K σ's and K noises from a generator of (seed, epoch, pass, the sample)
        (:func:`seeded_draws`)."""
        return seeded_draws(work.samples, rows, self.o.num_train_timesteps, self.o, self.cfg.train.seed, work.epoch,
                            inner, "sft")

    def terms(self, adapter, work: ForwardWork, draw: RowDraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """v_ref (when kl_beta > 0), then v_θ; :func:`sft_terms`."""
        sigma, noise = draw.sigma.to(x0.device), draw.noise.to(x0.device)
        x_t = noised(x0, noise, sigma)
        v_ref = self.velocity(adapter, x_t, sigma, embeds, weights="reference") if self.o.kl_beta > 0 else None
        v = self.velocity(adapter, x_t, sigma, embeds)
        return sft_terms(v, noise, x0, self.o, v_ref=v_ref)
