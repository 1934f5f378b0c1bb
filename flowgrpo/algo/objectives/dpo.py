"""Diffusion-DPO for flow models, online: preference pairs chosen by the reward within the model's own groups.

Diffusion-DPO (Wallace et al., arXiv 2311.12908, eq. 14) trains on a pair (x₀ʷ, x₀ˡ) of one prompt, the first
preferred, noised with the same ε at the same σ. In its flow-matching form (the velocity target ε − x₀; Flow-Factory
``src/flow_factory/trainers/dpo.py`` at a0b2bc5, lines 567–611, written after flow_grpo's ``train_sd3_dpo.py``),
with ``x_σ = (1 − σ)·x₀ + σ·ε``:

    e_θʷ = mean_dims((v_θ(x_σʷ) − (ε − x₀ʷ))²)      e_refʷ likewise with the frozen reference; ˡ for the loser
    s    = −β/2 · ((e_θʷ − e_refʷ) − (e_θˡ − e_refˡ))
    loss = −log σ(s)                                  per pair (a row is one pair at one σ)

(Diffusion-DPO's release: SalesforceAIResearch/DiffusionDPO train.py at 5233e75, lines 1053–1055 (the same
timestep and noise for the pair), 1125–1145 (``scale_term = -0.5 * args.beta_dpo``, ``inside_term``,
``-F.logsigmoid(inside_term).mean()``); the paper's T·ω(λ_t) is folded into β.) The reference is the frozen base
model (LoRA disabled, or the frozen copy), never updated (flow_grpo ``ref_update_step`` 10000000, quoted in
Flow-Factory's ``examples/dpo/lora/sd3_5/default.yaml`` line 84). β: 100 (flow_grpo ``config/dpo.py``
``pickscore_sd3``, quoted ibid. lines 22 and 70–71; Flow-Factory's own default 2000, ``hparams/training_args.py``
lines 636–637; Diffusion-DPO's SD1.5 5000, ``train.py`` line 344).

Online (this module's ``dpo``): each group of G samples of a prompt, scored by the reward, gives its pairs by the
advantages: ``best_worst`` the highest against the lowest (Flow-Factory ``_form_pairs_from_advantages``, lines
355–356), ``all`` every two samples of different advantage (the higher one chosen). A group whose samples all have
the same advantage gives no pair. Offline pairs from a preference dataset: :mod:`.dpo_offline`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Literal, get_args

import torch
import torch.nn.functional as F
from pydantic import Field

from flowgrpo.algo.microbatches import step_shares
from flowgrpo.algo.objectives.base import OBJECTIVES
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, noised, velocity_mse, velocity_target
from flowgrpo.algo.objectives.forward import NO_OLD_COPY_UNREAD, ForwardObjective, ForwardWork, RowDraw
from flowgrpo.algo.objectives.sft import SigmaDensityConfig, seeded_draws
from flowgrpo.distributed import dist
from flowgrpo.records import Advantages, FinalSamples

__all__ = ["DPO", "DPOConfig", "DPOBaseConfig", "PAIR_MODES", "dpo_terms", "preference_pairs",
           "pair_slots"]

PairMode = Literal["best_worst", "all"]
PAIR_MODES = get_args(PairMode)


def dpo_terms(v_w: torch.Tensor, v_l: torch.Tensor, v_ref_w: torch.Tensor, v_ref_l: torch.Tensor,
              noise: torch.Tensor, x0_w: torch.Tensor, x0_l: torch.Tensor, beta: float) -> ObjectiveTerms:
    """The Diffusion-DPO loss of N pairs at one σ each (module docstring), float32.

    Args:
        v_w, v_l: (N, …) the trained velocities at the chosen and the rejected noised latents, with gradient.
        v_ref_w, v_ref_l: (N, …) the reference's at the same inputs (detached here).
        noise: (N, …) ε, shared by the two images of a pair. x0_w, x0_l: (N, …) the chosen and rejected latents.
        beta: β > 0.

    Returns:
        ``loss`` (N,) = −log σ(s) and the detached stats ``implicit_acc`` (s > 0), ``margin`` (s),
        ``err_chosen``/``err_rejected`` (e_θ) and ``ref_err_chosen``/``ref_err_rejected`` (e_ref).

    Raises:
        ValueError: mismatched shapes or β <= 0.
    """
    shapes = {tuple(t.shape) for t in (v_w, v_l, v_ref_w, v_ref_l, noise, x0_w, x0_l)}
    if len(shapes) != 1:
        raise ValueError(f"dpo_terms needs equal shapes, got {sorted(shapes)}")
    if beta <= 0:
        raise ValueError(f"DPO beta must be > 0, got {beta}")
    t_w, t_l = velocity_target(x0_w, noise), velocity_target(x0_l, noise)
    e_w, e_l = velocity_mse(v_w, t_w), velocity_mse(v_l, t_l)
    r_w, r_l = velocity_mse(v_ref_w.detach(), t_w), velocity_mse(v_ref_l.detach(), t_l)
    inside = -0.5 * beta * ((e_w - r_w) - (e_l - r_l))
    loss = -F.logsigmoid(inside)
    with torch.no_grad():
        stats = {"implicit_acc": (inside > 0).float(), "margin": inside.detach(), "err_chosen": e_w.detach(),
                 "err_rejected": e_l.detach(), "ref_err_chosen": r_w, "ref_err_rejected": r_l}
    return ObjectiveTerms(loss=loss, stats=stats)


def pair_slots(group_size: int, mode: str) -> list[tuple[int, int]]:
    """The pair slots of a group of ``group_size``: ``best_worst`` one slot, ``all`` every (i, j), i < j, of the
    group's positions (G(G − 1)/2 slots). Raises ``ValueError`` for another mode."""
    if mode == "best_worst":
        return [(0, 0)]
    if mode == "all":
        return [(i, j) for i in range(group_size) for j in range(i + 1, group_size)]
    raise ValueError(f"pairs must be one of {PAIR_MODES}, got {mode!r}")


