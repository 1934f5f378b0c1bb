"""ReFL and DRaFT: the reward's gradient back through the last sampling steps, the VAE decode and a differentiable
reward (``objective: {name: refl, variant: ...}``).

The rollout is an Euler (ODE) sample of every trajectory that keeps its whole path (:func:`~flowgrpo.algo.
objectives.paths.path_rollout`, no gradient). The update restarts the sampler from a late latent of that path with
gradient, decodes the result and maximises the composed reward ``R = Σ_i w_i·r_i(x̂)`` of the rewards with a
non-zero weight, each of which must declare a differentiable score (:func:`flowgrpo.rewards.base.is_differentiable`;
ours: ``digit_correctness`` (not ``strict``), ``hpsv2``, ``pickscore``, ``clip_score``, ``aesthetic``; JPEG
compressibility, OCR, GenEval and the VLM judges are not and are refused by name when the config is built). With the
σ grid σ₀ = 1 > … > σ_T = 0 of ``sampling.num_steps`` steps and the trained velocity v_θ:

* ``draft_k`` (DRaFT-K, Clark et al., arXiv 2309.17400, §4 "DRaFT-K"): from the rollout's latent x_{T−K}
  (detached), K Euler steps with gradient ``x_{i+1} = x_i + (σ_{i+1} − σ_i)·v_θ(x_i, σ_i)``, i = T−K … T−1 (the
  same step the rollout took, so the replay reproduces the rollout's x₀ before any update); loss ``−s·R(x_T)``.
  K = T is full DRaFT.
* ``draft_lv`` (DRaFT-LV, the same paper's Algorithm 2, "lower variance"): n copies of the rollout's final x₀
  (detached), each re-noised to the last grid step, ``x = (1 − σ_{T−1})·x₀ + σ_{T−1}·ε``, denoised in one step with
  gradient ``x̂₀ = x − σ_{T−1}·v_θ(x, σ_{T−1})``; loss ``−s·R(x̂₀)`` for each copy. The paper sums the n
  gradients; here each copy is one row of the optimizer step's mean, which is the sum divided by n (a constant
  factor of the reward scale s).
* ``refl`` (ReFL, ImageReward, Xu et al., arXiv 2304.05977, §4.2: Eq. 2 ``L_reward = λ·E_y φ(r(y, g_θ(y)))``
  with φ = ReLU, and Algorithm 1; the release THUDM/ImageReward ``ImageReward/ReFL.py`` at c1392c6: line 70
  ``--grad_scale`` default 1e-3 (``scripts/train_refl.sh`` line 12 passes 0.001), line 717
  ``mid_timestep = random.randint(30, 39)`` of the 40 steps set at line 714, line 737 the one-step
  ``pred_original_sample`` decoded and scored, lines 755–756 ``loss = F.relu(-rewards+2)`` then
  ``loss.mean() * args.grad_scale``): per micro-batch a step j drawn uniformly from the last
  ``refl_last_steps`` of the grid, the rollout's latent x_j (detached) predicted to the clean image in one step
  with gradient, ``x̂₀ = x_j − σ_j·v_θ(x_j, σ_j)``; loss ``s·max(0, m − R(x̂₀))`` with the margin m (the
  release's 2) and s = λ, the release's ``grad_scale`` (1e-3). The release's 2 is in ImageReward's units (its
  score standardised by the mean and std of its training scores, ``ImageReward/ImageReward.py`` line 98), and no
  reward with a differentiable score here is on that scale: a margin at or below every score the composed reward
  can take (the rewards' declared ``typical_range``, :func:`refl_margin_problem`) is refused before any model
  loads, and an update in which no row is inside the margin (every relu term 0, no gradient) is warned about
  once (``objective/active`` is the share of rows inside it).

The reward scale s (``objective.reward_scale``) defaults to each variant's source: 1e-3 for ``refl`` (the
release's ``grad_scale``; with gradient clipping at 1.0, as the release's ``max_grad_norm``, the scale is not
neutral), 1 for ``draft_k`` / ``draft_lv`` (the paper's loss is −R; DRaFT has no public code).

Each transformer call of the gradient path and the decode run under :func:`torch.utils.checkpoint.checkpoint`
(``objective.checkpointing``, on by default): the backward recomputes one step's activations at a time instead of
keeping K steps' (DRaFT's per-step checkpointing). The advantages are computed and logged as for every objective but
not used: the reward itself is the signal, so a sample trains whatever its group. ReFL and DRaFT over-optimise
(reward hacking): nothing here holds the samples near the base model (no KL), as in the papers; watch an independent
evaluation reward.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import ClassVar, Literal, get_args

import torch
import torch.nn.functional as F
from pydantic import Field
from torch.utils.checkpoint import checkpoint

from flowgrpo.algo.objectives.base import OBJECTIVES, ObjectiveConfig
from flowgrpo.algo.objectives.flow_matching import ObjectiveTerms, noised
from flowgrpo.algo.objectives.forward import ForwardObjective, ForwardWork, sde_ratio_problems
from flowgrpo.algo.objectives.paths import PathDraw, PathSamples, decode_with_grad, path_rollout
from flowgrpo.distributed import dist
from flowgrpo.records import Advantages
from flowgrpo.rewards.base import differentiable_scores, is_differentiable, typical_range
from flowgrpo.rng import make_generator
from flowgrpo.strategies.settings import refuse

__all__ = ["RewardBackprop", "RewardBackpropConfig", "VARIANTS", "euler_replay",
           "x0_prediction", "draft_loss", "refl_loss", "refl_step", "check_differentiable_rewards",
           "differentiable_reward_problems", "refl_margin_problem", "REFL_GRAD_SCALE", "REFL_MARGIN", "DRAFT_SCALE"]

logger = logging.getLogger(__name__)

Variant = Literal["draft_k", "draft_lv", "refl"]
VARIANTS = get_args(Variant)
#: the built-in rewards with a differentiable score (named by the refusal of another)
DIFFERENTIABLE_BUILTINS = ("digit_correctness", "hpsv2", "pickscore", "clip_score", "aesthetic")
#: ReFL's loss scale λ: THUDM/ImageReward ``ImageReward/ReFL.py`` line 70 (``--grad_scale`` default 1e-3) and
#: ``scripts/train_refl.sh`` line 12 (``--grad_scale 0.001``)
REFL_GRAD_SCALE = 1e-3
#: ReFL's hinge m in relu(m − R): ``ImageReward/ReFL.py`` line 755 (``F.relu(-rewards+2)``), in ImageReward's units
REFL_MARGIN = 2.0
#: DRaFT's loss scale: the paper's loss is −R (arXiv 2309.17400, Algorithm 1); no public code
DRAFT_SCALE = 1.0


def euler_replay(velocity, x: torch.Tensor, sigmas: torch.Tensor, start: int, *,
                 checkpointing: bool = True) -> torch.Tensor:
    """Euler steps ``x ← x + (σ_{i+1} − σ_i)·v(x, σ_i)`` for i = start … T−1 on the (T+1,) grid ``sigmas`` (host),
    from ``x`` (n, …) at σ_start; returns the (n, …) float32 latent at σ_T = 0. ``velocity(x, σ_i)`` (σ_i a float) is
    the model call; with ``checkpointing`` each step runs under :func:`torch.utils.checkpoint.checkpoint`
    (non-reentrant), so its activations are recomputed in the backward.

    Raises:
        ValueError: ``start`` outside [0, T − 1].
    """
    t = sigmas.numel() - 1
    if not 0 <= start < t:
        raise ValueError(f"euler_replay: start must be in [0, {t - 1}], got {start}")
    x = x.float()
    for i in range(start, t):
        sigma, dt = float(sigmas[i]), float(sigmas[i + 1]) - float(sigmas[i])

        def step(z: torch.Tensor, sigma=sigma, dt=dt) -> torch.Tensor:
            return z + dt * velocity(z, sigma).float()

        x = checkpoint(step, x, use_reentrant=False) if checkpointing else step(x)
    return x


def x0_prediction(velocity, x: torch.Tensor, sigma: float, *, checkpointing: bool = True) -> torch.Tensor:
    """The one-step clean prediction ``x̂₀ = x − σ·v(x, σ)``, (n, …) float32 (diffusers' ``pred_original_sample``
    of a flow-matching step; the Euler step from σ straight to 0)."""

    def step(z: torch.Tensor) -> torch.Tensor:
        return z.float() - sigma * velocity(z, sigma).float()

    return checkpoint(step, x, use_reentrant=False) if checkpointing else step(x)


def draft_loss(rewards: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """DRaFT's per-row loss ``−s·R``, (n,) (arXiv 2309.17400 Algorithm 1: gradient ascent on the reward)."""
    return -scale * rewards


