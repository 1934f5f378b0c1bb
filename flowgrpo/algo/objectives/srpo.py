"""SRPO: Direct-Align and Semantic Relative Preference Optimization (``objective: {name: srpo, ...}``).

Shen et al., "Directly Aligning the Full Diffusion Trajectory with Fine-Grained Human Preference", arXiv 2509.06942;
the release Tencent-Hunyuan/SRPO at 81e5898 (``fastvideo/SRPO.py``, ``scripts/finetune/SRPO_training_hpsv2.sh``;
"SRPO.py:N" below is that file's line N). Every default is the release's; each deliberate difference is a setting
and a row of docs/fidelity_forward.md.

**Rollout.** An Euler (ODE) sample per requested sample (the forward family's rollout, ``objective.solver``; the
release's ``run_sample_step``, SRPO.py:360–397, whose ``flux_step`` ignores ``eta``: SRPO.py:272–285), no gradient.
Its final latent is the clean image x₀ and its initial noise is the noise prior ε (SRPO.py:521 ``noise =
input_latents_new``, the latent the rollout started from); ``objective.noise: fresh`` draws a new ε instead.

**Direct-Align** (the paper's noise prior: x_t = α_t·x₀ + σ_t·ε_gt, so x₀ = (x_t − σ_t·ε_gt)/α_t; rectified flow
α = 1 − σ). The training σ's lie on ``sigmas_l``, N = ``timestep_length`` (1000) values linearly spaced between the
``train_timestep`` entries (5, 25) of a ``grid_steps``-step (50) grid shifted by ``train_shift`` (3):
σ(u) = s·u/(1 + (s − 1)·u) of u = linspace(1, 0, G + 1) (SRPO.py:248–249, 524–525, 534). Per micro-batch a
``mid`` is drawn uniformly from [5, N − 5] (SRPO.py:864) and a gap k = int((1 − ``groundtruth_ratio``)·N) + 1
(SRPO.py:520; 100 for 0.9 in floating point), clipped to min(N − mid, k, mid) (SRPO.py:528). Two branches, each
one transformer call with gradient from x_in = (1 − σ_in)·x₀ + σ_in·ε, one Euler step to σ_out and the noise prior
removed (SRPO.py:544–608)::

    x_out = x_in + (σ_out − σ_in)·v_θ(x_in, σ_in)
    x̂₀   = (x_out − σ_out·ε) / (1 − σ_out)

* ``denoise`` (SRPO.py:584–605, the release's ``inversion == 1``): σ_in = sigmas_l[N − min(mid + k, N)] above
  σ_out = sigmas_l[N − mid]; reward weight d = linspace(``discount_pos``)[mid] (0.1 → 0.25).
* ``inversion`` (SRPO.py:560–581, ``inversion == 0``): m' = max(mid − k, 1), σ_in = sigmas_l[N − m'] below
  σ_out = sigmas_l[N − min(m' + k, N)] (a step *up* in noise with the model's velocity);
  d = linspace(``discount_inv``)[m'] (0.3 → 0.01).

**Semantic Relative Preference** (SRPO.py:119–156, 222–236, the "CFG-like" form the release uses:
"(1−k)·neg + k·pos is less stable, we change it to (1+k)·pos − neg"). With the control phrases of optimizer step
j (1-based, SRPO.py:859): c⁺ = ``positive_phrases``[j mod 4] and c⁻ = ``negative_phrases``[j mod 5], each prefixed
to the prompt c as ``"<phrase>. <c>"`` (SRPO.py:65–89, 514–517), and R the composed differentiable reward
Σ_i w_i·r_i, the denoising branch maximises ``r = (1 + d)·R(x̂₀, c⁺·c) − R(x̂₀, c⁻·c)`` (SRPO.py:618) and the
inversion branch ``r = (1 + d)·R(x̂₀, c⁻·c) − R(x̂₀, c⁺·c)`` (SRPO.py:620; the inversion step turns ascent on the
negative phrase into descent on the denoising direction: the paper's inversion-based regularisation). The
release computes ``f_img·((1 + d)·f_txt⁺ − f_txt⁻)`` on normalised CLIP features, which is this difference for
every reward linear in the normalised text features (HPS's cosine; PickScore's and CLIP's logit-scaled cosine,
which the release divides by 20, SRPO.py:155: our ``pickscore`` with ``divisor: 20``). Only a reward that scores
the prompt (``text_conditioned = True``: ``hpsv2``, ``pickscore``, ``clip_score``) can take the phrases; another is
refused before any model loads. ``objective.relative: false`` is Direct-Align alone with ``r = R(x̂₀, c)``, the
paper's Direct-Align ablation (any differentiable reward, the denoising branch only).

**Loss** (SRPO.py:622–625, "Follow ReFL set a threshold"): ``max(0, m − s·r)`` per (sample, branch) row with the
margin m = 0.7 and s = ``reward_scale`` (1); the release divides each branch's loss by its 2 accumulation steps,
here each branch is a row of the optimizer step's mean. The gradient flows through the one transformer call and
the decode only (x₀ and ε detached). The advantages are computed and logged, not used; nothing holds the model
near the base (no KL), as the release.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from pydantic import Field, model_validator

from flowgrpo.algo.objectives.base import OBJECTIVES
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, as_row_sigma, noised
from flowgrpo.algo.objectives.forward import (
    NO_OLD_COPY_UNREAD,
    ForwardConfig,
    ForwardObjective,
    ForwardWork,
    RowDraw,
)
from flowgrpo.algo.objectives.paths import decode_with_grad
from flowgrpo.distributed import dist
from flowgrpo.records import Advantages, FinalSamples
from flowgrpo.rewards.base import differentiable_scores, is_differentiable
from flowgrpo.rng import make_generator

__all__ = ["SRPO", "SRPOConfig", "SRPODraw", "POSITIVE_PHRASES", "NEGATIVE_PHRASES", "shifted", "train_sigmas",
           "gap", "branch_sigmas", "direct_align", "relative_reward", "srpo_loss", "control_phrases",
           "controlled_prompts", "is_text_conditioned", "srpo_reward_problems"]

logger = logging.getLogger(__name__)

#: the positive control words, ``get_random_realism_adjective`` (SRPO.py:85–89)
POSITIVE_PHRASES = ("Natural-lighting", "Detail", "Detailed", "Real")
#: the negative control words, ``get_random_cg_oily_adjective`` (SRPO.py:65–82)
NEGATIVE_PHRASES = ("Concept art", "Painting", "Anime", "Flat", "Oil")
#: a control word is joined to the prompt as ``phrase + ". " + prompt`` (SRPO.py:516–517)
PHRASE_JOINER = ". "
#: ``mid`` is drawn from [MID_MARGIN, N − MID_MARGIN] (SRPO.py:864 ``random.randint(5, args.timestep_length-5)``)
MID_MARGIN = 5
#: the built-in rewards that score the prompt and have a differentiable score (named by the refusal of another)
TEXT_CONDITIONED_BUILTINS = ("hpsv2", "pickscore", "clip_score")
BRANCHES = {"both": ("denoise", "inversion"), "denoise": ("denoise",)}


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's time shift ``s·u / (1 + (s − 1)·u)`` (SRPO.py:248–249 ``sd3_time_shift``), elementwise."""
    return shift * u / (1 + (shift - 1) * u)


