"""The training-layout forward: one batched transformer call over several (rows, chunk) items, giving the
log-probs, KL to the reference and transition moments the update differentiates.

Rollout and training share the adapter's ``velocity`` and :func:`~flowgrpo.sampling.sde.sde_step`, so the first
ratio of an on-policy update is exactly 1 when the layouts agree (``docs/design.md``, "Exactness").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flowgrpo.records import Trajectory
from flowgrpo.sampling.sde import kl_to_reference, sde_step, sigma_one_next, transition_moments

if TYPE_CHECKING:
    from flowgrpo.sampling.config import SamplingConfig


@dataclass(frozen=True)
class ChunkForward:
    """One batched forward of n samples' k chunk steps under the training layout.

    Attributes:
        log_probs: (n, k) float32, with gradient.
        kl: (n, k) float32 KL to the reference, or None.
        means: (n, k, …) float32 transition means; stds: (n, k) transition stds; dts: (n, k) σ_next − σ.
    """

    log_probs: torch.Tensor
    kl: torch.Tensor | None
    means: torch.Tensor
    stds: torch.Tensor
    dts: torch.Tensor


def packed_forward(adapter, traj: Trajectory, work: list[tuple[torch.Tensor, tuple[int, ...]]],
                   settings: SamplingConfig, *, with_ref: bool, kl_form: str = "flow_grpo",
                   shared_inputs: list[torch.Tensor | None] | None = None) -> list[ChunkForward]:
    """One batched forward of several items' transitions: per item (rows, chunk), its log-probs (n, k), KL (n, k)
    or None, and moments.

    Args:
        adapter: the model adapter (its ``velocity`` and, with ``with_ref``, its ``reference``).
        traj: the rollout record; its latents may live on the host or the device.
        work: items (rows, chunk): rows (n,) long sample indices (host), chunk a tuple of k step indices.
        settings: the rollout's SDE settings.
        with_ref: also compute the KL to the reference policy per latent dim
            (:func:`~flowgrpo.sampling.sde.kl_to_reference` of form ``kl_form``, ``objective.kl_form``).
        shared_inputs: per item, (n,) long keys or None; rows with equal keys have bit-identical transformer
            inputs at every step of the chunk (E-GRPO: the G samples of a (prompt, branch step) group start their
            jump from one anchor latent), so the transformer runs once per (key, step) and its velocity is shared;
            the gradient of the shared forward sums over the rows, exactly as separate forwards would.

    The batch is item-major, then sample-major: element Σ_{i'<i} n_i'·k_i' + r·k + j is item i's sample
    ``rows[r]`` at step ``chunk[j]``; for one item of k = 1 and rows a rollout micro-batch this is exactly the
    rollout's layout. Every result is on the adapter's device.
    """
    shared_inputs = shared_inputs or [None] * len(work)
    rows_l, steps_l, keys = [], [], []  # built as host lists: two tensors, whatever the number of items
    for (rows, chunk), shared in zip(work, shared_inputs, strict=True):
        for r in rows.tolist():
            rows_l += [r] * len(chunk)
            steps_l += chunk
        keys += ([None] * (len(rows) * len(chunk)) if shared is None
                 else [(key, t) for key in shared.tolist() for t in chunk])
    rows_e, steps_e = torch.tensor(rows_l), torch.tensor(steps_l)  # (N,) host
    ends_e = steps_e + traj.jump[rows_e, steps_e]  # the transition's end (E-GRPO: m steps on)
    dev, src = adapter.device, traj.latents.device
    rows_s = rows_e.to(src)
    x = traj.latents[rows_s, steps_e.to(src)].to(dev)  # (N, …)
    x_next = traj.latents[rows_s, ends_e.to(src)].to(dev)
    sigma, sigma_next = traj.sigmas.index_select(0, steps_e), traj.sigmas.index_select(0, ends_e)  # (N,) host
    embeds = traj.embeds.index(rows_e.to(traj.embeds.device))
    velocity = _velocity_once_per_input(adapter, x, sigma.to(dev), embeds, traj.guidance_scale, keys)
    guard = sigma_one_next(settings, traj.sigmas)
    # the rollout's sde_step checked every transition of this grid: no σ check per forward
    out = sde_step(x, velocity(), sigma, sigma_next, kind=settings.sde_kind, noise_level=settings.noise_level,
                   next_latents=x_next, reduction=settings.logprob_reduction,
                   simplified_log_prob=settings.cps_simplified_logprob, sigma_one_next=guard, check_sigmas=False)
    kl = None
    if with_ref:
        with torch.no_grad(), adapter.reference():
            v_ref = velocity()
        ref_mean, _ = transition_moments(x, v_ref, sigma, sigma_next, kind=settings.sde_kind,
                                         noise_level=settings.noise_level, sigma_one_next=guard, check_sigmas=False)
        kl = kl_to_reference(out.mean, ref_mean, out.std, sigma.to(dev), sigma_next.to(dev), kind=settings.sde_kind,
                             form=kl_form)
    dts = (sigma_next - sigma).to(dev)
    sizes = [len(rows) * len(chunk) for rows, chunk in work]
    parts = [[t] * len(work) if t is None else [t] if len(work) == 1 else t.split(sizes)
             for t in (out.log_prob, kl, out.mean, out.std, dts)]
    return [ChunkForward(*(None if t is None else t.reshape(len(rows), len(chunk), *t.shape[1:]) for t in item))
            for (rows, chunk), *item in zip(work, *parts, strict=True)]


def chunk_forward(adapter, traj: Trajectory, rows: torch.Tensor, chunk: tuple[int, ...], settings: SamplingConfig,
                  *, with_ref: bool, kl_form: str = "flow_grpo", shared_inputs: torch.Tensor | None = None
                  ) -> ChunkForward:
    """:func:`packed_forward` of one item (``rows``' transitions ``chunk``): log-probs (n, k), KL (n, k) or None,
    moments (n, k, …)."""
    return packed_forward(adapter, traj, [(rows, chunk)], settings, with_ref=with_ref, kl_form=kl_form,
                          shared_inputs=[shared_inputs])[0]


def _velocity_once_per_input(adapter, x: torch.Tensor, sigma: torch.Tensor, embeds, guidance: float, keys: list):
    """A function computing the (N, …) velocity of :func:`packed_forward`'s batch with the adapter's current
    weights, forwarding one element per distinct key (elements whose key is None are all forwarded)."""
    if all(key is None for key in keys):
        return lambda: adapter.velocity(x, sigma, embeds, guidance)
    slot: dict = {}
    pick, spread = [], []
    for e, key in enumerate(keys):
        key = ("element", e) if key is None else key
        if key not in slot:
            slot[key] = len(pick)
            pick.append(e)
        spread.append(slot[key])
    if len(pick) == len(keys):
        return lambda: adapter.velocity(x, sigma, embeds, guidance)
    dev = x.device
    pick_t, spread_t = torch.tensor(pick, device=dev), torch.tensor(spread, device=dev)
    x_u, sigma_u, embeds_u = x[pick_t], sigma[pick_t], embeds.index(pick_t.to(embeds.device))  # once each

    def velocity() -> torch.Tensor:
        return adapter.velocity(x_u, sigma_u, embeds_u, guidance)[spread_t]

    return velocity


def transformer_rows(rows: torch.Tensor, chunk: tuple[int, ...], shared: torch.Tensor | None) -> int:
    """Transformer rows :func:`packed_forward` spends on one item: distinct inputs × chunk steps."""
    return (len(rows) if shared is None else len(set(shared.tolist()))) * len(chunk)