def refl_loss(rewards: torch.Tensor, scale: float = REFL_GRAD_SCALE, margin: float = REFL_MARGIN) -> torch.Tensor:
    """ReFL's per-row loss ``s·max(0, m − R)``, (n,) (arXiv 2304.05977 Eq. 2 with φ = ReLU; THUDM/ImageReward
    ``ImageReward/ReFL.py`` lines 755–756: ``F.relu(-rewards+2)``, ``loss.mean() * args.grad_scale``; the mean is
    the optimizer step's)."""
    return scale * F.relu(margin - rewards)


def refl_margin_problem(margin: float, rewards) -> str | None:
    """One line when ReFL's hinge can never be active, else None. ``rewards``: the composed reward
    (:class:`~flowgrpo.rewards.compose.ComposedReward`, constructed). With R = Σ_i w_i·r_i over the rewards of
    non-zero weight and each r_i in its declared ``typical_range`` [lo_i, hi_i]
    (:func:`~flowgrpo.rewards.base.typical_range`), R ≥ Σ_i min(w_i·lo_i, w_i·hi_i); a margin m at or below that
    bound makes relu(m − R) = 0 for every sample (no gradient). None too when a reward declares no range (the
    update's warning is then the only check)."""
    low, high, parts = 0.0, 0.0, []
    for name, reward in rewards.rewards.items():
        w = float(rewards.weights[name])
        if w == 0:
            continue
        span = typical_range(reward, name)
        if span is None:
            return None
        ends = (w * span[0], w * span[1])
        low, high = low + min(ends), high + max(ends)
        parts.append(f"{name} ≈ [{span[0]:g}, {span[1]:g}]" + ("" if w == 1 else f" × {w:g}"))
    if not parts or margin > low:
        return None
    return (f"objective.refl_margin={margin:g} is at or below every score the optimised reward takes "
            f"({'; '.join(parts)}: R ≈ [{low:g}, {high:g}]), so relu(m − R) is 0 for every sample and nothing "
            f"trains; the release's {REFL_MARGIN:g} is in ImageReward's standardised units; set "
            f"objective.refl_margin above {low:g} (e.g. {high:g}, the top of the range), or use variant draft_k")


