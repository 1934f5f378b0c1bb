"""What the path objectives (ReFL / DRaFT, on-policy distillation) share: a rollout that keeps every latent of its
trajectory, and a draw that names the grid step it trains.

The forward-process objectives (:mod:`flowgrpo.algo.objectives.forward`) keep only the final sample x₀; ReFL and
DRaFT restart the sampler from a late latent of the rollout with gradient, and on-policy distillation scores the
student's own states x_{t_j}, so their rollout records the whole path (as the SDE rollout does,
:func:`flowgrpo.sampling.rollout.rollout`, whose loop and seeding this reuses: Euler steps (``ode``), or Flow-GRPO's
``flow_sde`` at noise level ``a`` on every step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flowgrpo.algo.objectives.forward import RowDraw
from flowgrpo.records import FinalSamples
from flowgrpo.sampling.rollout import RolloutRequest, rollout

__all__ = ["PathSamples", "PathDraw", "path_rollout", "decode_with_grad", "EULER_PATH_INSTEAD"]

#: the sampling settings an objective rolling out its own Euler path (:func:`path_rollout`) does not read, and why
#: (its ``ObjectiveConfig.instead``: DMD2, TDM-R1)
EULER_PATH_INSTEAD: dict[tuple[str, str], str] = {
    ("sampling", "sde_kind"): "its rollout is Euler steps",
    ("sampling", "noise_level"): "its rollout is Euler steps",
    ("sampling", "sigma_one_guard"): "its rollout is Euler steps",
    ("sampling", "final_decode"): "it decodes its rollout's final sample",
}


@dataclass(frozen=True)
class PathSamples(FinalSamples):
    """A rollout that keeps its whole path: :class:`~flowgrpo.records.FinalSamples` (``x0`` the final latents,
    ``sigmas`` the (T+1,) grid) and

    Attributes:
        latents: (B, T+1, …) float32, ``latents[:, i]`` the latent at ``sigmas[i]`` (index 0 the initial noise,
            index T = ``x0``), on the model's device or the host (``train.latents_on_cpu``).
    """

    latents: torch.Tensor


@dataclass(frozen=True)
class PathDraw(RowDraw):
    """A :class:`~flowgrpo.algo.objectives.forward.RowDraw` that names the grid step i its rows start from:
    ``sigma`` (n,) is ``sigmas[step]`` for every row; ``noise`` (n, …) is the draw's fresh ε (DRaFT-LV) or zeros."""

    step: int


def path_rollout(adapter, request: RolloutRequest, *, noise_level: float = 0.0) -> PathSamples:
    """One trajectory per requested sample on the model's grid of ``request.settings.num_steps`` steps, at the
    request's guidance: Euler (ODE) steps when ``noise_level`` is 0, else ``flow_sde`` steps with ``a = noise_level``
    on every step (Flow-GRPO's sampler, arXiv 2505.05470 eq. 9). The initial and SDE noise are seeded per sample as
    :func:`~flowgrpo.sampling.rollout.rollout` seeds them; images are decoded from the last latent.

    Raises:
        ValueError: a negative ``noise_level``, or a micro-batch size that does not divide the samples.
    """
    if noise_level < 0:
        raise ValueError(f"path_rollout: noise_level must be >= 0, got {noise_level}")
    t = request.settings.num_steps
    from flowgrpo.sampling.config import SamplingConfig

    settings = SamplingConfig(num_steps=t, guidance_scale=request.settings.guidance_scale,
                              sde_kind="flow_sde" if noise_level > 0 else "ode", noise_level=float(noise_level))
    traj = rollout(adapter, dataclasses.replace(request, settings=settings), torch.full((t,), noise_level > 0))
    return PathSamples(embeds=traj.embeds, images=traj.images, prompts=traj.prompts, metadata=traj.metadata,
                       guidance_scale=traj.guidance_scale, x0=traj.latents[:, -1], initial_noise=traj.latents[:, 0],
                       sigmas=traj.sigmas.float().cpu(), group_ids=traj.group_ids,
                       sample_index=request.sample_index.clone(), latents=traj.latents)


def decode_with_grad(adapter, latents: torch.Tensor, embeds=None) -> torch.Tensor:
    """The adapter's :meth:`decode` with the autograd graph back to ``latents``: (B, 3, H, W) float32 in [0, 1].
    The adapters decorate ``decode`` with ``torch.no_grad`` (sampling never needs a gradient); its body, the
    function the decorator wraps (``functools.wraps``' ``__wrapped__``), is the same arithmetic with the graph.
    ``embeds``: the rows' embeddings, passed to an adapter that decodes with them (``decode_needs_embeds``).

    Raises:
        RuntimeError: ``latents`` require a gradient but the decoded images have none (an adapter whose decode
            detaches inside its body), naming the adapter.
    """
    fn = type(adapter).decode
    extra = (embeds,) if getattr(adapter, "decode_needs_embeds", False) else ()
    images = getattr(fn, "__wrapped__", fn)(adapter, latents, *extra)
    if latents.requires_grad and not images.requires_grad:
        raise RuntimeError(f"{type(adapter).__name__}.decode detaches its output: the reward's gradient cannot reach "
                           "the latents")
    return images