def train_sigmas(settings: SRPOConfig) -> torch.Tensor:
    """``sigmas_l``, the (N,) float32 training σ's, decreasing: N = ``timestep_length`` values linearly spaced from
    S[a] to S[b], (a, b) = ``train_timestep``, S the ``grid_steps``-step grid ``shifted(linspace(1, 0, G + 1),
    train_shift)`` (SRPO.py:524–525, 534; float32 as the release's ``torch.linspace``)."""
    grid = shifted(torch.linspace(1, 0, settings.grid_steps + 1), settings.train_shift)
    a, b = settings.train_timestep
    return torch.linspace(float(grid[a]), float(grid[b]), settings.timestep_length)


def gap(mid: int, settings: SRPOConfig) -> int:
    """The release's k: ``int((1 − groundtruth_ratio)·N) + 1`` (SRPO.py:520) clipped to min(N − mid, k, mid)
    (SRPO.py:528). For 0.9 and N = 1000 it is 100 ((1 − 0.9)·1000 = 99.999… in floating point)."""
    n = settings.timestep_length
    k = int((1 - settings.groundtruth_ratio) * n) + 1
    return min(min(n - mid, k), mid)


def branch_sigmas(mid: int, branch: str, settings: SRPOConfig) -> tuple[float, float, float]:
    """(σ_in, σ_out, d) of ``branch`` (``denoise`` or ``inversion``) at the drawn ``mid`` in [1, N − 1]: the σ the
    model is called at, the σ its one Euler step lands on, and the relative reward's weight d (module docstring;
    SRPO.py:536–553 and 618–620).

    Raises:
        ValueError: an unknown branch or a ``mid`` outside [1, N − 1].
    """
    n = settings.timestep_length
    if not 1 <= mid <= n - 1:
        raise ValueError(f"srpo: mid must be in [1, {n - 1}], got {mid}")
    sig, k = train_sigmas(settings), gap(mid, settings)
    if branch == "denoise":
        m, ends = mid, settings.discount_pos
    elif branch == "inversion":
        m, ends = max(mid - k, 1), settings.discount_inv
    else:
        raise ValueError(f"srpo: branch must be 'denoise' or 'inversion', got {branch!r}")
    base, start = n - m, n - min(m + k, n)  # the release's t_base (lower σ) and t_start (higher σ)
    d = float(torch.linspace(ends[0], ends[1], n)[m])
    if branch == "denoise":
        return float(sig[start]), float(sig[base]), d
    return float(sig[base]), float(sig[start]), d