def refl_step(num_steps: int, last_steps: int, generator: torch.Generator) -> int:
    """ReFL's training step j, uniform over the last ``last_steps`` of a ``num_steps``-step grid: T − L … T − 1
    (the release's ``random.randint(30, 39)`` for T = 40, L = 10).

    Raises:
        ValueError: L outside [1, T].
    """
    if not 1 <= last_steps <= num_steps:
        raise ValueError(f"objective.refl_last_steps must be in [1, sampling.num_steps={num_steps}], got {last_steps}")
    return num_steps - last_steps + int(torch.randint(last_steps, (1,), generator=generator))


def differentiable_reward_problems(specs) -> list[str]:
    """One line for each reward of non-zero weight whose plugin declares no differentiable score (its class or
    factory lacks ``differentiable = True``), before anything is constructed. ``specs``: the run's ``rewards``
    (:class:`~flowgrpo.config.RewardSpec`). A name that does not resolve is left to the reward check."""
    from flowgrpo.rewards.registry import weighted_reward_factories

    out = []
    for spec, factory in weighted_reward_factories(specs):
        if not is_differentiable(factory):
            out.append(f"objective.name=refl backpropagates the reward's gradient, but reward {spec.name!r} "
                       "declares no differentiable score; use one that does (built in: "
                       f"{', '.join(DIFFERENTIABLE_BUILTINS)}), or give it weight 0 (a logged metric)")
    return out


def check_differentiable_rewards(specs) -> None:
    """Refuse every reward :func:`differentiable_reward_problems` finds, in one ``ValueError`` (one line each)."""
    refuse(differentiable_reward_problems(specs), "objective 'refl' cannot optimise these rewards")


