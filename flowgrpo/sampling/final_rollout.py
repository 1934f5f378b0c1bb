"""The rollout of the forward-process objectives: an ODE (or SA-Solver) sample per requested sample, keeping only
its final latent (DiffusionNFT, AWM and DGPO train on x₀ at fresh noise, so any solver may produce it).

The loop is the diffusers denoising loop with a registered solver step (:mod:`flowgrpo.sampling.solvers`) in
place of the scheduler's: the adapter's ``velocity`` at each grid σ, then ``step(x, v, sigmas, i, state)``. The
initial noise of a sample is seeded exactly as the SDE rollout's (:func:`flowgrpo.sampling.rollout.rollout`), so
the two rollouts of one epoch start from the same latents; a stochastic solver's noise has its own stream per
sample. Images are decoded per micro-batch and handed to the background scorer at once.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from flowgrpo.records import FinalSamples
from flowgrpo.rng import make_generator
from flowgrpo.sampling.feature_cache import feature_cache
from flowgrpo.sampling.rollout import RolloutRequest, decode_and_report, encode_rows
from flowgrpo.sampling.solvers import SOLVERS, check_grid

__all__ = ["solver_rollout"]


@torch.no_grad()
def solver_rollout(adapter, request: RolloutRequest, *, solver: str, sigmas: torch.Tensor,
                   train_sigmas: torch.Tensor | None = None, noise_level: float = 0.0, cache=None) -> FinalSamples:
    """Sample one final latent per requested sample with ``solver`` on the grid ``sigmas`` (T+1,), at the request's
    guidance.

    Args:
        adapter: the model adapter (its current weights sample; the caller swaps others in around this call).
        request: the samples, their seeds and the micro-batch size (``request.settings``: only ``num_steps`` and
            ``guidance_scale`` are read).
        solver: a registered :data:`~flowgrpo.sampling.solvers.SOLVERS` name.
        sigmas: (T+1,) float32 host grid the solver integrates on.
        train_sigmas: (T+1,) the grid recorded for the update's σ draws (default ``sigmas``; AWM trains on the grid
            its SA-Solver grid was made from).
        noise_level: the solver's noise (SA-Solver's τ); deterministic solvers ignore it.
        cache: a :class:`~flowgrpo.config.FeatureCacheConfig` (``sampling.cache``) enabled, fresh, around each
            micro-batch's loop (:func:`~flowgrpo.sampling.feature_cache.feature_cache`), or None: the rollout
            records no log-prob, so a cached velocity reaches only the final latent.

    Returns:
        :class:`~flowgrpo.records.FinalSamples` (latents on the adapter's device, or on the host with
        ``request.latents_on_cpu``; images on the host).

    Raises:
        ValueError: a bad grid (:func:`~flowgrpo.sampling.solvers.check_grid`), or ``request.batch_size`` not
            dividing the samples; KeyError: an unknown solver (listing the registered ones).
    """
    r = request
    b = len(r.prompts)
    if b % r.batch_size:
        raise ValueError(f"rollout batch_size {r.batch_size} must divide the {b} samples")
    check_grid(sigmas)
    step = SOLVERS.get(solver)
    grid = sigmas.float().cpu()
    embeds = encode_rows(adapter, list(r.prompts), list(r.metadata))
    pairs = list(zip(r.prompt_ids.tolist(), r.sample_index.tolist(), strict=True))
    init_gens = [make_generator(r.seed, r.epoch, pid, "init", 0 if r.same_noise_in_group else j) for pid, j in pairs]
    noise_gens = [make_generator(r.seed, r.epoch, pid, "solver", j) for pid, j in pairs]
    finals, starts, images = [], [], []
    for start in tqdm(range(0, b, r.batch_size), desc="rollout", disable=not r.progress, leave=False):
        sl = slice(start, start + r.batch_size)
        x = adapter.initial_latents(r.batch_size, init_gens[sl]).float()
        starts.append(x.cpu() if r.latents_on_cpu else x)
        rows, state = embeds.index(sl), None
        with feature_cache(adapter, cache, grid.numel() - 1) as cached:
            for i in range(grid.numel() - 1):
                if cached is not None:
                    cached.step(float(grid[i]))
                v = adapter.velocity(x, grid[i].expand(r.batch_size).to(x.device), rows, r.settings.guidance_scale)
                x, state = step(x, v, grid, i, state, generator=noise_gens[sl], noise_level=noise_level)
        finals.append(x.cpu() if r.latents_on_cpu else x)
        images.append(decode_and_report(adapter, x, r.prompts[sl], r.metadata[sl], r))
    return FinalSamples(
        x0=torch.cat(finals), initial_noise=torch.cat(starts),
        sigmas=(grid if train_sigmas is None else train_sigmas.float().cpu()),
        group_ids=r.prompt_ids.clone(), sample_index=r.sample_index.clone(), embeds=embeds,
        images=torch.cat(images), prompts=list(r.prompts), metadata=list(r.metadata),
        guidance_scale=r.settings.guidance_scale,
    )