def direct_align(velocity, x0: torch.Tensor, noise: torch.Tensor, sigma_in: float, sigma_out: float, *,
                 checkpointing: bool = True) -> torch.Tensor:
    """Direct-Align's recovered image (SRPO.py:544–608), (n, …) float32 with gradient through ``velocity`` only:
    ``x_in = (1 − σ_in)·x₀ + σ_in·ε`` (no gradient), one Euler step ``x_out = x_in + (σ_out − σ_in)·v(x_in, σ_in)``
    and the known noise removed, ``x̂₀ = (x_out − σ_out·ε)/(1 − σ_out)``. ``velocity(x, σ)`` (σ a float) is the model
    call, under :func:`torch.utils.checkpoint.checkpoint` with ``checkpointing``.

    Raises:
        ValueError: a σ outside [0, 1), or σ_in = σ_out.
    """
    if not (0 <= sigma_in < 1 and 0 <= sigma_out < 1) or sigma_in == sigma_out:
        raise ValueError(f"direct_align: sigmas must be distinct and in [0, 1), got {sigma_in} -> {sigma_out}")
    eps = noise.float().detach()
    x_in = noised(x0.detach(), eps, sigma_in)

    def step(z: torch.Tensor) -> torch.Tensor:
        return z + (sigma_out - sigma_in) * velocity(z, sigma_in).float()

    x_out = torch.utils.checkpoint.checkpoint(step, x_in, use_reentrant=False) if checkpointing else step(x_in)
    return (x_out - sigma_out * eps) / (1 - sigma_out)


def relative_reward(positive: torch.Tensor, negative: torch.Tensor, weight, branch: str) -> torch.Tensor:
    """The SRP reward of a branch, (n,): ``(1 + d)·R⁺ − R⁻`` for ``denoise`` and ``(1 + d)·R⁻ − R⁺`` for
    ``inversion`` (SRPO.py:152, 234 ``(1+k)*pos - neg``; the branches' arguments at SRPO.py:618 and 620).
    ``positive``, ``negative``: (n,) rewards of the images against the positively and negatively controlled
    prompts; ``weight`` d: a float."""
    if branch == "denoise":
        return (1 + weight) * positive - negative
    if branch == "inversion":
        return (1 + weight) * negative - positive
    raise ValueError(f"srpo: branch must be 'denoise' or 'inversion', got {branch!r}")


def srpo_loss(reward: torch.Tensor, margin: float = 0.7, scale: float = 1.0) -> torch.Tensor:
    """The per-row loss ``max(0, m − s·r)``, (n,) (SRPO.py:623 ``F.relu(-outputs+0.7)``)."""
    return F.relu(margin - scale * reward)


def control_phrases(step: int, positive=POSITIVE_PHRASES, negative=NEGATIVE_PHRASES) -> tuple[str, str]:
    """(c⁺, c⁻) of optimizer step ``step`` (1-based, SRPO.py:859): ``positive[step mod len]``,
    ``negative[step mod len]`` (SRPO.py:82, 89, 514–515)."""
    return positive[step % len(positive)], negative[step % len(negative)]


def controlled_prompts(phrase: str, prompts: list[str]) -> list[str]:
    """Each prompt with the control phrase in front, ``phrase + ". " + prompt`` (SRPO.py:516–517)."""
    return [phrase + PHRASE_JOINER + p for p in prompts]


def is_text_conditioned(reward) -> bool:
    """Whether ``reward`` (an instance, class or factory) declares a score of the prompt (``text_conditioned =
    True``, :mod:`flowgrpo.rewards.base`): only such a score changes with a control phrase."""
    return getattr(reward, "text_conditioned", False) is True