class RewardBackpropConfig(ObjectiveConfig):
    """``objective: {name: refl, ...}``: ReFL and DRaFT (module docstring), read as it is by the objective
    (validated once, here), with ReFL's release values for its own knobs.

    Attributes:
        variant: ``refl`` (the default: ``objective: {name: refl}`` is ReFL as released), ``draft_k`` or
            ``draft_lv``.
        k: DRaFT-K's K ≥ 1, the last sampling steps the gradient flows through (K ≤ T, checked against the grid;
            K = T is full DRaFT).
        lv_samples: DRaFT-LV's n ≥ 1, the re-noised copies of each sample (default 2).
        refl_last_steps: ReFL draws its step from the last this many grid steps (≥ 1; the release: 10 of 40).
        reward_scale: s > 0, the loss scale, or None (the default) for the variant's source's:
            :data:`REFL_GRAD_SCALE` (1e-3, the release's ``grad_scale``) for ``refl``, :data:`DRAFT_SCALE` (1) for
            DRaFT; :meth:`scale` resolves it.
        refl_margin: ReFL's hinge m in max(0, m − R) (the release: 2, in ImageReward's units); refused where the
            rewards' declared ranges put every score at or above it (:func:`refl_margin_problem`).
        checkpointing: recompute each step's activations in the backward (``torch.utils.checkpoint``).
    """

    name: Literal["refl"] = "refl"
    variant: Variant = Field(
        "refl", description="reward backpropagation: refl (ReFL, the objective's name and default: one-step x0 "
        "prediction from a random late step, as ImageReward/ReFL.py), draft_k (DRaFT-K, the last k steps), draft_lv "
        "(DRaFT-LV: the last step, lv_samples re-noised copies)")
    k: int = Field(1, ge=1, description="DRaFT-K: sampling steps the reward's gradient flows back through (<= "
                   "sampling.num_steps; K = T is full DRaFT)")
    lv_samples: int = Field(2, ge=1, description="DRaFT-LV: re-noised copies of each sample")
    refl_last_steps: int = Field(10, ge=1, description="ReFL: its step is drawn from the last this many grid steps "
                                 "(the release: 10 of 40)")
    reward_scale: float | None = Field(
        None, gt=0, description="reward backpropagation: loss scale s (DRaFT -s*R; ReFL s*relu(margin - R)); unset: "
        "the variant's source's, 1e-3 for refl (ImageReward's grad_scale), 1 for draft_k / draft_lv")
    refl_margin: float = Field(REFL_MARGIN, description="ReFL: the hinge m of relu(m - R) (the release: 2, in "
                               "ImageReward's units; refused when every score the rewards declare lies at or above "
                               "it: set it for the reward's scale, e.g. 24 for PickScore's 18-24)")
    checkpointing: bool = Field(True, description="reward backpropagation: torch.utils.checkpoint each sampling "
                                "step and the decode of the gradient path (recompute in the backward)")

    trains_on: ClassVar[str] = ("its Euler rollout's path (a late step's latent; draft_lv: the final sample) and the "
                                "reward's gradient")
    instead: ClassVar[dict[tuple[str, str], str]] = {
        ("sampling", "sde_kind"): "its rollout is Euler (ODE) steps",
        ("sampling", "noise_level"): "its rollout is Euler (ODE) steps, without noise",
        ("sampling", "sigma_one_guard"): "its rollout is Euler (ODE) steps",
        ("sampling", "final_decode"): "it decodes its rollout's final sample",
    }

    def problems(self, config) -> list[str]:
        """The SDE-ratio settings (:func:`~flowgrpo.algo.objectives.forward.sde_ratio_problems`), every reward of
        non-zero weight without a differentiable score (:func:`differentiable_reward_problems`), and DRaFT-K's K or
        ReFL's window longer than the ``sampling.num_steps`` grid, one line each."""
        out = super().problems(config) + sde_ratio_problems(self, config)
        t = config.sampling.num_steps
        if self.variant == "draft_k" and self.k > t:
            out.append(f"objective.k={self.k} exceeds sampling.num_steps={t}")
        if self.variant == "refl" and self.refl_last_steps > t:
            out.append(f"objective.refl_last_steps={self.refl_last_steps} exceeds sampling.num_steps={t}")
        return out + differentiable_reward_problems(config.rewards)

    def scale(self) -> float:
        """The loss scale s: ``reward_scale``, else the variant's source's (:data:`REFL_GRAD_SCALE` for ``refl``,
        :data:`DRAFT_SCALE` for DRaFT)."""
        if self.reward_scale is not None:
            return self.reward_scale
        return REFL_GRAD_SCALE if self.variant == "refl" else DRAFT_SCALE

    def forwards_per_sample(self) -> int:
        """The update's rows per sample: n for DRaFT-LV, else 1."""
        return self.lv_samples if self.variant == "draft_lv" else 1