def preference_pairs(advantages: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor,
                     mode: str = "best_worst") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every group's pair slots (:func:`pair_slots`) filled from the advantages: the chosen and the rejected
    sample of each slot and whether it is a pair.

    Args:
        advantages: (B,) float; group_ids: (B,) long, each group's rows adjacent and every group of one size G;
            valid: (B,) bool, the samples that may enter a pair (the advantages' train mask and the group filter).
        mode: ``best_worst``: the valid sample of the highest advantage chosen, of the lowest rejected (the first
            of equal ones), a pair when they differ; ``all``: slot (i, j) pairs positions i and j when both are
            valid and their advantages differ, the higher chosen.

    Returns:
        (chosen (S,), rejected (S,), is_pair (S,) bool), S = groups × slots, all on the host; a slot that is no
        pair holds the group's first row twice.

    Raises:
        ValueError: lengths that disagree, groups not adjacent or of unequal size, an unknown mode.
    """
    b = advantages.shape[0]
    if group_ids.shape != (b,) or valid.shape != (b,):
        raise ValueError(f"preference_pairs got advantages {tuple(advantages.shape)}, group_ids "
                         f"{tuple(group_ids.shape)}, valid {tuple(valid.shape)}")
    ids, counts = torch.unique_consecutive(group_ids.cpu(), return_counts=True)
    if len(torch.unique(ids)) != len(ids) or len(set(counts.tolist())) > 1:
        raise ValueError(f"preference_pairs needs each group's rows adjacent and groups of one size, got group "
                         f"sizes {counts.tolist()}")
    g = int(counts[0]) if len(counts) else 0
    adv, ok = advantages.detach().cpu().double(), valid.cpu().bool()
    slots = pair_slots(g, mode)
    w, lo, is_pair = [], [], []
    for start in range(0, b, g):
        rows = torch.arange(start, start + g)
        for i, j in slots:
            if mode == "best_worst":
                cand = rows[ok[rows]]
                if len(cand) >= 2:
                    a = adv[cand]
                    hi, low = cand[torch.argmax(a)], cand[torch.argmin(a)]
                    if adv[hi] > adv[low]:
                        w.append(int(hi)), lo.append(int(low)), is_pair.append(True)
                        continue
            else:
                ri, rj = start + i, start + j
                if ok[ri] and ok[rj] and adv[ri] != adv[rj]:
                    hi, low = (ri, rj) if adv[ri] > adv[rj] else (rj, ri)
                    w.append(hi), lo.append(low), is_pair.append(True)
                    continue
            w.append(start), lo.append(start), is_pair.append(False)
    return (torch.tensor(w, dtype=torch.long), torch.tensor(lo, dtype=torch.long),
            torch.tensor(is_pair, dtype=torch.bool))


class DPOBaseConfig(SigmaDensityConfig):
    """The knobs ``dpo`` and ``dpo_offline`` share (a settings base; no objective of its own), read as they are
    (validated once, here): ``beta_dpo``, β > 0 of the preference (flow_grpo's 100), and the σ density of
    :class:`~flowgrpo.algo.objectives.sft.SigmaDensityConfig` (Flow-Factory: K = 1, logit-normal (0, 1))."""

    beta_dpo: float = Field(100.0, gt=0, description="dpo: beta of the Diffusion-DPO preference -log sigmoid(-beta/2 "
                        "* ((e_w - e_ref_w) - (e_l - e_ref_l))) (flow_grpo pickscore_sd3: 100; Flow-Factory's "
                        "default 2000; Diffusion-DPO SD1.5: 5000)")

    #: DPO's reference enters through beta; no advantage is clipped (the pairs are ordered by them); no old copy
    unread: ClassVar[dict[str, str]] = {
        **NO_OLD_COPY_UNREAD, "adv_clip_max": "it orders a group's samples by their advantages and clips none",
        "kl_beta": "its reference enters the loss through objective.beta_dpo"}
    instead: ClassVar[dict[tuple[str, str], str]] = {}


class DPOConfig(DPOBaseConfig):
    """``objective: {name: dpo, ...}``: online Diffusion-DPO on the model's own groups, pairs chosen by the
    reward (module docstring)."""

    name: Literal["dpo"] = "dpo"
    pairs: PairMode = Field(
        "best_worst", description="dpo: the pairs of a group: best_worst (the highest advantage against the lowest; "
        "Flow-Factory) or all (every two samples of different advantage)")


@OBJECTIVES.register("dpo")
class DPO(ForwardObjective):
    """Online Diffusion-DPO (module docstring) in the training loop: the trained weights roll out with
    ``objective.solver``; the plan fills every local group's pair slots (:func:`preference_pairs`), the same
    number on every process (slots that are no pair are masked), and trains on a view of the rollout whose rows
    are the pairs (``x0`` the chosen latents, ``extra["x0_rejected"]`` the rejected ones); each pair draws K σ's
    and one ε per σ, shared by its two images, seeded by (seed, epoch, pass, group, slot); the reference and the
    trained weights each forward the pair's two images in one call."""
    #: verified with rollout workers (tests/runtime/test_ray_identity.py)
    rollout_workers_refusal = None

    Config = DPOConfig
    uses_old_copy = False

    @property
    def needs_reference(self) -> bool:
        """Always: the preference is measured against the frozen reference."""
        return True

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return self.o.num_train_timesteps

    def check_grid(self, sigmas: torch.Tensor) -> None:
        """Every process holds whole groups (a pair is two samples of one group)."""
        self.check_whole_groups("pairs the samples of a group")

    def training_units(self, local: int) -> tuple[int, str]:
        """The pair slots of a process's ``local`` samples (:func:`pair_slots` of each of its groups), which
        :meth:`plan` cuts into micro-batches of ``train_batch_size``."""
        g = self.cfg.train.group_size
        return local // g * len(pair_slots(g, self.o.pairs)), f"pair slots ({self.o.pairs!r}, G = {g})"

    def pairs(self, samples: FinalSamples, advantages: torch.Tensor, valid: torch.Tensor):
        """(chosen, rejected, is_pair) local rows of the epoch's pair slots: by the advantages (online)."""
        return preference_pairs(advantages, samples.group_ids, valid, self.o.pairs)

    def plan(self, samples: FinalSamples, adv: Advantages, keep: torch.Tensor, epoch: int) -> ForwardWork:
        """The pair view of the rollout (class docstring), micro-batches of ``train_batch_size`` pairs (the last
        may be smaller), ``optimizer_steps_per_epoch`` shares, each step's pairs × K over all processes (one
        collective)."""
        local = dist.local_slice(len(adv.values))
        advantages = adv.values[local].float()
        w, lo, ok = self.pairs(samples, advantages, adv.train_mask[local] & keep[local])
        slot_index = torch.cat([torch.arange(int(c)) for c in
                                torch.unique_consecutive(samples.group_ids[w], return_counts=True)[1]])
        dev = samples.x0.device
        view = replace(samples, x0=samples.x0[w.to(dev)], initial_noise=samples.initial_noise[w.to(dev)],
                       embeds=samples.embeds.index(w.to(samples.embeds.device)), group_ids=samples.group_ids[w],
                       sample_index=slot_index)
        mbs = list(torch.arange(len(w)).split(self.cfg.train_batch_size))
        shares = step_shares(mbs, self.cfg.train.optimizer_steps_per_epoch)
        k = self.o.num_train_timesteps
        counts = torch.tensor([sum(float(ok[mb].sum()) * k for mb in share) for share in shares],
                              dtype=torch.float64)
        extra = {"x0_rejected": samples.x0[lo.to(dev)], "chosen": w, "rejected": lo}
        return ForwardWork(view, adv, advantages[w] - advantages[lo], ok, shares, dist.all_reduce_sum(counts).tolist(),
                           local.start, epoch, extra)

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[RowDraw]:
        """Per pair, K σ's and K noises from a generator of (seed, epoch, pass, group, slot) (the pair view's
        ``sample_index`` is the slot; :func:`~flowgrpo.algo.objectives.sft.seeded_draws`)."""
        return seeded_draws(work.samples, rows, self.o.num_train_timesteps, self.o, self.cfg.train.seed, work.epoch,
                            inner, "dpo")

    def terms(self, adapter, work: ForwardWork, draw: RowDraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """The reference, then the trained weights, each on the chosen and rejected images in one call;
        :func:`dpo_terms`."""
        n, dev = x0.shape[0], x0.device
        x0_l = work.extra["x0_rejected"][draw.rows.to(work.extra["x0_rejected"].device)].to(dev).float()
        sigma, noise = draw.sigma.to(dev), draw.noise.to(dev)
        x_t = torch.cat([noised(x0, noise, sigma), noised(x0_l, noise, sigma)])
        sigma2 = torch.cat([sigma, sigma])
        both = embeds.index(torch.cat([torch.arange(n), torch.arange(n)]).to(embeds.device))
        v_ref = self.velocity(adapter, x_t, sigma2, both, weights="reference")
        v = self.velocity(adapter, x_t, sigma2, both)
        return dpo_terms(v[:n], v[n:], v_ref[:n], v_ref[n:], noise, x0, x0_l, self.o.beta_dpo)
