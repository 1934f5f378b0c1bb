"""Typed records passed between the phases of an epoch (rollout → reward → advantage → plan → update).

Glossary (docs/design.md): B trajectories = P prompts × G samples, T sampling steps, K trained chunks, σ noise level
(σ = 1 pure noise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PromptEmbeds:
    """Text conditioning for a batch: named tensors whose first dim is the batch B.

    FLUX holds ``prompt_embeds`` (B, L, D) and ``pooled_prompt_embeds`` (B, D'); SD3 adds the negative-prompt
    pair for classifier-free guidance. ``shared`` holds tensors common to the whole batch (FLUX's text ids).
    """

    tensors: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"prompt embeddings disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key] if key in self.tensors else self.shared[key]

    def index(self, idx: torch.Tensor | slice) -> PromptEmbeds:
        """Rows ``idx`` of every batched tensor (a slice or a (B',) long tensor on their device)."""
        if isinstance(idx, slice):
            return PromptEmbeds({k: v[idx] for k, v in self.tensors.items()}, self.shared)
        return PromptEmbeds({k: v.index_select(0, idx) for k, v in self.tensors.items()}, self.shared)

    def repeat_interleave(self, n: int) -> PromptEmbeds:
        """Each row repeated ``n`` times in place: (P, …) → (P·n, …), the P×G group layout (``self`` for n = 1)."""
        if n == 1:
            return self
        return PromptEmbeds({k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()}, self.shared)

    def to(self, device: torch.device | str) -> PromptEmbeds:
        return PromptEmbeds(
            {k: v.to(device) for k, v in self.tensors.items()}, {k: v.to(device) for k, v in self.shared.items()}
        )


@dataclass(frozen=True)
class SampleBatch:
    """What every rollout record carries beside its latents, for the B samples: the prompts, their embeddings and
    decoded images, and the rollout's guidance.

    Attributes:
        embeds: prompt embeddings for the B samples (the model's device).
        images: (B, 3, H, W) float32 host in [0, 1], the decoded final latents.
        prompts: the B prompts; metadata: their B metadata dicts.
        guidance_scale: the guidance the rollout used.
    """

    embeds: PromptEmbeds
    images: torch.Tensor
    prompts: list[str]
    metadata: list[dict]
    guidance_scale: float


@dataclass(frozen=True)
class Trajectory(SampleBatch):
    """A batch of sampled denoising trajectories with everything the update needs (and :class:`SampleBatch`'s
    fields; its ``guidance_scale`` is the one training must reuse).

    Attributes:
        latents: (B, T+1, …) float32; ``latents[:, t]`` is x at ``sigmas[t]``; index 0 is the initial noise.
        log_probs: (B, T) float32, log-density of each transition under the rollout policy (0 where deterministic).
        sigmas: (T+1,) float32 σ grid, 1 → 0, on the host.
        stochastic: (B, T) bool, transitions sampled by an SDE (std > 0); only these can be trained.
        jump: (B, T) long on the host, grid steps each transition spans: 1 normally, m for an E-GRPO merged jump
            starting there, 0 for the steps inside a jump (their latents repeat the jump's end).
        group_ids: (B,) long, global id of the sample's group (a prompt, or a prompt and branch step).
        prompt_ids: (B,) long, global index of the sample's prompt.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    stochastic: torch.Tensor
    jump: torch.Tensor
    group_ids: torch.Tensor
    prompt_ids: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    @property
    def initial_noise(self) -> torch.Tensor:
        """(B, …) the latents each trajectory starts from (σ = 1)."""
        return self.latents[:, 0]


@dataclass(frozen=True)
class FinalSamples(SampleBatch):
    """A batch of rollout samples of which only the final latents are kept: what the forward-process objectives
    (DiffusionNFT, AWM, DGPO) train on, with no trajectory and no log-probability.

    Attributes:
        x0: (B, …) float32 final latents (the solver's sample at σ = 0), on the model's device, or on the host
            with ``train.latents_on_cpu``.
        initial_noise: (B, …) float32 latents each rollout started from, where ``x0`` is.
        sigmas: (T+1,) float32 host, the grid the objective draws its training σ's from (the rollout's own, or
            the unmodified one when the solver moved it: AWM's SA-Solver grid).
        group_ids: (B,) long host, global id of each sample's group; sample_index: (B,) long host, its index in
            the group (0..G−1). With the run seed and the epoch they seed every draw of the update.

    With :class:`SampleBatch`'s fields; its ``guidance_scale`` is the rollout's (training sets its own).
    """

    x0: torch.Tensor
    initial_noise: torch.Tensor
    sigmas: torch.Tensor
    group_ids: torch.Tensor
    sample_index: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.x0.shape[0]


@dataclass(frozen=True)
class Rewards:
    """Scores of B samples.

    Attributes:
        components: name → (B,) float32 raw scores of each reward (NaN = not applicable).
        weights: name → weight from the config.
        total: (B,) float32 weighted sum Σ w_i·r_i of the components present (NaN when none is).
    """

    components: dict[str, torch.Tensor]
    weights: dict[str, float]
    total: torch.Tensor


@dataclass(frozen=True)
class Advantages:
    """Per-sample advantages and their bookkeeping.

    Attributes:
        values: (B,) float32 advantages (0 for invalid samples and zero-spread groups).
        train_mask: (B,) bool, samples that take part in the update (False for NaN rewards and, when dropping is
            on, for zero-spread groups).
        zero_spread_frac: fraction of groups whose valid rewards are all equal.
        nan_frac: fraction of samples whose composed reward is NaN.
        learning_frac: fraction of samples that carry a learning signal: in ``train_mask`` and in a group whose
            valid rewards differ (the rest have advantage 0 and move the policy only through the KL term).
    """

    values: torch.Tensor
    train_mask: torch.Tensor
    zero_spread_frac: float
    nan_frac: float
    learning_frac: float


@dataclass(frozen=True)
class ChunkPlan:
    """Which transitions are trained and which share one importance ratio.

    Attributes:
        chunks: K chunks, each a tuple of transition indices (shared by all samples).
        selected: (B, K) bool, whether sample b trains chunk k.
    """

    chunks: tuple[tuple[int, ...], ...]
    selected: torch.Tensor

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def trained_transition_frac(self, jump: torch.Tensor) -> float:
        """The share of the trajectory's transitions that the plan trains, averaged over the samples that train
        at least one chunk (0.0 when none does): ``plan/trained_frac``.

        A sample's count is the grid steps its selected chunks cover, ``Σ_k selected[b, k]·Σ_(t ∈ chunk k)
        jump[b, t]`` (an E-GRPO merged jump of m grid steps counts m), divided by T, the trajectory's grid steps.
        E.g. MixGRPO's 4-step window of 8 steps gives 0.5; per-step with ``timestep_fraction`` 0.5 gives 0.5.

        Args:
            jump: (B, T) long, the trajectory's :attr:`Trajectory.jump` (B equal to ``selected``'s rows).
        """
        b, t = jump.shape
        span = torch.stack([jump[:, list(c)].sum(dim=1) for c in self.chunks], dim=1) if self.chunks else \
            torch.zeros(b, 0, dtype=torch.long)
        covered = (span * self.selected.long()).sum(dim=1)
        trained = self.selected.any(dim=1)
        return float(covered[trained].double().mean() / t) if bool(trained.any()) else 0.0


@dataclass(frozen=True)
class GroupTable:
    """A task's per-group figures for the end-of-run report (one row per group: a digit, a prompt category …),
    handed to the report by a reward's optional ``report_table(summary)`` hook.

    Attributes:
        columns: (header, format spec) per column, e.g. ``("correct before", ">14.3f")``; the console right-aligns
            each header to the spec's width.
        rows: per group, one value per column (None shows as ``-``).
        notes: per row, a text after it on the console (``"<- collapsed"``) or ``""``.
        panels: per row, the text under its column of ``before_after.png`` (the evaluation images cycle the
            groups), or empty for no such row.
        alerts: per row, whether its panel is drawn as an alert (red).
        keys: the ``summary.json`` keys the table reports, left out of the report's main before/after table.
    """

    columns: tuple[tuple[str, str], ...]
    rows: tuple[tuple[float | int | None, ...], ...]
    notes: tuple[str, ...]
    panels: tuple[str, ...]
    alerts: tuple[bool, ...]
    keys: frozenset[str]
