"""Model loading: a diffusers folder or hub id → the adapter of its pipeline class.

Adapters are registered by the pipeline class named in the folder's ``model_index.json``, or, for a diffusers
modular repository (blocks instead of a ``__call__``, :mod:`flowgrpo.models.modular`), in its
``modular_model_index.json``; the embedded models
(``digits``, ``tiny``) are built offline on first use and cached, then loaded through the same
``from_pretrained`` path as a real FLUX.1 folder.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from pathlib import Path

import torch

from flowgrpo.builds.cache_folder import build_once, cache_dir
from flowgrpo.models.attention import ATTENTION_BACKENDS
from flowgrpo.strategies.registry import Registry

logger = logging.getLogger(__name__)

ADAPTERS: Registry = Registry("pipeline class")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: The private diffusers helpers the adapters call (pipeline class → static methods), with their parameters.
#: They are not a stable API: ``tests/models/test_diffusers_private_api.py`` checks each one's presence, signature and
#: behaviour against an independent reshape, so a diffusers release that changes one fails a test by name.
DIFFUSERS_PRIVATE_API: dict[str, dict[str, tuple[str, ...]]] = {
    "FluxPipeline": {
        "_pack_latents": ("latents", "batch_size", "num_channels_latents", "height", "width"),
        "_unpack_latents": ("latents", "height", "width", "vae_scale_factor"),
        "_prepare_latent_image_ids": ("batch_size", "height", "width", "device", "dtype"),
    },
    "FluxKontextPipeline": {"_pack_latents": ("latents", "batch_size", "num_channels_latents", "height", "width")},
    "QwenImagePipeline": {
        "_pack_latents": ("latents", "batch_size", "num_channels_latents", "height", "width"),
        "_unpack_latents": ("latents", "height", "width", "vae_scale_factor"),
    },
    "QwenImageEditPlusPipeline": {
        "_pack_latents": ("latents", "batch_size", "num_channels_latents", "height", "width"),
    },
    "Flux2Pipeline": {"_pack_latents": ("latents",), "_unpatchify_latents": ("latents",),
                      "_prepare_latent_ids": ("latents",)},
    "Flux2KleinPipeline": {"_pack_latents": ("latents",), "_unpatchify_latents": ("latents",),
                           "_prepare_latent_ids": ("latents",)},
    "QwenImage21Pipeline": {
        "_pack_latents": ("latents", "batch_size", "num_channels_latents", "height", "width"),
        "_unpack_latents": ("latents", "height", "width", "vae_scale_factor"),
    },
}


@ADAPTERS.register("FluxPipeline")
def _flux(path: str, *, dtype, height, width, max_sequence_length, cfg_detach_uncond=False, empty_transformer=False):
    from diffusers import FluxPipeline

    from flowgrpo.models.empty import empty_components
    from flowgrpo.models.flux import FluxAdapter

    pipe = FluxPipeline.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    # the VAE's sample size is the model's native resolution (1024 for FLUX.1, 64 for the tiny model)
    size = int(pipe.vae.config.get("sample_size") or pipe.default_sample_size * pipe.vae_scale_factor)
    msl = min(max_sequence_length, pipe.tokenizer_2.model_max_length)
    return FluxAdapter(pipe, height=height or size, width=width or size, max_sequence_length=msl)


def _lazy_adapter(target: str, *args, takes_cfg_detach: bool = False):
    """An adapter loader ``(path, *, dtype, height, width, max_sequence_length, cfg_detach_uncond,
    empty_transformer)`` calling the family's ``module:function`` (imported on first use) with ``args`` after the
    path; ``cfg_detach_uncond`` is passed on only to families with true classifier-free guidance
    (``takes_cfg_detach``)."""
    module, name = target.split(":")

    def load(path: str, *, dtype, height, width, max_sequence_length, cfg_detach_uncond=False,
             empty_transformer=False):
        extra = {"cfg_detach_uncond": cfg_detach_uncond} if takes_cfg_detach else {}
        return getattr(importlib.import_module(module), name)(
            path, *args, dtype=dtype, height=height, width=width, max_sequence_length=max_sequence_length,
            empty_transformer=empty_transformer, **extra)

    return load


for _cls, _target, _args, _detach in (
    ("StableDiffusion3Pipeline", "flowgrpo.models.sd3:load_sd3_adapter", (), True),
    ("QwenImagePipeline", "flowgrpo.models.qwenimage:load_qwenimage_adapter", (), False),
    ("ZImagePipeline", "flowgrpo.models.zimage:load_zimage_adapter", (), False),
    ("Flux2KleinPipeline", "flowgrpo.models.flux2:load_flux2_adapter", ("Flux2KleinPipeline",), False),
    ("Flux2Pipeline", "flowgrpo.models.flux2:load_flux2_adapter", ("Flux2Pipeline",), False),
    ("FluxKontextPipeline", "flowgrpo.models.kontext:load_kontext_adapter", (), False),
    ("QwenImageEditPlusPipeline", "flowgrpo.models.qwenimage_edit:load_qwenimage_edit_plus_adapter", (), False),
    ("QwenImage21Pipeline", "flowgrpo.models.qwenimage21:load_qwenimage21_adapter", (), False),
    # modular repositories (modular_model_index.json)
    ("Flux3ModularPipeline", "flowgrpo.models.flux3:load_flux3_adapter", (), False),
    ("Flux3DistilledModularPipeline", "flowgrpo.models.flux3:load_flux3_adapter", (), False),
):
    ADAPTERS.register(_cls)(_lazy_adapter(_target, *_args, takes_cfg_detach=_detach))

#: Video pipelines (latents (B, C, F, h, w), decoded videos (B, F, 3, H, W)); their loaders also take
#: ``num_frames``, ``guidance_scale_2`` and ``trained_expert``.
#: the video families whose pipelines may hold two experts (Wan2.2 A14B), one of them untrained
TWO_EXPERT_FAMILIES = ("WanPipeline", "WanImageToVideoPipeline")
VIDEO_FAMILIES = {"WanPipeline": "flowgrpo.models.wan:load_wan_adapter",
                  "WanImageToVideoPipeline": "flowgrpo.models.wan_i2v:load_wan_i2v_adapter",
                  "HunyuanVideo15Pipeline": "flowgrpo.models.hunyuan_video15:load_hunyuan_video15_adapter",
                  "HunyuanVideo15ImageToVideoPipeline":
                      "flowgrpo.models.hunyuan_video15:load_hunyuan_video15_i2v_adapter",
                  "LTX2Pipeline": "flowgrpo.models.ltx2:load_ltx2_adapter",
                  "LTX2ImageToVideoPipeline": "flowgrpo.models.ltx2_i2v:load_ltx2_i2v_adapter"}


def _video_adapter(target: str):
    """The loader of a video family (:data:`VIDEO_FAMILIES`): ``module:function``, imported on first use."""
    module, name = target.split(":")

    def load(path: str, *, dtype, height, width, max_sequence_length, cfg_detach_uncond=False, **video):
        return getattr(importlib.import_module(module), name)(
            path, dtype=dtype, height=height, width=width, max_sequence_length=max_sequence_length, **video)

    return load


for _cls, _target in VIDEO_FAMILIES.items():
    ADAPTERS.register(_cls)(_video_adapter(_target))


def ensure_tiny_model() -> Path:
    """The random tiny FLUX pipeline, built into the cache on first use."""
    from flowgrpo.models.tiny import build_tiny_flux  # on first use: ``python -m flowgrpo.models.tiny`` runs it once

    return build_once(cache_dir() / "tiny-flux-v1", build_tiny_flux)


#: the embedded models: name -> ``module:function`` building (once, into the cache) and returning its folder;
#: a task's model lives in its task package, imported only when a run names it
EMBEDDED_MODELS = {"tiny": "flowgrpo.models:ensure_tiny_model",
                   "digits": "flowgrpo.tasks.digits.model:ensure_digits_model"}


def resolve_pretrained(name: str, *, progress: bool = True) -> str:
    """A local folder for the embedded names (:data:`EMBEDDED_MODELS`, built on first use; ``progress``: the
    build's progress bars, for a builder that shows any), else ``name`` unchanged (a folder or hub id)."""
    target = EMBEDDED_MODELS.get(name)
    if target is None:
        return name
    module, attr = target.split(":")
    build = getattr(importlib.import_module(module), attr)
    takes_progress = "progress" in inspect.signature(build).parameters
    return str(build(progress=progress) if takes_progress else build())


#: the index files naming a repository's pipeline class, in the order they are read: a regular pipeline's, then a
#: modular pipeline's (diffusers ``ModularPipeline``; a repository with both is read as the regular pipeline)
INDEX_FILES = ("model_index.json", "modular_model_index.json")


def pipeline_class_name(path: str) -> str:
    """The ``_class_name`` of a diffusers folder or hub repo (a local folder, the local hub cache, then the hub),
    from its ``model_index.json`` or, for a modular repository, its ``modular_model_index.json``.

    Raises:
        ValueError: naming the model when it cannot be read: a folder with neither index, or a hub id that is not
            cached and cannot be fetched. An unreachable hub fails at once (one connection attempt of a few
            seconds), not after huggingface_hub's retries; with ``HF_HUB_OFFLINE=1`` the hub is not tried at all.
    """
    local = Path(path)
    if local.is_dir():
        for name in INDEX_FILES:
            if (local / name).is_file():
                return json.loads((local / name).read_text())["_class_name"]
        raise ValueError(f"cannot read model {path!r}: the folder has neither model_index.json nor "
                         "modular_model_index.json (not a diffusers pipeline folder)")
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:  # not a hub id ('owner/name')
        raise ValueError(f"cannot read model {path!r}: no such folder (a local path; a hub id is 'owner/name')")
    from huggingface_hub import constants, hf_hub_download

    for name in INDEX_FILES:
        try:
            return _class_name(hf_hub_download(path, name, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the local cache (or not a valid id): try the next, then the hub
            pass
    hint = f"download it first (hf download {path}) or pass a local diffusers folder"
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"cannot read model {path!r}: not a local folder and not in the local hub cache, and "
                         f"HF_HUB_OFFLINE is set; {hint}") from None
    if not _reachable(constants.ENDPOINT):
        raise ValueError(f"cannot read model {path!r}: not a local folder, not in the local hub cache, and the hub "
                         f"({constants.ENDPOINT}) cannot be reached from this machine; {hint}") from None
    from huggingface_hub.errors import EntryNotFoundError

    try:
        try:
            return _class_name(hf_hub_download(path, INDEX_FILES[0]))
        except EntryNotFoundError:  # no regular index: a modular repository?
            return _class_name(hf_hub_download(path, INDEX_FILES[1]))
    except Exception as err:  # noqa: BLE001 - any failure to fetch the model is reported the same way
        raise ValueError(f"cannot read model {path!r} from the hub ({type(err).__name__}: {err}); {hint}") from err


def _class_name(index: str) -> str:
    return json.loads(Path(index).read_text())["_class_name"]


def _reachable(url: str, timeout: float = 5.0) -> bool:
    """Whether a TCP connection to ``url``'s host and port opens within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=timeout):
            return True
    except OSError:
        return False


def load_model(name: str, *, dtype: str = "float32", height: int | None = None, width: int | None = None,
               max_sequence_length: int = 512, cfg_detach_uncond: bool = False,
               scheduler_shift: float | None = None, attention_backend: str = "auto",
               num_frames: int | None = None, guidance_scale_2: float | None = None,
               trained_expert: str = "transformer", empty_transformer: bool = False,
               empty_other_expert: bool = False, progress: bool = True):
    """Load ``name`` (folder, hub id, ``digits`` or ``tiny``) and wrap it in the adapter of its pipeline class.
    ``progress``: progress bars while an embedded model is built on first use (``logging.progress``).

    ``cfg_detach_uncond`` applies to models with true classifier-free guidance (SD3); FLUX.1 has a guidance
    embedding instead and ignores it. ``scheduler_shift`` replaces the scheduler's shift by a static one
    (``FlowMatchEulerDiscreteScheduler(shift=s, use_dynamic_shifting=False)``, Esser et al. 2024 eq. 23).
    ``attention_backend`` names the SDPA kernels (:mod:`flowgrpo.models.attention`). ``num_frames``,
    ``guidance_scale_2`` and ``trained_expert`` are the video families' settings (:data:`VIDEO_FAMILIES`).
    ``empty_transformer``: the trained transformer is built with its parameters on the meta device and its weight
    files are not read (:mod:`flowgrpo.models.empty`; a sharded run's processes). ``empty_other_expert``: so is
    the untrained expert of a two-expert video model (``parallel.experts: shard``); ignored by other models.

    Raises:
        ValueError: an unknown dtype, or a video setting given for an image model."""
    ATTENTION_BACKENDS.get(attention_backend)
    if dtype not in DTYPES:
        raise ValueError(f"model dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = resolve_pretrained(name, progress=progress)
    cls = pipeline_class_name(path)
    video = {"num_frames": num_frames, "guidance_scale_2": guidance_scale_2, "trained_expert": trained_expert}
    if empty_other_expert and cls in TWO_EXPERT_FAMILIES:
        video["empty_other_expert"] = True
    kwargs = {"dtype": DTYPES[dtype], "height": height, "width": width, "max_sequence_length": max_sequence_length,
              "cfg_detach_uncond": cfg_detach_uncond, "empty_transformer": empty_transformer}
    if cls in VIDEO_FAMILIES:
        kwargs.update(video)
    else:
        given = [f"model.{k}" for k, v in video.items() if v is not None and v != "transformer"]
        if given:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to video models "
                             f"only; {name!r} is a {cls}, which makes images")
    adapter = ADAPTERS.get(cls)(path, **kwargs)
    if scheduler_shift is not None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        adapter.pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            adapter.pipe.scheduler.config, shift=float(scheduler_shift), use_dynamic_shifting=False
        )
    adapter.pipe.set_progress_bar_config(disable=True)
    adapter.attention_backend = attention_backend
    return adapter


def fetch_first(pretrained: str, local_main: bool) -> None:
    """A hub id's files fetched into the local cache by one process per machine before the others look: the
    machine's local main process downloads the pipeline's files (``DiffusionPipeline.download``: the components
    the pipeline loads, not a repository's other checkpoints), then every process meets at a barrier and loads
    from that cache. Without it every process of a machine downloaded the same tens of GB into the same cache at
    once. A collective on several processes; nothing on one process, or for an embedded name or a local folder.

    A download that fails is logged and left to the loading that follows, which reports it as it would have
    (raising here would leave the other processes in the barrier until the collective timeout).
    """
    from flowgrpo.distributed import dist

    if not dist.is_distributed() or pretrained in EMBEDDED_MODELS or Path(pretrained).exists():
        return  # one process loads as it always did
    if local_main:
        from diffusers import DiffusionPipeline

        try:
            DiffusionPipeline.download(pretrained)
        except Exception as err:  # noqa: BLE001 - reported by the loading that follows
            logger.warning("fetching %s before the other processes failed (%s: %s); each process loads it itself",
                           pretrained, type(err).__name__, err)
    dist.barrier()


def load_model_from_config(model, *, empty_transformer: bool = False, empty_other_expert: bool = False,
                           progress: bool = True) -> object:
    """The adapter a run's ``model`` section (:class:`~flowgrpo.config.ModelConfig`) describes: the one function
    training and ``flowgrpo sample --run`` both build the model with (so every setting, ``scheduler_shift``
    included, is honoured by both). ``empty_transformer``, ``empty_other_expert`` and ``progress``: as
    :func:`load_model`'s."""
    return load_model(model.pretrained, dtype=model.dtype, height=model.height, width=model.width,
                      max_sequence_length=model.max_sequence_length, cfg_detach_uncond=model.cfg_detach_uncond,
                      scheduler_shift=model.scheduler_shift, attention_backend=model.attention_backend,
                      num_frames=model.num_frames, guidance_scale_2=model.guidance_scale_2,
                      trained_expert=model.trained_expert, empty_transformer=empty_transformer,
                      empty_other_expert=empty_other_expert, progress=progress)