def srpo_reward_problems(specs, relative: bool) -> list[str]:
    """One line for each reward of non-zero weight (``specs``, the run's ``rewards``) without a differentiable
    score, or, with ``relative``, that does not score the prompt; before anything is constructed (a name that does
    not resolve is left to the reward check)."""
    from flowgrpo.rewards.registry import weighted_reward_factories

    out = []
    for spec, factory in weighted_reward_factories(specs):
        if not is_differentiable(factory):
            out.append(f"objective.name=srpo backpropagates the reward's gradient, but reward {spec.name!r} declares "
                       f"no differentiable score; use one of {', '.join(TEXT_CONDITIONED_BUILTINS)}, or give it "
                       "weight 0")
        elif relative and not is_text_conditioned(factory):
            out.append(f"objective.relative=true scores the images against the prompt with control phrases, but "
                       f"reward {spec.name!r} does not read the prompt; use one that does "
                       f"({', '.join(TEXT_CONDITIONED_BUILTINS)}), objective.relative=false (Direct-Align alone), "
                       "or give it weight 0")
    return out


class SRPOConfig(ForwardConfig):
    """``objective: {name: srpo, ...}`` (module docstring); every default the release's (HPS script
    ``scripts/finetune/SRPO_training_hpsv2.sh`` with ``fastvideo/SRPO.py``'s argparse defaults)."""

    name: Literal["srpo"] = "srpo"
    branches: Literal["both", "denoise"] = Field(
        "both", description="srpo: both (the release: the denoising and the inversion branch, one row each per "
        "sample, SRPO.py:529-536) or denoise (Direct-Align's denoising branch only)")
    relative: bool = Field(True, description="srpo: the semantic relative reward (1+d)R(x, c+ . c) - R(x, c- . c) "
                           "(the release); false: Direct-Align alone with R(x, c), any differentiable reward, "
                           "branches=denoise")
    noise: Literal["initial", "fresh"] = Field(
        "initial", description="srpo: the noise prior: the rollout's initial noise (the release, SRPO.py:521) or a "
        "fresh draw per sample and pass")
    timestep_length: int = Field(1000, ge=20, description="srpo: N, the training sigmas between the train_timestep "
                                 "grid points (SRPO.py:534; --timestep_length 1000)")
    grid_steps: int = Field(50, ge=1, description="srpo: steps of the shifted grid train_timestep indexes (the "
                            "release's vis_sampling_step, 50: SRPO.py:524)")
    train_shift: float = Field(3.0, gt=0, description="srpo: the shift of that grid (--shift 3)")
    train_timestep: tuple[int, int] = Field((5, 25), description="srpo: the grid points (a, b) the training sigmas "
                                            "span (SRPO.py:1150-1154 default [5, 25]; the PickScore script 5 30)")
    groundtruth_ratio: float = Field(0.9, gt=0, lt=1, description="srpo: the gap k = int((1 - ratio)*N) + 1 between "
                                     "a branch's two sigmas (SRPO.py:520; --groundtruth_ratio 0.9)")
    discount_pos: tuple[float, float] = Field((0.1, 0.25), description="srpo: the denoising branch's weight d, "
                                              "linear over N (--discount_pos 0.1 0.25)")
    discount_inv: tuple[float, float] = Field((0.3, 0.01), description="srpo: the inversion branch's weight d, "
                                              "linear over N (--discount_inv 0.3 0.01)")
    positive_phrases: tuple[str, ...] = Field(POSITIVE_PHRASES, min_length=1, description="srpo: positive control "
                                              "phrases, one per optimizer step in turn (SRPO.py:85-89)")
    negative_phrases: tuple[str, ...] = Field(NEGATIVE_PHRASES, min_length=1, description="srpo: negative control "
                                              "phrases, one per optimizer step in turn (SRPO.py:65-82)")
    margin: float = Field(0.7, description="srpo: the hinge m of relu(m - s*r) (SRPO.py:623)")
    reward_scale: float = Field(1.0, gt=0, description="srpo: s, the reward's scale in the hinge (the release: 1; "
                                "it divides CLIP and PickScore by 20, SRPO.py:155: pickscore's divisor 20)")
    checkpointing: bool = Field(True, description="srpo: torch.utils.checkpoint the transformer call and the decode")

    trains_on: ClassVar[str] = "the rollout's final samples re-noised with its initial noise and the reward's gradient"
    unread: ClassVar[dict[str, str]] = {
        "kl_beta": "it has no KL to the base model (the release has none)",
        "adv_clip_max": "it trains on the reward's gradient, not the advantages", **NO_OLD_COPY_UNREAD}

    @model_validator(mode="after")
    def _consistent(self) -> SRPOConfig:
        a, b = self.train_timestep
        if not 0 <= a < b <= self.grid_steps:
            raise ValueError(f"objective.train_timestep={list(self.train_timestep)} must be 0 <= a < b <= "
                             f"objective.grid_steps={self.grid_steps}")
        if not self.relative and self.branches != "denoise":
            raise ValueError("objective.relative=false (Direct-Align alone) trains the denoising branch only: set "
                             "objective.branches=denoise (the inversion branch regularises with the negative phrase)")
        return self

    def problems(self, config) -> list[str]:
        """The forward family's problems and every reward :func:`srpo_reward_problems` refuses, one line each."""
        return super().problems(config) + srpo_reward_problems(config.rewards, self.relative)


