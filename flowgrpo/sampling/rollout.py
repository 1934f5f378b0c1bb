"""Sampling: P prompts × G samples through the SDE sampler, recording what the update needs.

The loop is the diffusers denoising loop with :func:`~flowgrpo.sampling.sde.sde_step` in place of the scheduler's
step: the same velocity function and the same step function that training calls.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from flowgrpo.models.base import decode_latents
from flowgrpo.records import PromptEmbeds, Trajectory
from flowgrpo.rng import make_generator
from flowgrpo.sampling.config import SamplingConfig
from flowgrpo.sampling.feature_cache import feature_cache, ode_step_cache
from flowgrpo.sampling.sde import FINAL_DECODES, sde_step, sigma_one_next


def denoise(
    adapter,
    latents: torch.Tensor,
    embeds: PromptEmbeds,
    sigmas: torch.Tensor,
    settings: SamplingConfig,
    sde_steps: torch.Tensor,
    generators: Sequence[torch.Generator] | None,
    *,
    record: bool = True,
    return_final: bool = False,
    cache_state=None,
    ode_cache=None,
):
    """Run T transitions from ``latents`` (B, …) at σ = sigmas[0].

    Args:
        sde_steps: (T,) bool, transitions sampled with ``settings.sde_kind``; the others are ODE steps.
        generators: one per sample for the SDE noise (None only when no step is stochastic).
        record: keep every latent and log-prob (training) or only the last latent (evaluation).
        return_final: also return the (B, …) latents to decode, chosen by ``settings.final_decode``.
        cache_state: the open :class:`~flowgrpo.sampling.feature_cache.FeatureCache` of the loop (its
            :meth:`~flowgrpo.sampling.feature_cache.FeatureCache.step` is called before each velocity), or None.
        ode_cache: an open :class:`~flowgrpo.sampling.feature_cache.OdeStepCache` (on over the runs of ODE steps
            only, off at every step of ``sde_steps``), or None.

    Returns:
        (latents (B, T+1, …) or (B, …) final, log_probs (B, T), stochastic (B, T) bool), and with
        ``return_final`` the latents to decode as a fourth item.
    """
    b = latents.shape[0]
    t_count = len(sigmas) - 1
    x = latents.float()
    all_x = [x] if record else None
    log_probs = torch.zeros(b, t_count)
    stochastic = torch.zeros(b, t_count, dtype=torch.bool)
    guard = sigma_one_next(settings, sigmas)
    for t in range(t_count):
        sigma = sigmas[t].expand(b).to(x.device)
        if cache_state is not None:
            cache_state.step(float(sigmas[t]))
        if ode_cache is not None:  # off (state dropped) before a velocity that enters a log-prob
            ode_cache.step(float(sigmas[t]), cached=not bool(sde_steps[t]))
        prev = x
        v, out = _transition(adapter, x, sigma, embeds, sigmas, t, settings, bool(sde_steps[t]), generators, guard)
        x = out.next_latents
        log_probs[:, t] = out.log_prob.cpu()
        stochastic[:, t] = (out.std > 0).cpu()
        if record:
            all_x.append(x)
    result = (torch.stack(all_x, dim=1) if record else x), log_probs, stochastic
    if not return_final:
        return result
    decode = FINAL_DECODES.get(settings.final_decode)
    return (*result, decode(prev, v, sigmas[t_count - 1].item(), out))


def _transition(adapter, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds, sigmas: torch.Tensor, t: int,
                settings: SamplingConfig, stochastic: bool, generators, guard):
    """Transition ``t`` of :func:`denoise` from ``x`` (B, …) float32 at σ = ``sigmas[t]`` (``sigma``: (B,) on
    ``x``'s device): the velocity, then an SDE step of ``settings.sde_kind`` (``stochastic``) or an ODE step to
    ``sigmas[t + 1]``. Returns (velocity, :func:`sde_step`'s output)."""
    v = adapter.velocity(x, sigma, embeds, settings.guidance_scale)
    out = sde_step(
        x, v, sigmas[t].item(), sigmas[t + 1].item(), kind=settings.sde_kind if stochastic else "ode",
        noise_level=settings.noise_level, generator=list(generators) if generators is not None else None,
        reduction=settings.logprob_reduction, simplified_log_prob=settings.cps_simplified_logprob,
        sigma_one_next=guard,
    )
    return v, out


def load_condition_images(paths) -> list:
    """The RGB PIL images of a prompt record's ``images`` paths (absolute, as the prompt loader resolves them)."""
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in paths]


def missing_image_line(adapter, prompt: str, where: str = "") -> str:
    """One line for a prompt record without the conditioning image that ``adapter`` (``image_conditioned``: an
    image-to-video or editing model) needs, saying exactly what to add to the prompt file: the record as a JSONL
    line with its ``image``. ``where``: the record's setting and file, as `` of data.train_prompts (p.txt)``."""
    pipeline = type(getattr(adapter, "pipe", adapter)).__name__
    what, example = (("its first frame", "first_frames/0001.png") if getattr(adapter, "video", False)
                     else ("the image it edits", "sources/0001.png"))
    record = json.dumps({"prompt": prompt, "image": example}, ensure_ascii=False)
    return (f"{pipeline} conditions every sample on an image ({what}), but the prompt record {prompt!r}{where} has "
            f"none: write the prompt file as JSONL (.jsonl), one record a line with its image, e.g. {record} (the "
            "path relative to the prompt file's folder; several images: \"images\": [...])")


def check_condition_images(adapter, prompts, setting: str) -> None:
    """Every record of ``prompts`` (a :class:`~flowgrpo.data.prompts.PromptSet`, from ``setting``, e.g.
    ``data.train_prompts``) has its conditioning images when ``adapter`` is image-conditioned; checked right after
    the model loads, before anything is sampled. Raises ``ValueError``: :func:`missing_image_line` for the first
    record without, with the count."""
    if prompts is None or not getattr(adapter, "image_conditioned", False):
        return
    missing = [p for p, m in zip(prompts.prompts, prompts.metadata, strict=True) if not m.get("images")]
    if missing:
        raise ValueError(missing_image_line(adapter, missing[0], f" of {setting} ({prompts.source}; "
                                                                 f"{len(missing)} of {len(prompts)} records lack one)"))


@torch.no_grad()
def encode_rows(adapter, prompts: list[str], metadata: list[dict] | None = None) -> PromptEmbeds:
    """Conditioning of B rows, each distinct one encoded once: B :class:`PromptEmbeds` rows on the adapter's
    device, shared by every row (the G samples of a group) that has the same prompt and conditioning images.

    An adapter with ``image_conditioned = True`` (an editing model) is given the images of each record's
    ``images`` paths (``encode_prompts(prompts, images=...)``); for the others the text alone is the key. An
    adapter with a ``prompt_cache`` (:mod:`flowgrpo.sampling.prompt_cache`) encodes only the keys it has not seen.

    Raises:
        ValueError: an image-conditioned adapter and a record without ``images``, or metadata of another length.
    """
    metadata = [{} for _ in prompts] if metadata is None else list(metadata)
    if len(metadata) != len(prompts):
        raise ValueError(f"encode_rows got {len(prompts)} prompts but {len(metadata)} metadata dicts")
    conditioned = bool(getattr(adapter, "image_conditioned", False))
    if conditioned:
        missing = [p for p, m in zip(prompts, metadata, strict=True) if not m.get("images")]
        if missing:
            raise ValueError(missing_image_line(adapter, missing[0]))
    keys = [(p, tuple(m.get("images", ())) if conditioned else ()) for p, m in zip(prompts, metadata, strict=True)]
    unique = list(dict.fromkeys(keys))
    where = torch.tensor([unique.index(k) for k in keys])

    def encode(positions: list[int]) -> PromptEmbeds:
        todo = [unique[i] for i in positions]
        texts = [k[0] for k in todo]
        encoding = getattr(adapter, "encoding", contextlib.nullcontext)  # offloaded encoders: on the device in it
        with encoding():
            if conditioned:
                return adapter.encode_prompts(texts, images=[load_condition_images(k[1]) for k in todo])
            return adapter.encode_prompts(texts)

    cache = getattr(adapter, "prompt_cache", None)  # model.cache_prompt_embeddings (flowgrpo.sampling.prompt_cache)
    embeds = encode(list(range(len(unique)))) if cache is None else cache.embeds(unique, encode, adapter.device)
    return embeds.index(where.to(embeds.device))


@dataclass(frozen=True)
class RolloutRequest:
    """What one epoch's rollout is asked for: B local samples, sample b of prompt ``prompt_ids[b]``.

    Attributes:
        prompts, metadata: B prompts and metadata dicts (the G samples of a group repeat their prompt).
        prompt_ids: (B,) long global prompt indices; they are the group ids.
        sample_index: (B,) long index of each sample within its group (0..G−1); with ``prompt_ids``, ``seed``
            and ``epoch`` it seeds the sample's noise, so a sample is the same whichever process or batch
            draws it.
        settings: how to sample (:class:`~flowgrpo.config.SamplingConfig`).
        batch_size: trajectories per transformer call.
        seed, epoch: the run seed and the epoch, for the noise generators.
        same_noise_in_group: the G samples of a prompt share their initial noise (their SDE noise differs).
        progress: show a progress bar.
        on_images: called with (images, prompts, metadata) of each micro-batch, in sample order, as soon as it
            is decoded, so rewards are scored in the background while the next micro-batch is sampled.
        latents_on_cpu: move each micro-batch's (b, T+1, …) latents to CPU memory once sampled (the trainer
            moves the rows it trains back to the device).
        ode_cache: a :class:`~flowgrpo.config.FeatureCacheConfig` (``sampling.cache`` of a chunker with ODE steps)
            on only over the runs of ODE steps (:func:`~flowgrpo.sampling.feature_cache.ode_step_cache`), or None.

    Raises:
        ValueError: on construction, when the lengths disagree or ``batch_size`` < 1.
    """

    prompts: list[str]
    metadata: list[dict]
    prompt_ids: torch.Tensor
    sample_index: torch.Tensor
    settings: SamplingConfig
    batch_size: int
    seed: int
    epoch: int
    same_noise_in_group: bool = False
    progress: bool = False
    on_images: Callable[[torch.Tensor, list[str], list[dict]], None] | None = None
    latents_on_cpu: bool = False
    ode_cache: object | None = None

    def __post_init__(self) -> None:
        b = len(self.prompts)
        if len(self.metadata) != b or self.prompt_ids.shape != (b,) or self.sample_index.shape != (b,):
            raise ValueError(
                f"rollout got {b} prompts, {len(self.metadata)} metadata dicts, prompt_ids "
                f"{tuple(self.prompt_ids.shape)}, sample_index {tuple(self.sample_index.shape)}"
            )
        if self.batch_size < 1:
            raise ValueError(f"rollout batch_size must be >= 1, got {self.batch_size}")


def decode_and_report(adapter, final_latents: torch.Tensor, prompts: list[str], metadata: list[dict],
                      request: RolloutRequest, embeds: PromptEmbeds | None = None) -> torch.Tensor:
    """Decode (B, …) final latents in micro-batches of ``request.batch_size``, handing each decoded batch to
    ``request.on_images`` at once. Returns (B, 3, H, W) float32 images in [0, 1] on the CPU.

    ``embeds``: the B rows' embeddings, for an adapter that decodes with them (``decode_needs_embeds``:
    :func:`~flowgrpo.models.base.decode_latents`); None: such an adapter's rows are encoded here (from the prompt
    cache when it has one)."""
    out = []
    needs = getattr(adapter, "decode_needs_embeds", False)
    for i in range(0, final_latents.shape[0], request.batch_size):
        sl = slice(i, i + request.batch_size)
        rows = None
        if needs:
            rows = embeds.index(sl) if embeds is not None else encode_rows(adapter, list(prompts[sl]),
                                                                           list(metadata[sl]))
        out.append(decode_latents(adapter, final_latents[sl].to(adapter.device), rows).cpu())
        if request.on_images is not None:
            request.on_images(out[-1], list(prompts[sl]), list(metadata[sl]))
    return torch.cat(out)


@torch.no_grad()
def rollout(adapter, request: RolloutRequest, sde_steps: torch.Tensor) -> Trajectory:
    """Sample one trajectory per requested sample, SDE at ``sde_steps`` ((T,) bool), ODE elsewhere.

    Returns:
        A :class:`~flowgrpo.records.Trajectory` (latents on the adapter's device, or on the CPU with
        ``latents_on_cpu``; images on the CPU).

    Raises:
        ValueError: ``request.batch_size`` does not divide the B samples.
    """
    r, settings = request, request.settings
    b = len(r.prompts)
    if b % r.batch_size:
        raise ValueError(f"rollout batch_size {r.batch_size} must divide the {b} samples")
    sigmas = adapter.sigmas(settings.num_steps)
    embeds = encode_rows(adapter, list(r.prompts), list(r.metadata))
    pairs = list(zip(r.prompt_ids.tolist(), r.sample_index.tolist(), strict=True))
    init_gens = [make_generator(r.seed, r.epoch, pid, "init", 0 if r.same_noise_in_group else j) for pid, j in pairs]
    noise_gens = [make_generator(r.seed, r.epoch, pid, "sde", j) for pid, j in pairs]
    chunks_x, chunks_lp, chunks_st, images = [], [], [], []
    for start in tqdm(range(0, b, r.batch_size), desc="rollout", disable=not r.progress, leave=False):
        sl = slice(start, start + r.batch_size)
        x0 = adapter.initial_latents(r.batch_size, init_gens[sl])
        with ode_step_cache(adapter, r.ode_cache, settings.num_steps) as ode_cache:
            xs, lp, st, final = denoise(adapter, x0, embeds.index(sl), sigmas, settings, sde_steps, noise_gens[sl],
                                        return_final=True, ode_cache=ode_cache)
        chunks_x.append(xs.cpu() if r.latents_on_cpu else xs)
        chunks_lp.append(lp)
        chunks_st.append(st)
        images.append(decode_and_report(adapter, final, r.prompts[sl], r.metadata[sl], r, embeds.index(sl)))
    stochastic = torch.cat(chunks_st)
    return Trajectory(
        latents=torch.cat(chunks_x),
        log_probs=torch.cat(chunks_lp),
        sigmas=sigmas,
        stochastic=stochastic,
        jump=torch.ones_like(stochastic, dtype=torch.long),
        group_ids=r.prompt_ids.clone(),
        prompt_ids=r.prompt_ids.clone(),
        embeds=embeds,
        images=torch.cat(images),
        prompts=list(r.prompts),
        metadata=list(r.metadata),
        guidance_scale=settings.guidance_scale,
    )


@torch.no_grad()
def generate_images(
    adapter,
    prompts: list[str],
    seeds: Sequence[int],
    *,
    num_steps: int,
    guidance_scale: float,
    batch_size: int = 8,
    progress: bool = False,
    metadata: list[dict] | None = None,
    cache=None,
    decode: bool = True,
) -> torch.Tensor:
    """ODE samples, one per (prompt, seed): (B, 3, H, W) float32 in [0, 1] on the CPU.

    ``cache``: a :class:`~flowgrpo.config.FeatureCacheConfig` (``eval_sampling.cache``) enabled around each batch's
    loop (:func:`~flowgrpo.sampling.feature_cache.feature_cache`), or None. A cache decides to skip a step for the
    whole batch, so with one that skips an image depends on its batch too (the same ``batch_size`` reproduces it).

    The initial noise of image i comes from ``make_generator(seed_i, "eval")``, so an image depends only on its
    prompt and seed, never on the batch it was generated in. ``metadata`` (one dict per prompt) carries the
    conditioning ``images`` of an image-conditioned (editing) model. ``decode=False``: the final latents (B, …)
    on the CPU instead, not decoded (the other ranks of a context group, whose first rank decodes the group's
    images: :func:`flowgrpo.distributed.dist.context_leader`).
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"generate_images needs one seed per prompt, got {len(prompts)} prompts, {len(seeds)} seeds")
    settings = SamplingConfig(num_steps=num_steps, guidance_scale=guidance_scale, sde_kind="ode")
    sigmas = adapter.sigmas(num_steps)
    no_sde = torch.zeros(num_steps, dtype=torch.bool)
    out = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="sample", disable=not progress, leave=False):
        ps = list(prompts[start : start + batch_size])
        meta = None if metadata is None else list(metadata[start : start + batch_size])
        gens = [make_generator(int(s), "eval") for s in seeds[start : start + batch_size]]
        x0 = adapter.initial_latents(len(ps), gens)
        rows = encode_rows(adapter, ps, meta)
        with feature_cache(adapter, cache, num_steps) as state:
            x, _, _ = denoise(adapter, x0, rows, sigmas, settings, no_sde, None, record=False, cache_state=state)
        out.append((decode_latents(adapter, x, rows) if decode else x).cpu())
    return torch.cat(out)
