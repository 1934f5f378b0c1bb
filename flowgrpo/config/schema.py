"""The schema of a training run: one typed section per concern, and :class:`Config`, which derives the batch
sizes and states each invariant across sections. YAML is only data; :mod:`flowgrpo.config.loading` reads it.

A *strategy section* (``objective``, within the SDE-ratio objective ``objective.chunker`` and
``objective.policy_loss``, and ``group_filter``) is validated against
the settings model of the strategy its ``name`` selects (:func:`~flowgrpo.strategies.settings.strategy_settings`); a
plain
name is shorthand for ``{name: ...}``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from flowgrpo.algo.advantages import ESTIMATORS
from flowgrpo.algo.chunkers import CHUNKERS
from flowgrpo.algo.filters import GROUP_FILTERS, GroupFilterConfig
from flowgrpo.algo.objectives import OBJECTIVES, ObjectiveConfig
from flowgrpo.sampling.config import EvalSamplingConfig, SamplingConfig
from flowgrpo.strategies.settings import Section, registered_name, strategy_settings


class CompileConfig(Section):
    """Regional compilation of the transformer's repeated blocks (flowgrpo.compile: diffusers'
    compile_repeated_blocks), shared by the rollout and the update."""

    name: Literal["none", "regional"] = Field(
        "none", description="none (eager) or regional (torch.compile each repeated transformer block in place)"
    )
    dynamic: bool | None = Field(
        None, description="torch.compile's dynamic: null (automatic: static first, one recompile with symbolic "
        "dimensions when a shape changes), true (symbolic from the start) or false (a recompile per new shape)"
    )
    backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="torch.compile backend (aot_eager and eager: for debugging a failure of inductor)"
    )
    mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        "default", description="inductor's mode (CUDA graphs are not offered: the rollout and update shapes vary)"
    )
    fullgraph: bool = Field(False, description="fail on a graph break inside a block instead of splitting it")


def _own_units(config) -> bool:
    """Whether the chosen objective cuts something other than the samples into micro-batches (DPO: its pairs,
    ``training_units``): the preflight checks its optimizer steps against those
    (:func:`flowgrpo.preflight.check_batch`)."""
    from flowgrpo.algo.objectives.base import BaseObjective

    cls = OBJECTIVES.get(config.objective.name)
    return getattr(cls, "training_units", BaseObjective.training_units) is not BaseObjective.training_units


#: the settings of ``model`` that only ``finetune: lora`` reads
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_target_modules")


def _override_text(value) -> str:
    """``value`` as the right-hand side of a ``key=value`` override (YAML flow style: a list as ``[a, b]``)."""
    return json.dumps(value) if isinstance(value, list) else repr(value)


class ModelConfig(Section):
    """Which model to train and how."""

    pretrained: str = Field(
        "digits",
        description="diffusers folder or hub id of a model whose pipeline class (its model_index.json's) has an "
        "adapter, or an embedded model, built and cached on first use ('tiny': random weights, for plumbing tests)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the transformer's forward (and of its frozen weights and of the final "
        "transformer folder); full fine-tuning keeps float32 master weights; SDE arithmetic is always float32"
    )
    height: int | None = Field(
        None, ge=1, description="image (or video frame) height in pixels (default, null: the pipeline's sample size)"
    )
    width: int | None = Field(
        None, ge=1, description="image (or video frame) width in pixels (default, null: the pipeline's sample size)"
    )
    max_sequence_length: int = Field(
        512, ge=1, le=4096, description="text-encoder tokens per prompt (FLUX.1 / SD3: T5, at most 512; Qwen-Image "
        "family: up to 1024); longer prompts are truncated with a warning"
    )
    finetune: Literal["lora", "full"] = Field("lora", description="train a LoRA adapter or all transformer weights")
    lora_rank: int = Field(8, ge=1, description="LoRA rank r")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale = alpha / r)")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        description="module names (peft target_modules) that receive LoRA",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    cache_prompt_embeddings: bool = Field(
        False, description="encode each distinct prompt once and keep its embeddings in host memory for every "
        "later rollout and evaluation (bit for bit the first encoding); with parallel.text_encoders=offload the "
        "encoders then reach the device only for a new prompt. Needs text_encoders device or offload"
    )
    prompt_embeddings_dir: str | None = Field(
        None, description="with cache_prompt_embeddings: also keep each prompt's embeddings in this folder (one "
        "safetensors file per prompt, under a digest of the encoder's identity), read by later or resumed runs"
    )
    attention_backend: Literal["auto", "flash", "efficient", "math", "cudnn"] = Field(
        "auto", description="SDPA kernels of the transformer in rollout and training (torch sdpa_kernel); 'auto' "
        "lets torch choose but never cuDNN on CUDA (its backward fails on some torch/cuDNN versions); 'math' "
        "always works",
    )
    scheduler_shift: float | None = Field(
        None, gt=0, description="static timestep shift s (sigma' = s*sigma/(1+(s-1)*sigma)) in place of the "
        "scheduler's own (FLUX: resolution-dependent); DanceGRPO and GCPO use 3 on FLUX.1-dev"
    )
    cfg_detach_uncond: bool = Field(
        False, description="SD3 true CFG: unconditional branch without gradient (its own no-grad forward)"
    )
    num_frames: int | None = Field(
        None, ge=1, description="video models only: frames per video, 1 + a multiple of the VAE's temporal "
        "factor (Wan: 4k + 1); default (null): the adapter's (Wan: 81); an image model refuses it"
    )
    guidance_scale_2: float | None = Field(
        None, gt=0, description="Wan2.2 two-expert models only: CFG scale of the low-noise expert "
        "(transformer_2); default (null): sampling.guidance_scale, as WanPipeline"
    )
    trained_expert: Literal["transformer", "transformer_2"] = Field(
        "transformer", description="Wan2.2 two-expert models: which expert gets the LoRA (or full fine-tuning): "
        "the high-noise 'transformer' or the low-noise 'transformer_2'; the other stays frozen"
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig, description="regional torch.compile of the transformer for the rollout and "
        "the update (one compiled forward path; flowgrpo.compile states the exactness contract)"
    )

    @model_validator(mode="after")
    def _check_lora(self) -> ModelConfig:
        """The ``lora_*`` settings are read only by ``finetune: lora``: one moved from its default with
        ``finetune: full`` is refused (``ValueError`` naming it, its default and the two ways out)."""
        if self.finetune == "full":
            for key in LORA_KEYS:
                value, default = getattr(self, key), type(self).model_fields[key].get_default(call_default_factory=True)
                if value != default:
                    raise ValueError(
                        f"model.{key}={value!r} is read only with model.finetune=lora, but model.finetune is 'full' "
                        f"(every weight trains, no adapter): remove the setting (its default is {default!r}: give "
                        f"model.{key}={_override_text(default)} to drop a config file's value) or set "
                        "model.finetune=lora")
        return self



EstimatorName = registered_name(ESTIMATORS, "advantage.name")


#: every top-level strategy section: its key → (the registry its ``name`` selects from, the settings every strategy
#: of the kind has); the SDE-ratio objective's own (``objective.chunker``, ``objective.policy_loss``) are its
#: settings' (:data:`flowgrpo.algo.objectives.sde_ratio.NESTED_SECTIONS`)
STRATEGY_SECTIONS = {
    "group_filter": (GROUP_FILTERS, GroupFilterConfig),
    "objective": (OBJECTIVES, ObjectiveConfig),
}


def strategy_section(key: str, value):
    """The strategy section ``key`` (of :data:`STRATEGY_SECTIONS`) validated from ``value`` (a name or a mapping)
    against the settings model of the strategy it names (:func:`flowgrpo.strategies.settings.strategy_settings`)."""
    registry, base = STRATEGY_SECTIONS[key]
    return strategy_settings(value, prefix=key, registry=registry, base=base)


#: the ``advantage.*`` std settings that GDPO's batch renormalisation reads whatever the estimator
#: (:func:`flowgrpo.algo.advantages.compute_advantages`, ``multi_reward: gdpo``)
GDPO_READS = ("std_ddof", "std_eps")


def _refuse_unread_knobs(adv: AdvantageConfig) -> None:
    """A setting moved from its default that the chosen advantage estimator does not read (its ``reads``; the
    std settings also under ``multi_reward: gdpo``) is an error naming the setting, its default, the estimators
    that read it and the selection; a plugin estimator that declares no ``reads`` may read any of them. Raises
    ``ValueError``: nothing is silently ignored. The way out is given as an override that puts the setting back at
    its default, which also clears a value a config file (the embedded default's ``std_eps``) sets."""
    chosen = ESTIMATORS.get(adv.name)
    if not hasattr(chosen, "reads"):
        return
    reads = set(chosen.reads) | (set(GDPO_READS) if adv.multi_reward == "gdpo" else set())
    knobs = sorted({k for n in ESTIMATORS for k in getattr(ESTIMATORS.get(n), "reads", ())})
    for key in knobs:
        value, default = getattr(adv, key), AdvantageConfig.model_fields[key].default
        owners = [n for n in ESTIMATORS if key in getattr(ESTIMATORS.get(n), "reads", ())]
        if key not in reads and value != default:
            gdpo = " or advantage.multi_reward=gdpo" if key in GDPO_READS else ""
            raise ValueError(
                f"advantage.{key}={value!r} is read only by advantage.name={' / '.join(owners)}{gdpo}, but "
                f"advantage.name is {adv.name!r}: remove the setting (its default is {default!r}: give "
                f"advantage.{key}={default!r} to drop a config file's value) or choose {' / '.join(owners)}{gdpo}")


class AdvantageConfig(Section):
    """The advantage estimator and its settings (``advantage:``; a plain name is shorthand for ``{name: ...}``),
    read by every objective that trains on the group advantages."""

    name: EstimatorName = Field("grpo", description="the advantage estimator "
                                "(flowgrpo.algo.advantages.ESTIMATORS)")
    global_std: bool = Field(False, description="grpo: divide by the batch's std instead of each group's")
    multi_reward: Literal["sum_then_normalize", "gdpo", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="several rewards: weighted sum first; gdpo (each normalised in its group, "
        "weighted sum, renormalised over the batch); or normalize_then_sum (gdpo without the batch renormalisation, "
        "MixGRPO's advantage_aggr)"
    )
    clip: float = Field(5.0, gt=0, description="advantages clipped to +-this")
    drop_zero_spread_groups: bool = Field(False, description="leave groups with equal rewards out of the update")
    min_learning_frac: float = Field(
        0.1, ge=0, le=1, description="warn (console and metric adv/low_signal) when the fraction of samples with a "
        "learning signal (valid reward, group with spread) falls below this; 0: never"
    )
    std_ddof: Literal[0, 1] = Field(
        0, description="delta degrees of freedom of the advantage std: 0 population (Flow-GRPO), 1 unbiased "
        "(DanceGRPO, MixGRPO, GCPO, E-GRPO, GDPO)"
    )
    std_eps: float = Field(
        1e-4, gt=0, description="added to the advantage std: 1e-4 (Flow-GRPO, GDPO) or 1e-8 (DanceGRPO family)"
    )

    @model_validator(mode="before")
    @classmethod
    def _a_name(cls, value):
        """A plain estimator name is shorthand for ``{name: ...}``."""
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> AdvantageConfig:
        _refuse_unread_knobs(self)
        return self


#: the largest seed numpy (and so accelerate's ``set_seed``) accepts
SEED_MAX = 2**32 - 1


class TrainConfig(Section):
    """The loop, batch sizes and optimiser."""

    num_epochs: int = Field(10, ge=1, description="epochs (rollout + update rounds)")
    prompts_per_epoch: int = Field(8, ge=1, description="P, prompts sampled per epoch (over all processes)")
    group_size: int = Field(4, ge=2, description="G, samples per prompt (a group needs G >= 2)")
    rollout_batch_size: int = Field(8, ge=1, description="trajectories per transformer call while sampling")
    train_batch_size: int | None = Field(
        None, ge=1, description="samples per training micro-batch, and the most transformer rows one training "
        "call holds (a micro-batch's chunks share calls up to it); default rollout_batch_size"
    )
    inner_epochs: int = Field(1, ge=1, description="passes over one rollout (passes after the first are off-policy)")
    optimizer_steps_per_epoch: int = Field(
        1, ge=1, description="optimizer steps per pass; each takes an equal share of the samples"
    )
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warmup, in optimizer steps")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="the learning rate over the epochs (times the warmup's factor): constant, as every "
        "release; or cosine (SGDR without restarts, Loshchilov & Hutter, arXiv 1608.03983, eq. 5), train.lr at the "
        "first epoch down to train.lr * lr_min_ratio after the last, one value per epoch"
    )
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the learning rate the schedule ends at, as a "
                                "fraction of train.lr")
    seed: int = Field(
        0, description="seed of every random draw (prompts, noise, chunk sampling), in 0..2**32-1 (numpy's range)"
    )
    latents_on_cpu: bool = Field(
        False, description="keep rollout latents in CPU memory between phases (moved to the device per micro-batch)"
    )
    ema_decay: float | None = Field(
        None, ge=0, lt=1, description="EMA of the trained weights (e.g. 0.9), used for evaluation and saving"
    )
    resume_from: str | None = Field(
        None, description="checkpoint folder, or a checkpoints root holding 'latest', to resume from"
    )

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed: int) -> int:
        """Raises ``ValueError`` naming ``train.seed`` for a seed outside 0..2**32-1 (numpy and accelerate's
        ``set_seed`` accept no other)."""
        if not 0 <= seed <= SEED_MAX:
            raise ValueError(f"train.seed={seed} is out of range: a seed must be an integer in 0..2**32-1 "
                             f"(0..{SEED_MAX})")
        return seed

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        """Raises ``ValueError`` for ``lr_min_ratio`` set with a schedule that does not read it."""
        if self.lr_schedule == "constant" and self.lr_min_ratio != 0.0:
            raise ValueError(f"train.lr_min_ratio={self.lr_min_ratio} is read only by train.lr_schedule=cosine, but "
                             "train.lr_schedule is 'constant': set train.lr_min_ratio=0 (or remove it) or set "
                             "train.lr_schedule=cosine")
        return self