@dataclass(frozen=True)
class SRPODraw(RowDraw):
    """One branch of a micro-batch: :class:`~flowgrpo.algo.objectives.forward.RowDraw` (``sigma`` (n,) σ_in for
    every row; ``noise`` the fresh ε, or zeros when the prior is the rollout's initial noise) and

    Attributes:
        branch: ``denoise`` or ``inversion``; sigma_out: the σ the step lands on; weight: d; mid: the drawn mid;
        phrases: (c⁺, c⁻) of the optimizer step.
    """

    branch: str
    sigma_out: float
    weight: float
    mid: int
    phrases: tuple[str, str]


@OBJECTIVES.register("srpo")
class SRPO(ForwardObjective):
    """SRPO (module docstring) on the forward family's plan and update loop: one row per (sample, branch), the loss
    of :meth:`terms` averaged over an optimizer step's rows on all processes."""

    Config = SRPOConfig
    #: verified with rollout workers (tests/runtime/test_ray_identity.py)
    rollout_workers_refusal = None
    uses_old_copy = False
    trains_on_advantages = False  # the reward's gradient is the signal, whatever the group

    def __init__(self, config) -> None:
        super().__init__(config)
        self.rewards = None
        self._warned_inactive = False

    def attach(self, adapter, rewards) -> None:
        """Keep the optimised rewards (a set-up :class:`~flowgrpo.rewards.compose.ComposedReward`); each of
        non-zero weight must be differentiable as constructed and, with ``relative``, score the prompt: else a
        ``ValueError`` naming it."""
        for name, reward in rewards.rewards.items():
            if rewards.weights[name] == 0:
                continue
            if not is_differentiable(reward):
                raise ValueError(f"objective.name=srpo: reward {name!r} as configured has no differentiable score "
                                 "(a 0/1 verdict, or resize_backend=pil); change its kwargs or give it weight 0")
            if self.o.relative and not is_text_conditioned(reward):
                raise ValueError(f"objective.relative=true: reward {name!r} does not read the prompt, so the control "
                                 "phrases cannot change it; set objective.relative=false or use a text reward")
        self.rewards = rewards

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        """One row per branch: 2 (the release's two accumulation steps), 1 with ``branches: denoise``."""
        return len(BRANCHES[self.o.branches])

    def plan(self, samples: FinalSamples, adv: Advantages, keep: torch.Tensor, epoch: int) -> ForwardWork:
        """The forward family's plan, every sample the group filter keeps trained whatever its advantage."""
        return super().plan(samples, dataclasses.replace(adv, train_mask=torch.ones_like(adv.train_mask)), keep,
                            epoch)

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[SRPODraw]:
        """The branches of micro-batch ``rows``: one ``mid`` seeded by the global micro-batch (the release draws one
        per step and process, SRPO.py:864), the phrases of the optimizer step about to be taken, and with ``noise:
        fresh`` an ε per sample (seeded by the sample)."""
        st, s = self.o, work.samples
        g = make_generator(self.cfg.train.seed, work.epoch, inner, "srpo", work.micro_batch_index(rows))
        n = st.timestep_length
        mid = int(torch.randint(MID_MARGIN, n - MID_MARGIN + 1, (1,), generator=g))
        step = (self.optim.steps if self.optim is not None else 0) + 1
        phrases = control_phrases(step, st.positive_phrases, st.negative_phrases)
        shape = (len(rows), *s.x0.shape[1:])
        if st.noise == "fresh":
            noise = torch.stack([torch.randn(shape[1:], generator=make_generator(
                self.cfg.train.seed, work.epoch, inner, "srpo_noise", int(s.group_ids[r]), int(s.sample_index[r])))
                for r in rows.tolist()])
        else:
            noise = torch.zeros(()).expand(shape)
        out = []
        for branch in BRANCHES[st.branches]:
            s_in, s_out, d = branch_sigmas(mid, branch, st)
            out.append(SRPODraw(rows, torch.full((len(rows),), s_in), noise, branch, s_out, d, mid, phrases))
        return out

    def terms(self, adapter, work: ForwardWork, draw: SRPODraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """Direct-Align's image of the draw's branch (:func:`direct_align`), decoded, its relative reward
        (:func:`relative_reward`) and the per-row loss (:func:`srpo_loss`), with stats ``reward`` (r), and with
        ``relative`` ``reward_positive`` / ``reward_negative`` (R⁺, R⁻), ``active`` (the rows inside the hinge) and
        ``sigma_in``."""
        if self.rewards is None:
            raise RuntimeError("objective srpo: attach(adapter, rewards) was not called before the update")
        st, s = self.o, work.samples
        dev, n = x0.device, len(draw.rows)
        if st.noise == "initial":
            eps = s.initial_noise[draw.rows.to(s.initial_noise.device)].to(dev).float()
        else:
            eps = draw.noise.to(dev).float()

        def velocity(z: torch.Tensor, sigma: float) -> torch.Tensor:
            return self.velocity(adapter, z, torch.full((n,), sigma, device=dev), embeds)

        x_hat = direct_align(velocity, x0, eps, float(draw.sigma[0]), draw.sigma_out, checkpointing=st.checkpointing)
        images = (torch.utils.checkpoint.checkpoint(decode_with_grad, adapter, x_hat, embeds, use_reentrant=False)
                  if st.checkpointing else decode_with_grad(adapter, x_hat, embeds))
        rows = draw.rows.tolist()
        prompts, meta = [s.prompts[r] for r in rows], [s.metadata[r] for r in rows]
        stats = {}
        if st.relative:
            pos = self.reward_total(images, controlled_prompts(draw.phrases[0], prompts), meta)
            neg = self.reward_total(images, controlled_prompts(draw.phrases[1], prompts), meta)
            reward = relative_reward(pos, neg, draw.weight, draw.branch)
            stats = {"reward_positive": pos.detach(), "reward_negative": neg.detach()}
        else:
            reward = self.reward_total(images, prompts, meta)
        stats.update(reward=reward.detach(), active=(st.reward_scale * reward.detach() < st.margin).float(),
                     sigma_in=as_row_sigma(draw.sigma[0], n, 1, dev))
        return ObjectiveTerms(loss=srpo_loss(reward, st.margin, st.reward_scale), stats=stats)

    def update_metrics(self, adapter, work: ForwardWork, stats) -> dict[str, float]:
        """The forward family's metrics (``objective/active``: the share of trained rows, on all processes, inside
        the hinge); the first update in which no row is (every relu term 0, no gradient: a reward on another scale
        than the release's, e.g. PickScore without its divisor 20) is warned about in one line on rank 0, once."""
        out = super().update_metrics(adapter, work, stats)
        if out.get("objective/active", 1.0) == 0 and not self._warned_inactive:
            self._warned_inactive = True
            if dist.rank() == 0:
                logger.warning("objective srpo: no row was inside the hinge in this update (every s*r >= "
                               "objective.margin=%g; mean r %.4g): relu(m - s*r) is 0, nothing trained; the release's "
                               "0.7 is for HPS's cosine and PickScore / 20: set objective.reward_scale or the margin",
                               self.o.margin, out.get("objective/reward", float("nan")))
        return out

    def reward_total(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """``R = Σ_i w_i·r_i`` over the rewards of non-zero weight, each's differentiable score (a NaN score
        contributes nothing, as :func:`~flowgrpo.rewards.compose.compose_rewards`): (n,) float32 with gradient."""
        total = torch.zeros(images.shape[0], device=images.device)
        for name, reward in self.rewards.rewards.items():
            w = float(self.rewards.weights[name])
            if w == 0 or not math.isfinite(w):
                continue
            r = differentiable_scores(reward, images, prompts, metadata, name).to(images.device)
            total = total + torch.where(torch.isnan(r), torch.zeros_like(r), w * r)
        return total