@OBJECTIVES.register("refl")
class RewardBackprop(ForwardObjective):
    """ReFL / DRaFT (module docstring) on the forward family's plan and update loop: one row per (sample, copy),
    the loss of :meth:`terms` averaged over an optimizer step's rows on all processes."""
    #: why rollout workers (runtime.engine: ray) cannot serve it
    rollout_workers_refusal = ("its update back-propagates the reward through a sampling chain restarted from the "
                               "rollout's own path, with no importance ratio to correct a path another copy of the "
                               "policy sampled")

    Config = RewardBackpropConfig
    uses_old_copy = False
    trains_on_advantages = False  # the reward's gradient is the signal, whatever the group

    def __init__(self, config) -> None:
        super().__init__(config)
        self.rewards = None
        self._warned_inactive = False

    def check_rewards(self, rewards) -> None:
        """ReFL's margin against the constructed rewards' declared ranges (:func:`refl_margin_problem`):
        ``ValueError`` in one line where it can never be active. Called before any model loads
        (:func:`flowgrpo.preflight.preflight`) and again by :meth:`attach`; nothing for DRaFT."""
        if self.o.variant == "refl":
            problem = refl_margin_problem(self.o.refl_margin, rewards)
            if problem:
                raise ValueError(problem)

    @property
    def needs_reference(self) -> bool:
        """No KL to the base model (the papers have none)."""
        return False

    def attach(self, adapter, rewards) -> None:
        """Keep the optimised rewards (a :class:`~flowgrpo.rewards.compose.ComposedReward`, set up); every one of
        non-zero weight must be differentiable as constructed (``strict`` digits or a PIL resize are not): else a
        ``ValueError`` naming it."""
        for name, reward in rewards.rewards.items():
            if rewards.weights[name] != 0 and not is_differentiable(reward):
                raise ValueError(f"objective.name=refl: reward {name!r} as configured has no differentiable score "
                                 "(a 0/1 verdict such as strict=true, or resize_backend=pil); change its kwargs or "
                                 "give it weight 0")
        self.check_rewards(rewards)
        self.rewards = rewards

    def trajectories_per_sample(self, sigmas: torch.Tensor, settings) -> int:
        """K and ReFL's window must fit the T-step grid (``ValueError``); one trajectory a sample."""
        t = sigmas.numel() - 1
        s = self.o
        if s.variant == "draft_k" and s.k > t:
            raise ValueError(f"objective.k={s.k} exceeds sampling.num_steps={t}")
        if s.variant == "refl" and s.refl_last_steps > t:
            raise ValueError(f"objective.refl_last_steps={s.refl_last_steps} exceeds sampling.num_steps={t}")
        return 1

    def sigmas_per_sample(self, sigmas: torch.Tensor) -> int:
        return self.o.forwards_per_sample()

    def rollout(self, adapter, request) -> PathSamples:
        """The Euler path of every sample (no gradient), decoded and scored as every rollout."""
        return path_rollout(adapter, request, noise_level=0.0)

    def plan(self, samples: PathSamples, adv: Advantages, keep: torch.Tensor, epoch: int) -> ForwardWork:
        """The forward family's plan, every sample the group filter keeps trained whatever its advantage (the
        reward's gradient is the signal; a NaN reward trains nothing: its rows' reward is left out)."""
        return super().plan(samples, dataclasses.replace(adv, train_mask=torch.ones_like(adv.train_mask)), keep,
                            epoch)

    def draws(self, work: ForwardWork, rows: torch.Tensor, inner: int) -> list[PathDraw]:
        """DRaFT-K: one draw from step T − K; DRaFT-LV: n draws at step T − 1, each with its own ε per sample
        (seeded by the sample); ReFL: one draw from a step of the last window (seeded by the global micro-batch)."""
        s, st = work.samples, self.o
        t = s.sigmas.numel() - 1
        shape = (len(rows), *s.x0.shape[1:])
        zeros = torch.zeros(()).expand(shape)
        if st.variant == "draft_k":
            j = t - st.k
            return [PathDraw(rows, s.sigmas[j].expand(len(rows)).clone(), zeros, step=j)]
        if st.variant == "refl":
            g = make_generator(self.cfg.train.seed, work.epoch, inner, "refl", work.micro_batch_index(rows))
            j = refl_step(t, st.refl_last_steps, g)
            return [PathDraw(rows, s.sigmas[j].expand(len(rows)).clone(), zeros, step=j)]
        eps = []
        for r in rows.tolist():
            g = make_generator(self.cfg.train.seed, work.epoch, inner, "draft_lv", int(s.group_ids[r]),
                               int(s.sample_index[r]))
            eps.append(torch.randn((st.lv_samples, *s.x0.shape[1:]), generator=g))
        eps_t = torch.stack(eps)  # (n, copies, …)
        sig = s.sigmas[t - 1].expand(len(rows)).clone()
        return [PathDraw(rows, sig, eps_t[:, c], step=t - 1) for c in range(st.lv_samples)]

    def terms(self, adapter, work: ForwardWork, draw: PathDraw, x0: torch.Tensor, embeds) -> ObjectiveTerms:
        """The gradient path of the draw (module docstring), the decode and the composed differentiable reward;
        the per-row loss with stats ``reward`` (R) and ``images_mean`` (the decoded images' mean)."""
        if self.rewards is None:
            raise RuntimeError("objective refl: attach(adapter, rewards) was not called before the update")
        st, s = self.o, work.samples
        dev, n = x0.device, len(draw.rows)
        guidance = s.guidance_scale

        def velocity(z: torch.Tensor, sigma: float) -> torch.Tensor:
            return self.velocity(adapter, z, torch.full((n,), sigma, device=dev), embeds, guidance=guidance)

        sigma = float(s.sigmas[draw.step])
        if st.variant == "draft_k":
            start = s.latents[draw.rows.to(s.latents.device), draw.step].to(dev).float()
            x_hat = euler_replay(velocity, start, s.sigmas, draw.step, checkpointing=st.checkpointing)
        elif st.variant == "draft_lv":
            x_hat = x0_prediction(velocity, noised(x0, draw.noise.to(dev), sigma), sigma,
                                  checkpointing=st.checkpointing)
        else:
            start = s.latents[draw.rows.to(s.latents.device), draw.step].to(dev).float()
            x_hat = x0_prediction(velocity, start, sigma, checkpointing=st.checkpointing)
        images = (checkpoint(decode_with_grad, adapter, x_hat, embeds, use_reentrant=False) if st.checkpointing
                  else decode_with_grad(adapter, x_hat, embeds))
        rows = draw.rows.tolist()
        reward = self.reward_total(images, [s.prompts[r] for r in rows], [s.metadata[r] for r in rows])
        stats = {"reward": reward.detach(), "images_mean": images.detach().float().mean(dim=(1, 2, 3))}
        if st.variant == "refl":
            loss = refl_loss(reward, st.scale(), st.refl_margin)
            stats["active"] = (reward.detach() < st.refl_margin).float()  # inside the hinge: a gradient
        else:
            loss = draft_loss(reward, st.scale())
        return ObjectiveTerms(loss=loss, stats=stats)

    def update_metrics(self, adapter, work: ForwardWork, stats) -> dict[str, float]:
        """The forward family's metrics (ReFL's ``objective/active``: the share of trained rows, on all
        processes, whose reward is below the margin); the first update in which no row is (every relu term 0,
        no gradient) is warned about in one line on rank 0, once a run."""
        out = super().update_metrics(adapter, work, stats)
        if out.get("objective/active", 1.0) == 0 and not self._warned_inactive:
            self._warned_inactive = True
            if dist.rank() == 0:
                logger.warning("objective refl: no sample was inside the margin in this update (every reward >= "
                               "objective.refl_margin=%g; mean %.4g): relu(m - R) is 0, nothing trained; set the "
                               "margin above the reward's range", self.o.refl_margin,
                               out.get("objective/reward", float("nan")))
        return out

    def reward_total(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """``R = Σ_i w_i·r_i`` over the rewards of non-zero weight, each's differentiable score (a NaN score, "not
        applicable", contributes nothing, as in :func:`~flowgrpo.rewards.compose.compose_rewards`): (n,) float32
        with gradient to ``images``."""
        total = torch.zeros(images.shape[0], device=images.device)
        for name, reward in self.rewards.rewards.items():
            w = float(self.rewards.weights[name])
            if w == 0 or not math.isfinite(w):
                continue
            r = differentiable_scores(reward, images, prompts, metadata, name).to(images.device)
            total = total + torch.where(torch.isnan(r), torch.zeros_like(r), w * r)
        return total