class ParallelConfig(Section):
    """How the transformer is spread over the processes and where each pipeline part lives (docs/many_gpus.md)."""

    sharding: Literal["none", "fsdp2"] = Field(
        "none", description="none: every process holds the whole transformer (DDP over several processes); fsdp2: "
        "torch's fully_shard on each transformer block (the blocks the model names in _no_split_modules), with "
        "float32 master weights and model.dtype compute for full fine-tuning; any process count, one included"
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp2: free each block's gathered weights after its forward and gather them again for "
        "the backward (least memory); false keeps them until the backward (one all-gather less per block)"
    )
    reference: Literal["device", "cpu_offload"] = Field(
        "device", description="full fine-tuning with objective.kl_beta > 0: the frozen reference copy on the device "
        "(sharded like the policy under fsdp2), or its shards in host memory, gathered to the device per forward "
        "(cpu_offload; needs sharding fsdp2)"
    )
    ema: Literal["device", "cpu"] = Field(
        "device", description="train.ema_decay: where the EMA shadow (float32, each process's shard of it under "
        "fsdp2) lives: on the device, or in host memory (cpu: no device memory for it; each optimizer step copies "
        "the weights' shards to the host, each evaluation and final save copies the shadow to the device)"
    )
    text_encoders: Literal["device", "offload", "shard"] = Field(
        "device", description="device: text encoders stay on the device; offload: they live in host memory and "
        "move to the device only while prompts are encoded (once per rollout and evaluation); shard: FSDP2 over "
        "the processes of the mesh (each holds 1/N of every encoder block on its device, gathered block by block "
        "for each encoding; every process encodes in the same order)"
    )
    replicate: int = Field(
        1, ge=1, description="HSDP: the number of replica groups (typically nodes); the transformer is sharded "
        "within each group of world_size / replicate processes and replicated across groups (one all-reduce of "
        "the gradient shards per step crosses groups, every all-gather stays inside one). The world size must be "
        "a multiple of replicate x context_degree"
    )
    offload: Literal["none", "cpu"] = Field(
        "none", description="fsdp2: cpu keeps the trained parameters' shards, their gradients and the optimizer "
        "state in host memory (FSDP2 CPUOffloadPolicy; the optimizer steps on the CPU, each block is copied to "
        "the device for its forward and backward); none keeps them on the device"
    )
    experts: Literal["device", "offload", "shard"] = Field(
        "device", description="the untrained other expert of a two-expert model (Wan2.2 A14B transformer_2 or "
        "transformer): device: whole on every device; offload: whole in host memory on every process, each "
        "block copied to the device for its forward (no collective); shard: FSDP2 over the mesh on the device "
        "(1/N each, gathered block by block; every process runs it in the same order, as the rollout and the "
        "chunk plan do)"
    )
    reward_models: Literal["device", "offload"] = Field(
        "device", description="device: each reward's models stay on the device after setup; offload: they wait "
        "in host memory and move to the device only while a batch is scored (once per rollout batch and "
        "evaluation)"
    )
    gradient_sync: Literal["step", "micro_batch"] = Field(
        "micro_batch", description="when the gradients of an optimizer step's micro-batches (packs) are reduced "
        "over the processes: micro_batch after every pack's backward (fsdp2: reduce-scatter, so each process "
        "only ever holds its gradient shard; DDP: all-reduce), or step after the step's last pack only (one "
        "reduction per step, but fsdp2 then keeps whole unsharded float32 gradients of every trained "
        "parameter on each process until the step: 4 bytes a parameter, 48 GB for FLUX.1-dev full "
        "fine-tuning). The default spends communication (an optimizer step of k packs reduces k times) to keep "
        "fsdp2's memory; DDP holds whole gradients either way, so step costs it no memory (LoRA: little)"
    )
    context_degree: int = Field(
        1, ge=1, description="context (sequence) parallel degree: each transformer call's tokens are split over "
        "this many processes (diffusers' context parallelism, for the transformers with a _cp_plan: FLUX, "
        "FLUX.2, Qwen-Image, Wan); the processes of one context group share their samples, so the batch is "
        "split over world size / context_degree data ranks; needs sharding fsdp2 and a world size it divides"
    )
    collective_timeout_s: float = Field(
        3600.0, gt=0, description="seconds a process waits in a collective of the run's process group (a barrier, "
        "a broadcast) before the run is aborted: it must cover the work the main process does alone while the "
        "others wait (the final export, writing the weights and model card, hashing the base model). torch's "
        "default is 600 s for NCCL, which a 12B model's export on a shared file system can pass; a real hang "
        "is reported only after this long"
    )
    context_attention: Literal["ulysses", "ring"] = Field(
        "ulysses", description="context_degree > 1: ulysses (an all-to-all of the heads; the attention heads must "
        "divide by the degree) or ring (key/value blocks passed around; needs a CUDA flash kernel and "
        "bfloat16/float16 compute)"
    )

    @model_validator(mode="after")
    def _sharded_only(self) -> ParallelConfig:
        """The settings that only FSDP2 reads are refused without it (``ValueError``), each naming itself; so is
        a context attention without context parallelism."""
        if self.context_degree == 1 and self.context_attention != "ulysses":
            raise ValueError(f"parallel.context_attention={self.context_attention} is read only with "
                             "parallel.context_degree > 1: remove the setting, or set the degree")
        if self.sharding == "fsdp2":
            return self
        if self.replicate > 1:
            raise ValueError(f"parallel.replicate={self.replicate} (HSDP) replicates a sharded transformer across "
                             "groups, which needs parallel.sharding=fsdp2; or use parallel.replicate=1")
        if self.offload == "cpu":
            raise ValueError("parallel.offload=cpu keeps the trained parameters' shards in host memory, which needs "
                             "parallel.sharding=fsdp2; or use parallel.offload=none")
        if self.context_degree > 1:
            raise ValueError(f"parallel.context_degree={self.context_degree} splits each transformer call over "
                             "processes whose weights FSDP2 shards over the (shard, context) ranks: set "
                             "parallel.sharding=fsdp2, or parallel.context_degree=1")
        if self.reference == "cpu_offload":
            raise ValueError("parallel.reference=cpu_offload keeps the reference's shards in host memory, which needs "
                             "parallel.sharding=fsdp2 (any process count, one included); or use "
                             "parallel.reference=device")
        if not self.reshard_after_forward:
            raise ValueError("parallel.reshard_after_forward=false is read only with parallel.sharding=fsdp2 (it "
                             "keeps each block's gathered weights until the backward); without sharding nothing "
                             "is gathered: remove the setting, or set parallel.sharding=fsdp2")
        return self


