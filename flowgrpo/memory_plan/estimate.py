"""Per-GPU and per-rank host memory of a training config on N GPUs, computed without allocating anything
(``flowgrpo plan CONFIG --gpus N``; ``bench/memory.py --plan`` tabulates it for the shipped configs).

The models' sizes come from :mod:`flowgrpo.memory_plan.families` (meta-device builds of the released models, published
counts of the others, the LoRA's size with the config's rank and targets, the activation coefficients); this module
owns the arithmetic that turns a config and a GPU count into bytes per part and phase (:func:`workload_of`,
:func:`layout`, :func:`plan`) and its Markdown (:func:`render`). Figures are bytes internally and GiB (2**30 bytes)
in the output.

Layout (``parallel``): a world of N = replicate × shard × context processes (``parallel.replicate``,
``parallel.context_degree``); under ``parallel.sharding: fsdp2`` what FSDP2 shards is divided over the
N / replicate ranks of one replica (HSDP: shard × context), without sharding (DDP) every rank holds it whole
(text encoders or the other expert placed ``shard`` are divided over those ranks either way);
samples are split over the N / context data ranks, and a context group's ranks split each sample's tokens, so
activations and the rollout's working set divide by the context degree.

Parts (each "on each GPU" and "host memory per rank"):

* weights: the transformer's frozen weights in ``model.dtype`` (LoRA's base; none in full fine-tuning); masters:
  the trained weights in float32 (LoRA's adapter; full fine-tuning: every weight); both in host memory with
  ``parallel.offload: cpu`` (FSDP2's ``CPUOffloadPolicy``);
* grads: float32 gradients of the trained parameters, during the update only: sharded under FSDP2 with
  ``parallel.gradient_sync: micro_batch``, whole until the step's reduce-scatter with ``step``; DDP over several
  ranks keeps a second copy in its buckets; host with ``offload: cpu``;
* optimizer: AdamW's two float32 moments; host with ``offload: cpu``;
* reference: full fine-tuning keeps a frozen copy in ``model.dtype`` when the objective forwards the reference (its
  ``needs_reference``, as the trainer asks it: the SDE-ratio objective with ``objective.kl_beta`` > 0, DPO and DGPO
  always, NFT and AWM with their ``objective.kl_beta`` > 0), sharded like the policy (``parallel.reference:
  cpu_offload``: its shards in host memory); LoRA's reference is the base, adapter off;
* EMA: a float32 shadow of the trained parameters, sharded like them (``parallel.ema: cpu``: host);
* old copy: a float32 shadow of the trained parameters, sharded like them, when the objective keeps one (its
  ``uses_old_copy``: NFT, AWM, DGPO);
* teacher: OPD's whole frozen teacher transformer in ``model.dtype`` on the device (the objective's
  ``frozen_teacher``);
* fake score: DMD2's whole trained copy of the teacher on the device, float32 (computing in ``model.dtype``), with
  its float32 gradients and AdamW's two moments (16 bytes a weight; the objective's ``trains_teacher_copy``), whole
  on every rank; DMD2's optional GAN head (2·C² weights: 0.3 GB with its AdamW for FLUX.1) is not counted;
* surrogate reward: TDM-R1's trained copy of the teacher as the fake score (16 bytes a weight) and its float32 slow
  copy (4 bytes a weight), whole on every rank (the objective's ``surrogate_copies``); an objective whose
  ``lora_copies`` is set (TDM-R1) keeps its fake score and surrogate as LoRA adapters on the teacher under
  ``model.finetune: lora``: their own weights are the LoRA's;
* other expert (Wan2.2 A14B): the untrained expert in ``model.dtype``: whole (``parallel.experts: device``),
  sharded like the policy (``shard``), or whole in each rank's host memory, each block copied to the device for
  its forward (``offload``);
* text encoders: in ``model.dtype``: on the device (``device``), in host memory and whole on the device only while
  prompts are encoded (``offload``), or sharded over the replica's ranks (``shard``);
* reward models: in their dtype (float32 unless the reward's ``dtype`` says otherwise; HPSv3 bfloat16): on the
  device (``parallel.reward_models: device``) or in host memory, on the device only while scoring (``offload``);
* VAE: its weights in ``model.dtype``; decode: its activations while decoding a rollout micro-batch (three live
  feature maps of its widest full-resolution stage, 16-bit; Wan's video VAEs decode a latent frame at a time,
  LTX-2's and HunyuanVideo-1.5's the whole video);
* rollout latents: the rollout's latents of this rank's samples, float32, (T + 1) per sample (host memory with
  ``train.latents_on_cpu``), the samples being the objective's trajectories (E-GRPO's branches: several a
  requested sample, :func:`_objective_of`);
* activations: what the training forward keeps for the backward, per transformer call of
  ``train.train_batch_size`` rows (× 2 where true classifier-free guidance runs both branches with gradient):
  without gradient checkpointing Σ over blocks of (a·s_img + b·s_txt)·h bytes, with it each block's input
  (2·s·h) plus one block's (a·s_img + b·s_txt)·h while it is recomputed; a and b per block kind are
  :data:`~flowgrpo.memory_plan.families.COEFFICIENTS`, counted from the saved tensors of the real block classes
  (:func:`~flowgrpo.memory_plan.families.count_saved_bytes`); a LoRA's are counted when it is planned, on the narrow
  model
  with the config's targets (:func:`~flowgrpo.memory_plan.families.lora_kinds`: a frozen linear's input is kept only
  where the gradient needs it, and each adapted linear keeps a float32 copy of its input for the float32 adapter);
* transient: FSDP2's gathered weights in ``model.dtype`` (the block computing and the next one prefetched; the
  whole model with ``reshard_after_forward: false``), or autocast's ``model.dtype`` copies of float32 master
  weights without sharding.

A phase's peak is the sum of what is live in it: the update (resident parts + grads + activations + transient),
the rollout (resident parts + the larger of a no-grad forward's working set, 10·s·h·2 bytes per row, with the
transient weights, and the decode), the encoding (resident + the text encoders whole) and the scoring (resident +
the reward models). Beside these steady-state parts the plan counts what a rank holds at start-up, at a save and
at the final export, in host memory (rank 0, each other rank, the node of rank 0) and on the device
(:func:`stages`). A plan *fits* a GPU of M GiB when the largest peak stays under 0.95·M (the rest for the CUDA
context, NCCL buffers and the caching allocator's fragmentation). The model is an estimate to ±20 %
(``tests/test_plan.py`` compares it with a measured peak); a real run logs ``memory/<phase>_peak_gb``.

With ``runtime.engine: ray`` the plan adds each rollout worker's GPU (:func:`rollout_worker`: the whole policy on
one process, never sharded; docs/async.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from flowgrpo.memory_plan.families import (
    FAMILIES,
    PRETRAINED,
    REWARD_MODELS,
    Family,
    Sizes,
    attention_heads,
    lora_kinds,
    parameter_count,
    sizes,
)

GIB = 2**30
#: usable fraction of a GPU's memory (the rest: CUDA context, NCCL buffers, allocator fragmentation)
USABLE = 0.95
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """How N processes are arranged: ``replicate`` × ``shard`` × ``context`` = ``gpus``; ``fsdp`` ranks share one
    copy of what FSDP2 shards (shard × context; 1 without sharding), ``data`` ranks split the samples
    (gpus / context)."""

    gpus: int
    replicate: int
    shard: int
    context: int
    fsdp: int
    data: int


def layout(gpus: int, replicate: int = 1, context: int = 1, sharding: str = "fsdp2") -> Layout:
    """The :class:`Layout` of ``gpus`` processes. Raises ``ValueError`` when replicate × context does not divide
    ``gpus`` or a value is below 1."""
    for name, v in (("gpus", gpus), ("parallel.replicate", replicate), ("parallel.context_degree", context)):
        if v < 1:
            raise ValueError(f"{name}={v} must be at least 1")
    if gpus % (replicate * context):
        raise ValueError(f"--gpus {gpus} is not a multiple of parallel.replicate × parallel.context_degree = "
                         f"{replicate} × {context}: the world is replicate × shard × context processes")
    shard = gpus // (replicate * context)
    return Layout(gpus, replicate, shard, context, shard * context if sharding == "fsdp2" else 1, gpus // context)


@dataclass(frozen=True)
class Workload:
    """What one run asks of each GPU, read from a config (:func:`workload_of`) or written out.

    Sizes in pixels and tokens; ``rewards``: (parameters, bytes per parameter) of each reward model; the
    placement fields are the ``parallel`` settings of the same names."""

    family: str
    finetune: str  # lora | full
    dtype: str
    height: int
    width: int
    frames: int
    max_sequence_length: int
    train_rows: int
    rollout_rows: int
    samples: int  # trajectories per epoch over all processes
    steps: int
    gradient_checkpointing: bool
    guidance_scale: float = 1.0
    train_guidance_scale: float | None = None  # the training forwards' (forward-process objectives), else the above
    cfg_detach_uncond: bool = False
    lora_rank: int = 64
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    reference_copy: bool = False  # the objective forwards the frozen reference (Objective.needs_reference)
    old_copy: bool = False  # the objective keeps a float32 old copy of the trained weights (uses_old_copy)
    teacher: bool = False  # the objective loads a whole frozen teacher transformer (frozen_teacher)
    fake_score: bool = False  # the objective trains a whole copy of the teacher (trains_teacher_copy)
    surrogate: bool = False  # TDM-R1's surrogate: another trained copy and its frozen slow copy (surrogate_copies)
    lora_copies: bool = False  # under LoRA fine-tuning the trained copies are LoRA adapters on the teacher
    ema: bool = False
    latents_on_cpu: bool = False
    rewards: tuple[tuple[int, int], ...] = ()
    sharding: str = "none"
    replicate: int = 1
    context_degree: int = 1
    reshard_after_forward: bool = True
    offload: str = "none"
    reference: str = "device"
    ema_place: str = "device"
    text_encoders: str = "device"
    experts: str = "device"
    reward_models: str = "device"
    gradient_sync: str = "micro_batch"
    rollout_workers: int = 0  # runtime.engine=ray: the rollout workers (runtime.rollout_workers); 0 on torchrun


#: parts in the order they are printed
PARTS = ("weights", "masters", "grads", "optimizer", "reference", "ema", "old_copy", "teacher", "fake_score",
         "surrogate", "other_expert", "text_encoders", "reward_models", "vae", "rollout_latents", "activations",
         "transient", "decode")
LABELS = {"weights": "frozen weights", "masters": "trained weights (float32 masters)", "grads": "gradients",
          "optimizer": "optimizer (AdamW)", "reference": "KL reference", "ema": "EMA",
          "old_copy": "old copy (float32)", "teacher": "teacher (frozen)",
          "fake_score": "fake score (trained copy, gradients, AdamW)",
          "surrogate": "surrogate reward (trained copy, AdamW; slow copy)",
          "other_expert": "other expert (frozen)", "text_encoders": "text encoders", "reward_models": "reward models",
          "vae": "VAE", "rollout_latents": "rollout latents", "activations": "activations",
          "transient": "gathered weights", "decode": "VAE decode"}


#: the run's stages whose host and device holdings the plan counts (:func:`stages`)
STAGES = ("start-up", "steady state", "save", "export")
#: DCP's ``FileSystemWriter`` copies a rank's tensors to host memory at most this many bytes ahead of writing them
#: (its ``per_thread_copy_ahead`` default)
DCP_COPY_AHEAD = 10_000_000
#: diffusers' ``save_pretrained`` default ``max_shard_size`` ("10GB"): safetensors builds one file's bytes in memory
EXPORT_FILE = 10 * 10**9
#: assumed host memory of one node, GiB (about the 2 TB of a DGX H100-class 8-GPU node): a note, not a verdict
HOST_GIB = 1800.0


@dataclass(frozen=True)
class Stage:
    """Bytes one rank holds at a stage of the run: ``device`` on each GPU (its peak), ``rank0`` in the main
    process's host memory, ``other`` in each other rank's."""

    device: float
    rank0: float
    other: float

    def node(self, ranks: int) -> float:
        """Host bytes of the node that holds rank 0 and ``ranks`` − 1 others (a node without rank 0: ``ranks`` ×
        ``other``)."""
        return self.rank0 + (ranks - 1) * self.other


@dataclass(frozen=True)
class Plan:
    """Bytes on each GPU and in each rank's host memory, by part (:data:`PARTS`), and each phase's device peak.

    ``activations_plain`` / ``activations_checkpointed``: the training forward's activations without and with
    gradient checkpointing (``device["activations"]`` is the config's); ``budget``: usable bytes of one GPU;
    ``stages``: each of :data:`STAGES`' :class:`Stage` (:func:`stages`); ``ranks_per_node``: processes on one
    node (the per-node host figures); ``host_budget``: bytes of one node's host memory (notes only)."""

    workload: Workload
    layout: Layout
    device: dict[str, float]
    host: dict[str, float]
    phases: dict[str, float]
    activations_plain: float
    activations_checkpointed: float
    budget: float
    notes: tuple[str, ...] = field(default=())
    stages: dict[str, Stage] = field(default_factory=dict)
    ranks_per_node: int = 1
    host_budget: float = HOST_GIB * GIB
    worker: dict[str, float] = field(default_factory=dict)  # a rollout worker's GPU by part (runtime.engine=ray)

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def worker_peak(self) -> float:
        """A rollout worker's device peak (bytes; 0 without rollout workers): :func:`rollout_worker`'s parts."""
        if not self.worker:
            return 0.0
        held = sum(v for k, v in self.worker.items() if k not in ("sampling", "transient", "decode"))
        return held + max(self.worker["sampling"] + self.worker["transient"], self.worker["decode"])

    @property
    def fits(self) -> bool:
        """The training GPUs' peak and a rollout worker's both within :attr:`budget`."""
        return self.peak <= self.budget and self.worker_peak <= self.budget


def activation_bytes(fam: Family, image_tokens: int, text_tokens: int, checkpointing: bool) -> float:
    """Bytes one row of one training transformer call keeps for the backward (the module docstring's rule)."""
    per = [(k.count, (k.image * image_tokens + k.text * text_tokens) * fam.width) for k in fam.kinds]
    if not checkpointing:
        return sum(n * b for n, b in per)
    # each block keeps its input stream(s) in 16-bit; a cross-attention family's text is one shared tensor
    cross = fam.video and not fam.joint_text
    stream = image_tokens if cross else image_tokens + text_tokens
    inputs = sum(n for n, _ in per) * 2 * stream * fam.width + (2 * text_tokens * fam.width if cross else 0)
    return inputs + max(b for _, b in per)


def _held_parts(w: Workload, lay: Layout, s: Sizes) -> tuple[dict[str, float], dict[str, float]]:
    """(bytes on each GPU, bytes in each rank's host memory) by part of what stays held through training: the
    weights, their gradients and optimizer state, the frozen copies and modules (the module docstring's rules);
    the other parts 0. Raises ``ValueError`` for ``parallel.experts`` other than device on a one-transformer
    model."""
    fam, half, f = FAMILIES[w.family], BYTES[w.dtype], lay.fsdp
    group = lay.shard * lay.context  # what a `shard` placement divides by, whether the transformer is sharded or not
    full = w.finetune == "full"
    trained = s.transformer if full else s.lora
    frozen = 0 if full else s.transformer
    dev: dict[str, float] = dict.fromkeys(PARTS, 0.0)
    host: dict[str, float] = dict.fromkeys(PARTS, 0.0)
    off = "host" if w.offload == "cpu" else "dev"

    def put(part: str, where: str, value: float) -> None:
        (host if where == "host" else dev)[part] = value

    put("weights", off, frozen * half / f)
    put("masters", off, trained * 4 / f)
    if w.sharding == "fsdp2":  # gradient_sync step: whole unsharded gradients until the step's reduce-scatter
        put("grads", off, trained * 4 / (f if w.gradient_sync == "micro_batch" else 1))
    else:  # DDP over several processes keeps a second copy in its buckets
        put("grads", off, trained * 4 * (2 if lay.gpus > 1 else 1))
    put("optimizer", off, trained * 8 / f)
    if full and w.reference_copy:
        put("reference", "host" if w.reference == "cpu_offload" else "dev", s.transformer * half / f)
    if w.ema:
        put("ema", "host" if w.ema_place == "cpu" else "dev", trained * 4 / f)
    if w.old_copy:  # OldCopy: a float32 clone of each trained parameter as this rank holds it
        dev["old_copy"] = trained * 4 / f
    if w.teacher:  # load_teacher: the whole transformer, on the device
        dev["teacher"] = s.transformer * half
    copy = s.lora if (w.lora_copies and not full) else s.transformer  # a trained copy's own weights
    if w.fake_score:  # DMD2's fake score: float32 weights, gradients and AdamW's two moments, whole
        dev["fake_score"] = copy * 16
    if w.surrogate:  # TDM-R1's surrogate as the fake score (16 bytes a weight) and its float32 slow copy (4)
        dev["surrogate"] = copy * 20
    if fam.experts > 1:
        other = s.transformer * half
        put("other_expert", "host" if w.experts == "offload" else "dev",
            other / group if w.experts == "shard" else other)
    elif w.experts != "device":
        raise ValueError(f"parallel.experts={w.experts} places the untrained expert of a two-expert model; "
                         f"{fam.name} has one transformer: use parallel.experts=device")
    enc = s.encoders * half
    put("text_encoders", "host" if w.text_encoders == "offload" else "dev",
        enc / group if w.text_encoders == "shard" else enc)
    rew = sum(n * b for n, b in w.rewards)
    put("reward_models", "host" if w.reward_models == "offload" else "dev", rew)
    return dev, host


def plan(w: Workload, gpus: int, gpu_memory_gib: float = 80.0, s: Sizes | None = None,
         gpus_per_node: int | None = None, host_gib: float = HOST_GIB) -> Plan:
    """The :class:`Plan` of ``w`` on ``gpus`` processes with GPUs of ``gpu_memory_gib`` GiB, ``gpus_per_node``
    processes a node (default min(gpus, 8)) and ``host_gib`` GiB of host memory a node (the module docstring says
    what each part holds). Raises ``ValueError`` for a layout that does not divide ``gpus``, or a GPU memory,
    host memory or GPUs per node that is not positive."""
    for name, v in (("--gpu-memory-gib", gpu_memory_gib), ("--host-gib", host_gib), ("--gpus-per-node",
                                                                                       gpus_per_node or 1)):
        if v <= 0:
            raise ValueError(f"{name} {v} must be positive")
    lay = layout(gpus, w.replicate, w.context_degree, w.sharding)
    s = s or sizes(w.family, w.lora_rank if w.finetune == "lora" else 0, w.lora_targets)
    dev, host = _held_parts(w, lay, s)
    cfg_train, plain, ckpt = _working_parts(w, lay, s, dev, host)
    resident = sum(dev[k] for k in ("weights", "masters", "optimizer", "reference", "ema", "old_copy", "teacher",
                                    "fake_score", "surrogate", "other_expert", "vae", "rollout_latents",
                                    "text_encoders", "reward_models"))
    phases = _phases(w, lay, s, dev, resident)
    notes = _notes(w, lay, cfg_train)
    per_node = min(gpus, gpus_per_node or 8)
    held = stages(w, lay, s, dev, host, phases, resident)
    notes += _stage_notes(w, lay, s, held, per_node, host_gib)
    return Plan(w, lay, dev, host, phases, plain, ckpt, gpu_memory_gib * USABLE * GIB, tuple(notes), held,
                per_node, host_gib * GIB, rollout_worker(w, lay, s) if w.rollout_workers else {})


#: a rollout worker's parts as :func:`render` prints them, in order
WORKER_LABELS = {"weights": "policy weights (model.dtype)",
                 "masters": "trained weights, float32 (LoRA: the adapter; full: the masters)",
                 "text_encoders": "text encoders", "vae": "VAE", "rollout_latents": "rollout latents (one request)",
                 "transient": "compute-dtype copy of the masters", "sampling": "sampling forward (no grad)",
                 "decode": "VAE decode"}


def rollout_worker(w: Workload, lay: Layout, s: Sizes) -> dict[str, float]:
    """Bytes on one rollout worker's GPU by part (``runtime.engine: ray``; :mod:`flowgrpo.runtime.ray_engine`'s
    ``build_policy``): the whole pipeline on one process, never sharded, whatever ``parallel`` says. The
    policy's weights whole: LoRA's base in ``model.dtype`` with its float32 adapter; full fine-tuning's float32
    masters where ``model.dtype`` is 16-bit (the trainer's, so that a worker samples bit for bit as the trainer
    would), with autocast's ``model.dtype`` copy of them during a forward, else the weights in ``model.dtype``;
    the text encoders and the VAE whole in ``model.dtype``; the latents of one request (one data rank's share of
    an epoch, ``lay.data`` data ranks: a worker samples one request at a time), float32, (T + 1) a sample; and
    the larger of the no-grad sampling forward's working set (a micro-batch of ``train.rollout_batch_size``
    rows, 10·s·h·2 bytes a row, no context split) and the decode's. No optimizer, gradients, reference, EMA, old
    copy, teacher or reward model: those stay in the training processes."""
    fam, half, full = FAMILIES[w.family], BYTES[w.dtype], w.finetune == "full"
    masters = full and half < 4
    img, txt = fam.tokens(w.height, w.width, w.frames), fam.text_tokens(w.max_sequence_length)
    cfg = 2 if (fam.true_cfg and w.guidance_scale > 1) or fam.guided_rows else 1
    latents = math.ceil(w.samples / lay.data) * (w.steps + 1) * fam.latent(w.height, w.width, w.frames) * 4
    return {"weights": 0.0 if masters else s.transformer * half,
            "masters": s.transformer * 4 if masters else (0.0 if full else s.lora * 4),
            "transient": s.transformer * half if masters else 0.0,
            "text_encoders": s.encoders * half, "vae": s.vae * half, "rollout_latents": latents,
            "sampling": 10 * (img + txt) * fam.width * 2 * w.rollout_rows * cfg,
            "decode": 3 * fam.decode_width * w.height * w.width * 2 * min(w.frames, fam.decode_frames)
            * w.rollout_rows}


def _working_parts(w: Workload, lay: Layout, s: Sizes, dev: dict[str, float],
                   host: dict[str, float]) -> tuple[int, float, float]:
    """Fill ``dev`` and ``host`` (bytes by part, :func:`_held_parts`' dicts, in place) with what the phases work
    on: the VAE and its decode, the rollout latents, the training forward's activations and FSDP2's gathered
    weights (the module docstring's rules). Returns (rows of a training call per sample, activation bytes without
    and with gradient checkpointing)."""
    fam, half, full = FAMILIES[w.family], BYTES[w.dtype], w.finetune == "full"
    img = fam.tokens(w.height, w.width, w.frames)
    txt = fam.text_tokens(w.max_sequence_length)
    train_scale = w.guidance_scale if w.train_guidance_scale is None else w.train_guidance_scale
    cfg_train = fam.guided_rows or (2 if fam.true_cfg and train_scale > 1 and not w.cfg_detach_uncond else 1)
    dev["vae"] = s.vae * half
    dev["decode"] = 3 * fam.decode_width * w.height * w.width * 2 * min(w.frames, fam.decode_frames) * w.rollout_rows
    latents = math.ceil(w.samples / lay.data) * (w.steps + 1) * fam.latent(w.height, w.width, w.frames) * 4
    (host if w.latents_on_cpu else dev)["rollout_latents"] = latents
    rows = w.train_rows * cfg_train / lay.context
    counted = fam if full else dataclasses.replace(fam, kinds=lora_kinds(w.family, w.lora_rank, w.lora_targets))
    plain = activation_bytes(counted, img, txt, False) * rows
    ckpt = activation_bytes(counted, img, txt, True) * rows
    dev["activations"] = ckpt if w.gradient_checkpointing else plain
    if w.sharding == "fsdp2":
        dev["transient"] = 2 * s.largest_block * half if w.reshard_after_forward else s.transformer * half
    else:
        dev["transient"] = s.transformer * half if full and half < 4 else 0
    return cfg_train, plain, ckpt


def _phases(w: Workload, lay: Layout, s: Sizes, dev: dict[str, float], resident: float) -> dict[str, float]:
    """Each phase's device peak (bytes): what is ``resident`` plus what the phase works on (``dev``, by part)."""
    fam, half, full = FAMILIES[w.family], BYTES[w.dtype], w.finetune == "full"
    img = fam.tokens(w.height, w.width, w.frames)
    txt = fam.text_tokens(w.max_sequence_length)
    cfg = 2 if (fam.true_cfg and w.guidance_scale > 1) or fam.guided_rows else 1  # rows of one rollout call
    block = 2 * s.largest_block * half
    # offloaded weights stream through the device a block at a time (the reference's shards gathered by FSDP2 with
    # the next block prefetched; the offloaded expert's blocks copied one by one)
    streamed = (block if full and w.reference_copy and w.reference == "cpu_offload" else 0) + (
        block / 2 if w.experts == "offload" and fam.experts > 1 else 0)
    working = 10 * (img + txt) * fam.width * 2 * w.rollout_rows * cfg / lay.context
    enc, rew = s.encoders * half, sum(n * b for n, b in w.rewards)
    return {"update": resident + dev["grads"] + dev["activations"] + dev["transient"] + streamed,
            "rollout": resident + max(working + dev["transient"] + streamed, dev["decode"]),
            "encode": resident - dev["text_encoders"] + enc,
            "score": resident - dev["reward_models"] + rew}


def _notes(w: Workload, lay: Layout, cfg_train: int) -> list[str]:
    """The plan's notes on the batch split and on guidance rows trained with gradient."""
    fam = FAMILIES[w.family]
    notes = []
    per_rank = w.samples / lay.data
    if per_rank != int(per_rank) or int(per_rank) % w.rollout_rows:
        notes.append(f"{w.samples} samples over {lay.data} data ranks is {per_rank:g} a rank, not a multiple of "
                     f"train.rollout_batch_size={w.rollout_rows}: raise train.prompts_per_epoch")
    if fam.guided_rows:
        notes.append(f"{fam.name}'s guidance: the training forward runs {fam.guided_rows} rows a sample with "
                     f"gradient (activations × {fam.guided_rows})")
    elif cfg_train > 1:
        notes.append("true CFG: the training forward runs both branches with gradient (activations × 2)")
    return notes


def stages(w: Workload, lay: Layout, s: Sizes, dev: dict[str, float], host: dict[str, float],
           phases: dict[str, float], resident: float) -> dict[str, Stage]:
    """What a rank holds at each of :data:`STAGES` (:class:`Stage`; bytes), from the parts of :func:`plan`.

    * start-up: what the loaders put in host memory, summed as if all were held at once (an upper bound: the
      pipeline's modules are read into host memory before they move, the reward models and OPD's teacher after):
      the frozen modules each rank loads whole (text encoders, VAE, every reward model, Wan2.2's untrained
      expert, OPD's teacher) and the transformer as the loader holds it in ``model.dtype``: under ``fsdp2`` on
      several processes, full fine-tuning builds it on the meta device and each rank reads only its shard from
      the safetensors files (one tensor at a time beyond it: the streamed start-up; before it, rank 0 read the
      whole transformer and scattered it), a LoRA's base is read whole by rank 0 alone and its shards
      scattered; without sharding (or on one process) every rank reads it whole. Full fine-tuning's
      reference copy is made the same way. Device: the resident parts but AdamW's moments (made at the first
      step) and the rollout latents.
    * steady state: the device peak of the phases and the host parts of :func:`plan`, the same on every rank.
    * save: under ``fsdp2`` torch's distributed checkpoint writes each rank's shards, copying to host memory at
      most :data:`DCP_COPY_AHEAD` bytes ahead plus one tensor (bounded by the largest block's float32 shard);
      without sharding rank 0 gathers the whole float32 trained weights, AdamW's two moments, the EMA and the
      old copy.
    * export (the run's final weights): the transformer is written one file at a time
      (:func:`~flowgrpo.checkpoints.state_dicts.export_transformer`): rank 0 holds one file's tensors in ``model.dtype``
      (diffusers' files of at most 10 GB) and the float32 tensor being gathered, every other rank that tensor
      (bounded by the largest block); a LoRA: its float32 adapter and its file on rank 0. On the device one
      gathered tensor in float32 (bounded by a block).

    Save and export keep the steady host parts (rollout latents included: an upper bound)."""
    half, full, fam = BYTES[w.dtype], w.finetune == "full", FAMILIES[w.family]
    whole = s.transformer * half
    if w.sharding == "fsdp2" and lay.gpus > 1:
        loaded0, loaded = (whole / lay.fsdp, whole / lay.fsdp) if full else (whole, 0.0)
    else:
        loaded0 = loaded = whole
    copies = 2 if full and w.reference_copy else 1
    # a sharded untrained expert is built empty on several processes and each reads its own shards
    expert = (whole / lay.fsdp if w.experts == "shard" and lay.gpus > 1 else whole) if fam.experts > 1 else 0
    frozen = (expert + (s.encoders + s.vae) * half + sum(n * b for n, b in w.rewards)
              + (whole if w.teacher else 0))
    steady = sum(host.values())
    out = {"start-up": Stage(resident - dev["optimizer"] - dev["rollout_latents"], frozen + copies * loaded0,
                             frozen + copies * loaded),
           "steady state": Stage(max(phases.values()), steady, steady)}
    trained = s.transformer if full else s.lora
    if w.sharding == "fsdp2":
        staged = steady + DCP_COPY_AHEAD + s.largest_block * 4 / lay.fsdp
        out["save"] = Stage(resident, staged, staged)
    else:
        out["save"] = Stage(resident, steady + trained * 4 * (3 + w.ema + w.old_copy), steady)
    if full:  # one file of model.dtype tensors and the float32 tensor being gathered (at most a block)
        gathered, each = min(EXPORT_FILE, whole) + s.largest_block * 4, s.largest_block * 4
    else:
        gathered, each = 2 * s.lora * 4, 0.0
    out["export"] = Stage(resident + s.largest_block * 4, steady + gathered, steady + each)
    return out


def _stage_notes(w: Workload, lay: Layout, s: Sizes, held: dict[str, Stage], per_node: int,
                 host_gib: float) -> list[str]:
    """The notes on the stages: LoRA's whole base on rank 0 at start-up, a node's host memory above
    ``host_gib``."""
    notes = []
    if w.sharding == "fsdp2" and lay.gpus > 1 and w.finetune == "lora":
        base = _gib(s.transformer * BYTES[w.dtype])
        notes.append(f"LoRA under fsdp2: rank 0 reads the whole base transformer ({base} GiB) at start-up "
                     "and scatters its shards; the other ranks read none of it")
    worst = max(held, key=lambda k: held[k].node(per_node))
    top = held[worst].node(per_node)
    if top > host_gib * GIB:
        notes.append(f"the node of rank 0 holds {_gib(top)} GiB of host memory at {worst} ({per_node} ranks), "
                     f"above the {host_gib:g} GiB assumed a node (--host-gib)")
    return notes


def _reward_sizes(specs) -> tuple[tuple[int, int], ...]:
    """(parameters, bytes per parameter) of each reward model the config loads (a video reward's image base
    counts; rewards without a model, such as JPEG size, count 0)."""
    out = []
    for spec in specs:
        name, kwargs = spec.name, dict(spec.kwargs)
        if name in ("video_frames", "temporal_consistency", "i2v_consistency") and "base" in kwargs:
            name, kwargs = kwargs["base"], dict(kwargs.get("base_kwargs") or {})
        if name not in REWARD_MODELS:
            continue
        build, width = REWARD_MODELS[name]
        width = BYTES.get(kwargs.get("dtype", ""), width)
        out.append((parameter_count(build), width))
    return tuple(out)


def _objective_of(config):
    """(the run's objective, built from ``config`` as preflight builds it; trajectories one requested sample
    becomes). The objective answers what it keeps (``needs_reference``, ``uses_old_copy``, ``frozen_teacher``) and
    its trajectories per sample on a σ grid: here the grid linspace(1, 0, T + 1) shifted by ``model.scheduler_shift``
    (σ' = k·σ / (1 + (k − 1)·σ); unshifted when unset), an assumption where the model's own scheduler moves it
    otherwise (a resolution-dependent shift). Raises ``ValueError`` from the objective's checks on that grid."""
    import torch

    from flowgrpo.algo.objectives import build_objective

    objective = build_objective(config)
    k = config.model.scheduler_shift or 1.0
    s = torch.linspace(1, 0, config.sampling.num_steps + 1, dtype=torch.float64)
    grid = (k * s / (1 + (k - 1) * s)).float()
    return objective, objective.trajectories_per_sample(grid, config.sampling)


def workload_of(config) -> Workload:
    """The :class:`Workload` of a loaded config. Raises ``ValueError`` naming ``model.pretrained`` when its model
    is an embedded one (digits, tiny: nothing to plan) or not one of
    :data:`~flowgrpo.memory_plan.families.PRETRAINED`."""
    m, t, p = config.model, config.train, config.parallel
    from flowgrpo.models import EMBEDDED_MODELS

    if m.pretrained in EMBEDDED_MODELS:
        raise ValueError(f"model.pretrained={m.pretrained!r} is an embedded model (a few MB, built on the CPU): it "
                         "needs no memory plan and runs on one process; the plan is for the released models "
                         "(flowgrpo plan configs/flux_grpo.yaml --gpus 8)")
    if m.pretrained not in PRETRAINED:
        raise ValueError(f"model.pretrained={m.pretrained!r} is not in the plan; planned models: "
                         f"{', '.join(sorted(PRETRAINED))}")
    family = PRETRAINED[m.pretrained]
    fam = FAMILIES[family]
    objective, per_sample = _objective_of(config)
    samples = config.batch_size * per_sample
    specs = list(config.rewards) + list(config.eval_rewards or [])
    unique = list({(s.name, repr(sorted(s.kwargs.items()))): s for s in specs}.values())
    return Workload(
        family=family, finetune=m.finetune, dtype=m.dtype, height=m.height or 1024, width=m.width or 1024,
        frames=(m.num_frames or 81) if fam.video else 1, max_sequence_length=m.max_sequence_length,
        train_rows=config.train_batch_size, rollout_rows=t.rollout_batch_size, samples=samples,
        steps=config.sampling.num_steps, gradient_checkpointing=m.gradient_checkpointing,
        guidance_scale=config.sampling.guidance_scale,
        train_guidance_scale=getattr(config.objective, "train_guidance_scale", None),
        cfg_detach_uncond=m.cfg_detach_uncond,
        lora_rank=m.lora_rank, lora_targets=tuple(m.lora_target_modules),
        reference_copy=bool(objective.needs_reference), old_copy=bool(getattr(objective, "uses_old_copy", False)),
        teacher=bool(getattr(objective, "frozen_teacher", False)),
        fake_score=bool(getattr(objective, "trains_teacher_copy", False)),
        surrogate=bool(getattr(objective, "surrogate_copies", False)),
        lora_copies=bool(getattr(objective, "lora_copies", False)), ema=t.ema_decay is not None,
        latents_on_cpu=t.latents_on_cpu, rewards=_reward_sizes(unique),
        sharding=p.sharding, replicate=p.replicate, context_degree=p.context_degree,
        reshard_after_forward=p.reshard_after_forward, offload=p.offload, reference=p.reference, ema_place=p.ema,
        text_encoders=p.text_encoders, experts=p.experts, reward_models=p.reward_models,
        gradient_sync=p.gradient_sync,
        rollout_workers=config.runtime.rollout_workers if config.runtime.engine == "ray" else 0)


def plan_config(path, gpus: int, gpu_memory_gib: float = 80.0, overrides: list[str] = (),
                gpus_per_node: int | None = None, host_gib: float = HOST_GIB) -> Plan:
    """The :class:`Plan` of the config at ``path`` (with ``key=value`` ``overrides``) on ``gpus`` GPUs
    (:func:`plan`'s other arguments).

    Raises:
        ValueError: a model outside the plan, a layout that does not divide ``gpus``, a batch the trainer would
            not split over ``gpus`` processes (:func:`flowgrpo.preflight.check_batch`, the trainer's own check),
            a context degree that does not divide the model's attention heads (Ulysses) or an image's tokens
            (:func:`flowgrpo.distributed.context_parallel.check_split`, the trainer's own check), a bad GPU memory.
        flowgrpo.config.ConfigError: an invalid config or override.
    """
    from flowgrpo.config import load_config
    from flowgrpo.distributed.context_parallel import check_split
    from flowgrpo.preflight import check_batch

    config = load_config(path, list(overrides))
    work = workload_of(config)
    layout(gpus, work.replicate, work.context_degree, work.sharding)  # the mesh's refusal first
    fam = FAMILIES[work.family]
    tokens = (fam.tokens(work.height, work.width, work.frames),
              f"{work.height}x{work.width}" + (f"x{work.frames} frames" if fam.video else "") + f" of {fam.name}")
    try:
        check_batch(config, gpus)
        check_split(work.context_degree, config.parallel.context_attention, fam.name,
                    heads=attention_heads(work.family), tokens=tokens)
    except ValueError as err:
        raise ValueError(f"--gpus {gpus}: the run would not start: {err}") from err
    return plan(work, gpus, gpu_memory_gib, gpus_per_node=gpus_per_node, host_gib=host_gib)


def _gib(v: float) -> str:
    return f"{v / GIB:.1f}"


def _stage_table(p: Plan) -> str:
    """What a rank holds at each stage (:func:`stages`), GiB: on each GPU, in rank 0's host memory, in each other
    rank's, and on the node of rank 0."""
    n = p.ranks_per_node
    lines = [f"| stage | on each GPU (GiB) | host, rank 0 (GiB) | host, each other rank (GiB) | host, node of rank 0 "
             f"({n} rank{'s' * (n > 1)}, GiB) |", "|---|---|---|---|---|"]
    for name, st in p.stages.items():
        other = _gib(st.other) if p.layout.gpus > 1 else "–"
        lines.append(f"| {name} | {_gib(st.device)} | {_gib(st.rank0)} | {other} | {_gib(st.node(n))} |")
    return "\n".join(lines)


def render(p: Plan, title: str = "") -> str:
    """The plan as Markdown: the layout, a table of GiB per part on each GPU and in each rank's host memory, the
    phases' peaks, and whether it fits."""
    w, lay = p.workload, p.layout
    fam = FAMILIES[w.family]
    gpus = f"{lay.gpus} GPU{'s' * (lay.gpus > 1)}"
    if w.sharding == "fsdp2":
        mesh = (f"{gpus} = replicate {lay.replicate} × shard {lay.shard} × context {lay.context}; FSDP2 shards over "
                f"{lay.fsdp} ranks")
    else:  # no shard dimension to name: every GPU holds the whole model
        mesh = (f"{gpus}" + (f" = {lay.data} data × context {lay.context}" if lay.context > 1 else "")
                + "; no sharding (DDP: every GPU holds the whole model)")
    mesh += f", samples split over {lay.data} data ranks"
    img, txt = fam.tokens(w.height, w.width, w.frames), fam.text_tokens(w.max_sequence_length)
    size = f"{w.height}×{w.width}" + (f"×{w.frames} frames" if fam.video else "")
    lines = [f"### {title or fam.name}", "",
             f"{fam.name}, {w.finetune} fine-tuning, {w.dtype}, {size}: {img} image + {txt} text tokens; "
             f"{mesh}.", "",
             "| part | on each GPU (GiB) | host memory per rank (GiB) |", "|---|---|---|"]
    for part in PARTS:
        if part == "activations":
            chosen = "on" if w.gradient_checkpointing else "off"
            for label, v in (("off", p.activations_plain), ("on", p.activations_checkpointed)):
                mark = " (config)" if label == chosen else ""
                lines.append(f"| activations, checkpointing {label}{mark} | {_gib(v)} | 0.0 |")
            continue
        if p.device[part] or p.host[part]:
            lines.append(f"| {LABELS[part]} | {_gib(p.device[part])} | {_gib(p.host[part])} |")
    lines.append(f"| **host total** | | **{_gib(sum(p.host.values()))}** |")
    lines += ["", "| phase | device peak (GiB) |", "|---|---|"]
    lines += [f"| {k} | {_gib(v)} |" for k, v in p.phases.items()]
    lines += ["", _stage_table(p)]
    verdict = "fits" if p.peak <= p.budget else "does NOT fit"
    lines += ["", f"Peak {_gib(p.peak)} GiB of {_gib(p.budget)} usable ({p.budget / USABLE / GIB:.0f} GiB GPU): "
              f"**{verdict}**."]
    lines += [f"Note: {n}." for n in p.notes]
    if p.worker:
        lines += ["", _worker_table(p)]
    return "\n".join(lines)


def _worker_table(p: Plan) -> str:
    """A rollout worker's GPU (``runtime.engine: ray``; :func:`rollout_worker`), GiB, and whether it fits."""
    k = p.workload.rollout_workers
    lines = [f"Rollout workers (runtime.engine=ray): {k} Ray actor{'s' * (k > 1)}, each asking Ray for a GPU of its "
             f"own beyond the {p.layout.gpus} training GPU{'s' * (p.layout.gpus > 1)} ({p.layout.gpus + k} in all; "
             "on a GPU a training process also uses, the two peaks add) and holding the whole policy unsharded:",
             "",
             "| rollout worker part | on each worker GPU (GiB) |", "|---|---|"]
    lines += [f"| {WORKER_LABELS[part]} | {_gib(v)} |" for part, v in p.worker.items() if v]
    verdict = "fits" if p.worker_peak <= p.budget else "does NOT fit (a worker cannot shard: docs/async.md)"
    lines += [f"| **rollout worker peak** | **{_gib(p.worker_peak)}** |", "",
              f"Rollout worker peak {_gib(p.worker_peak)} GiB of {_gib(p.budget)} usable: **{verdict}**."]
    return "\n".join(lines)