class RuntimeConfig(Section):
    """Where the rollout runs (docs/async.md): in the training processes (``torchrun``, the default), or on Ray
    rollout workers that hold their own copy of the policy while the training processes train (``ray``)."""

    engine: Literal["torchrun", "ray"] = Field(
        "torchrun", description="torchrun: every training process samples its share of the rollout itself; ray: "
        "rollout workers (Ray actors) sample it from synced weights while the training processes (launched as "
        "ever) train; rank 0 drives Ray and hands each rank its share (docs/async.md)"
    )
    rollout_workers: int = Field(
        1, ge=1, description="ray: rollout workers (actors), each holding the policy; an epoch's per-rank shares "
        "and the epochs in flight (runtime.max_staleness) are spread over them"
    )
    max_staleness: int = Field(
        0, ge=0, description="ray: the most policy versions (epoch updates applied) a group may lag behind the "
        "policy it trains: 0 samples each epoch from the weights it trains (bit for bit the torchrun run); 1 samples "
        "epoch e+1 while epoch e trains (the rollout waits, no group is dropped)"
    )
    sync_every: int = Field(
        1, ge=1, description="ray: send the trained weights to the rollout workers every sync_every versions; an "
        "epoch sampled ahead waits for a sync when it would lag more than runtime.max_staleness, and the epoch about "
        "to train forces one"
    )
    address: str | None = Field(
        None, description="ray: the cluster to join (ray start --head's address, or auto); null: the RAY_ADDRESS "
        "environment variable, else a new Ray instance on this machine"
    )
    reward_workers: int = Field(
        0, ge=0, description="ray: reward workers (actors), each building the rewards once, that score each "
        "rollout's decoded images as soon as they are sampled (handed over by Ray, not through the trainer) while "
        "the next rollout runs; 0: the training processes score them (docs/async.md)"
    )

    @model_validator(mode="after")
    def _ray_only(self) -> RuntimeConfig:
        """The Ray settings are refused with ``engine: torchrun`` (``ValueError`` naming the first moved one)."""
        if self.engine == "ray":
            return self
        for key in ("rollout_workers", "max_staleness", "sync_every", "address", "reward_workers"):
            default = type(self).model_fields[key].default
            if getattr(self, key) != default:
                raise ValueError(f"runtime.{key}={getattr(self, key)!r} is read only with runtime.engine=ray: set "
                                 f"runtime.engine=ray, or remove the setting (default {default!r})")
        return self


class RewardSpec(Section):
    """One reward: a registered name (entry point) or 'module:attr', its weight and constructor kwargs."""

    name: str = Field(description="entry-point name in group flowgrpo.rewards, or 'module:attr'")
    weight: float = Field(
        1.0, description="weight w in the composed reward, the weighted sum Σ w·r (negative: a penalty)"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward")


class DataConfig(Section):
    """Prompt files: plain text (one prompt a line) or JSONL (a 'prompt' field plus metadata)."""

    train_prompts: str = Field("digits", description="prompt file (.txt: one prompt a line; .jsonl: a 'prompt' "
                               "field and metadata; flowgrpo prompts builds one from a public set), or an embedded "
                               "set")
    eval_prompts: str | None = Field(None, description="held-out prompt file (or embedded set) for periodic "
                                     "evaluation")
    eval_num_prompts: int = Field(200, ge=1, description="evaluation prompts (cycled with new seeds if fewer)")


class LoggingConfig(Section):
    """What is written where."""

    trackers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list, description="accelerate trackers")
    eval_every: int = Field(0, ge=0, description="evaluate every N epochs (0: only before and after)")
    save_every: int = Field(0, ge=0, description="checkpoint every N epochs (0: only at the end)")
    checkpoints_total_limit: int = Field(2, ge=1, description="newest healthy checkpoints kept")
    keep_best: bool = Field(
        True, description="keep the checkpoint with the best logging.best_metric out of the rotation (where the run "
        "evaluates: logging.eval_every > 0 and save_every on the same epochs)"
    )
    best_metric: str = Field(
        "auto", description="the evaluation figure (higher is better) of logging.keep_best and "
        "logging.collapse_fraction: an eval/... key of metrics.jsonl; auto: eval/<first optimised reward>/mean"
    )
    collapse_fraction: float = Field(
        0.2, ge=0, lt=1, description="warn when an evaluation's logging.best_metric falls more than this "
        "fraction below the run's best (0: never)"
    )
    overwrite: bool = Field(False, description="start a new run in an output_dir that holds an old one")
    progress: bool = Field(True, description="progress bars on the main process")
    plot_every: int = Field(
        1, ge=0, description="draw reward_curve.png and samples_latest.png every N epochs and after the last one "
        "(0: only after the last); matplotlib takes about half a second for the two"
    )
    save_rollout_stats: bool = Field(
        False, description="write each epoch's gathered rewards, advantages, group ids, initial noise (and the SDE "
        "rollout's log-probabilities) to "
        "rollouts/epoch_<N>.safetensors (for analysis and the multi-process equivalence test)"
    )
    x0_norm_window: int = Field(5, ge=1, description="epochs of the x0-norm drift warning's baseline (the run's "
                                "first) and recent (the last) means of rollout/x0_norm (flowgrpo.watch.x0_norm)")
    x0_norm_drift: float = Field(0.25, gt=0, description="warn once when the recent x0 norm leaves "
                                 "[baseline/(1+f), (1+f)*baseline] (DiffusionNFT #47: drifting up, images brighten)")


def strategy_problems(config) -> list[tuple[str, list[str]]]:
    """What :meth:`Config._derive` refuses through each strategy's checks of the run ``config`` against the other
    sections, as (what, problems), for ``--help`` (a config built with those checks off): the
    objective's :meth:`~flowgrpo.algo.objectives.base.ObjectiveConfig.problems` (one line each; the SDE-ratio
    objective's include its policy loss's), then the group filter's ``check`` (a ``ValueError``'s message); a
    strategy without problems is left out."""
    out = [(f"objective {config.objective.name!r} cannot run with this config", config.objective.problems(config))]
    try:
        config.group_filter.check(config)
    except ValueError as err:
        out.append((f"group_filter {config.group_filter.name!r} cannot run with this config", [str(err)]))
    return [(what, problems) for what, problems in out if problems]


def _cachers() -> tuple[str, str, str]:
    """The registered strategies a feature cache may run with, each as its settings say (their names joined for
    a message): (objectives whose rollout records no log-prob, objectives whose rollout is their chunker's,
    chunkers with ODE steps)."""
    configs = {n: OBJECTIVES.get(n).Config for n in OBJECTIVES}
    rollout = ", ".join(n for n, c in configs.items() if c.caches_rollout)
    chunked = ", ".join(n for n, c in configs.items() if c.rollout_by_chunker)
    steps = " and ".join(n for n in CHUNKERS if CHUNKERS.get(n).Config.caches_ode_steps)
    return rollout, chunked, steps


def check_cache_allowed(objective, cache_name: str, where: str = "sampling.cache", chunker=None) -> None:
    """Refuse a feature cache where a cached velocity would enter a log-prob; each strategy's settings answer
    for it, never its name. Allowed: an objective whose rollout records no log-prob (its config's
    ``caches_rollout``: ``nft``, ``awm``, ``dgpo``) and, on ODE steps only
    (:func:`~flowgrpo.sampling.feature_cache.ode_step_cache`), an objective
    whose rollout is its chunker's (``rollout_by_chunker``: ``sde_ratio``) with a chunker that has ODE steps (its
    config's ``caches_ode_steps``: ``window``, ``entropy_merge``) and a cache other than ``mag``; every other
    objective (``dpo``, ``dpo_offline``, ``sft``, ``refl``, ``opd``) is refused.

    Args:
        objective: the run's objective settings (an :class:`~flowgrpo.algo.objectives.ObjectiveConfig`).
        cache_name: the cache's name (``none``: no cache, always allowed).
        where: the setting named in the refusal.
        chunker: the run's chunker settings (a :class:`~flowgrpo.algo.chunkers.ChunkerConfig`), or None.

    Raises:
        ValueError: one line naming the reason.
    """
    if cache_name == "none" or objective.caches_rollout:
        return
    name = objective.name
    if not objective.rollout_by_chunker:  # no chunker: no ODE steps to cache (dpo, sft, refl, opd, …)
        rollout, chunked, steps = _cachers()
        raise ValueError(f"{where}={cache_name!r} is refused with objective.name={name!r}: caching is for the "
                         f"{rollout} rollouts (they record no log-prob and train on the final latent alone), the "
                         f"ODE steps of {chunked}'s {steps} chunkers, and eval_sampling.cache")
    chunker_name = None if chunker is None else chunker.name
    if chunker is None or not chunker.caches_ode_steps:
        rollout, _, steps = _cachers()
        raise ValueError(f"{where}={cache_name!r} is refused with objective.name={name!r} and chunker "
                         f"{chunker_name!r}: every step of its rollout is an SDE step whose velocity enters the "
                         "recorded log-probs (the importance ratio), so a cached velocity would bias the ratio; "
                         f"caching is for {rollout} rollouts, the ODE steps of the {steps} chunkers, and "
                         "eval_sampling.cache")
    if cache_name == "mag":
        raise ValueError(f"{where}=mag is refused with chunker {chunker_name!r}: the cache runs on each run of ODE "
                         "steps afresh, and mag maps its calibrated ratios by step index from the run's start; use "
                         "first_block, taylor_seer or faster")


class Config(Section):
    """A whole training run."""

    output_dir: str = Field("runs/default", description="run folder: config, metrics, images, weights")
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    eval_sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    objective: SerializeAsAny[ObjectiveConfig] = Field(
        default_factory=lambda: strategy_section("objective", {}),
        description="what the update optimises, and the objective's own "
        "settings (one section per objective; see flowgrpo.algo.objectives)"
    )
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    group_filter: SerializeAsAny[GroupFilterConfig] = Field(
        default_factory=lambda: strategy_section("group_filter", {}),
        description="which samples of each group enter the advantages, and the filter's own settings "
        "(flowgrpo.algo.filters; a plain name is shorthand for {name: ...})"
    )
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="digit_correctness")], description="rewards optimised"
    )
    eval_rewards: list[RewardSpec] = Field(
        default_factory=list, description="extra rewards scored at evaluation only (reward-hacking watch)"
    )
    data: DataConfig = Field(default_factory=DataConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("output_dir")
    @classmethod
    def _a_folder(cls, value: str) -> str:
        if not value.strip():  # '' would be the current folder: a run written over whatever is there
            raise ValueError(f"output_dir must name a folder for the run, got {value!r}")
        return value

    @field_validator("group_filter", "objective", mode="before")
    @classmethod
    def _strategy_sections(cls, value, info):
        return strategy_section(info.field_name, value)

    @model_validator(mode="after")
    def _derive(self, info: ValidationInfo) -> Config:
        checks = (info.context or {}).get("strategy_checks", True)  # --help marks their refusals instead
        why = OBJECTIVES.get(self.objective.name).rollout_workers_refusal
        if checks and self.runtime.engine == "ray" and why is not None:  # first: its own checks are moot off Ray
            raise ValueError(f"runtime.engine=ray cannot run objective {self.objective.name!r}: {why}; use "
                             "runtime.engine=torchrun")
        chunker, t = self._check_batches(), self.train
        if self.model.finetune == "full" and self.model.dtype == "float16":
            raise ValueError("model.dtype=float16 with model.finetune=full: the float32 master weights would "
                             "compute in float16 without loss scaling, whose gradients underflow; use bfloat16")
        if self.parallel.ema == "cpu" and t.ema_decay is None:
            raise ValueError("parallel.ema=cpu places the EMA of train.ema_decay, which is not set (no EMA is kept): "
                             "set train.ema_decay, or remove parallel.ema")
        par = self.parallel
        if par.context_degree > 1 and par.context_attention == "ring" and self.model.dtype == "float32":
            raise ValueError("parallel.context_attention=ring with model.dtype=float32: diffusers' ring attention "
                             "needs a flash kernel, which takes bfloat16 or float16; set model.dtype=bfloat16 or "
                             "use parallel.context_attention=ulysses")
        if self.model.compile.name != "none" and par.context_degree > 1:
            raise ValueError(f"model.compile={self.model.compile.name!r} with parallel.context_degree="
                             f"{par.context_degree}: compiling blocks under diffusers' context-parallel hooks is not "
                             "verified; set model.compile to none or parallel.context_degree to 1")
        if not all(0 <= beta < 1 for beta in t.adam_betas):
            raise ValueError(f"train.adam_betas must each be in [0, 1), got {list(t.adam_betas)}")
        if not self.rewards:
            raise ValueError("rewards: at least one reward is needed")
        check_cache_allowed(self.objective, self.sampling.cache.name,  # no cached velocity in a log-prob
                            chunker=chunker)
        if self.model.prompt_embeddings_dir is not None and not self.model.cache_prompt_embeddings:
            raise ValueError(f"model.prompt_embeddings_dir={self.model.prompt_embeddings_dir!r} is read only with "
                             "model.cache_prompt_embeddings=true; set it, or remove the folder setting")
        if checks:  # --help marks their refusals (strategy_problems)
            self.objective.check(self)  # each strategy's checks against the other sections (the policy loss's too)
            self.group_filter.check(self)
        if all(r.weight == 0 for r in self.rewards):
            raise ValueError("every reward in rewards has weight 0: the composed reward would be 0 and nothing "
                             "would be optimised; give at least one a weight")
        self._check_reward_lists()
        return self

    def _check_batches(self):
        """B = P·G against the rollout and training batch sizes and the optimizer steps (``ValueError`` naming the
        setting); returns the SDE-ratio objective's chunker settings, or None for an objective without one."""
        t = self.train
        b = t.prompts_per_epoch * t.group_size
        if b % t.rollout_batch_size:
            raise ValueError(
                f"train.rollout_batch_size={t.rollout_batch_size} must divide the batch "
                f"B = prompts_per_epoch*group_size = {b}"
            )
        tb = self.train_batch_size
        chunker = getattr(self.objective, "chunker", None)
        multiplies = chunker is not None and chunker.multiplies_batch
        if b % tb:
            more = (f" (chunker {chunker.name!r} trains each sample as one trajectory per branch step; "
                    "train_batch_size must divide the samples, so that every micro-batch holds whole groups)"
                    if multiplies else "")
            raise ValueError(f"train.train_batch_size={tb} must divide the batch B = prompts_per_epoch*group_size = "
                             f"{b}{more}")
        if (b // tb) % t.optimizer_steps_per_epoch and not multiplies and not _own_units(self):
            raise ValueError(
                f"train.optimizer_steps_per_epoch={t.optimizer_steps_per_epoch} must divide the number of "
                f"training micro-batches B / train_batch_size = {b // tb}"
            )
        return chunker

    def _check_reward_lists(self) -> None:
        """Each reward once, in ``rewards`` or ``eval_rewards`` (``ValueError`` naming the repeated ones)."""
        both = sorted({r.name for r in self.rewards} & {r.name for r in self.eval_rewards})
        if both:
            raise ValueError(f"rewards {both} are in both rewards and eval_rewards: a reward is either optimised "
                             "(rewards) or only scored at evaluation (eval_rewards)")
        names = [r.name for r in self.rewards + self.eval_rewards]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rewards: each reward may appear once (in rewards or eval_rewards), repeated: {dup}")

    @property
    def batch_size(self) -> int:
        """B = P·G, trajectories per epoch over all processes."""
        return self.train.prompts_per_epoch * self.train.group_size

    @property
    def train_batch_size(self) -> int:
        return self.train.train_batch_size or self.train.rollout_batch_size


