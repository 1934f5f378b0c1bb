"""Trainable parameters: a peft LoRA adapter on the transformer, or full fine-tuning with a frozen reference."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from flowgrpo.writing.outputs import save_tensors


def setup_trainable(adapter, *, finetune: str, rank: int, alpha: float, target_modules: list[str],
                    need_reference: bool, gradient_checkpointing: bool = False,
                    sharded: bool = False) -> list[torch.nn.Parameter]:
    """Make the adapter's transformer trainable; return the trained parameters.

    ``lora``: freeze the base weights and add a peft adapter (Hu et al., arXiv 2106.09685; scale α/r);
    the reference policy is the same module with the adapter disabled. ``full``: train every transformer
    weight; when ``need_reference`` (KL β > 0) a frozen copy serves as the reference: a deep copy, or with
    ``sharded`` (``parallel.sharding=fsdp2``) a copy of the module's structure and buffers whose parameters are
    on the meta device (:func:`structure_copy`: no memory), which :func:`flowgrpo.parallel.prepare_model`
    shards and fills from the policy's own shards, so no process ever holds a second whole transformer.

    Raises:
        ValueError: unknown ``finetune``, or target modules that match nothing in the transformer.
    """
    from peft import LoraConfig

    pipe = adapter.pipe
    for m in (pipe.vae, getattr(pipe, "text_encoder", None), getattr(pipe, "text_encoder_2", None),
              getattr(pipe, "text_encoder_3", None)):
        if m is not None:
            m.requires_grad_(False)
    tr = adapter.transformer
    if gradient_checkpointing:
        tr.enable_gradient_checkpointing()
    if finetune == "lora":
        tr.requires_grad_(False)
        names = {n.rsplit(".", 1)[-1] for n, _ in tr.named_modules()} | {n for n, _ in tr.named_modules()}
        if not any(t in names or any(n.endswith("." + t) for n in names) for t in target_modules):
            raise ValueError(f"LoRA target modules {target_modules} match no module of the transformer")
        tr.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                                  target_modules=list(target_modules)))
        return [p for p in tr.parameters() if p.requires_grad]
    if finetune == "full":
        if need_reference:
            ref = structure_copy(tr) if sharded else copy.deepcopy(tr)
            adapter.frozen_reference = ref.requires_grad_(False).eval()
        tr.requires_grad_(True)
        return list(tr.parameters())
    raise ValueError(f"finetune must be 'lora' or 'full', got {finetune!r}")


def structure_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` (submodules, settings, buffers) whose parameters are on the meta device (shapes
    and dtypes, no values, no memory)."""
    memo = {id(p): torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    return copy.deepcopy(module, memo)


def save_lora(adapter, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write the LoRA as ``pytorch_lora_weights.safetensors`` in the form ``Pipeline.load_lora_weights`` reads
    (with the adapter metadata, so α survives the round trip). A pipeline without a LoRA loader (diffusers 0.42's
    ``HunyuanVideo15Pipeline``) gets the transformer's own format instead (what ``save_lora_adapter`` writes),
    which ``pipe.transformer.load_lora_adapter(folder, prefix=None)`` reads (:func:`load_lora_into`).

    ``state``: the transformer's state by parameter name to take the adapter weights from (a sharded model's
    gathered whole tensors, :func:`flowgrpo.checkpoints.state_dicts.trainable_state`); default the transformer's own."""
    from peft.utils import get_peft_model_state_dict

    tr = adapter.transformer
    if not hasattr(type(adapter.pipe), "save_lora_weights"):
        _save_transformer_lora(tr, folder, get_peft_model_state_dict(tr, state_dict=state))
        return
    type(adapter.pipe).save_lora_weights(
        str(folder),
        transformer_lora_layers=get_peft_model_state_dict(tr, state_dict=state),
        transformer_lora_adapter_metadata=_adapter_metadata(tr),
        safe_serialization=True,
    )


def load_lora_into(pipe, folder: str | Path) -> None:
    """Load a LoRA written by :func:`save_lora` into ``pipe``: ``pipe.load_lora_weights`` or, for a pipeline
    without a LoRA loader, ``pipe.transformer.load_lora_adapter(folder, prefix=None)``; its tensors are checked
    against the transformer first (:func:`check_lora_fits`).

    Raises:
        ValueError: the LoRA names a module the transformer has not, or a shape that does not fit it (one line).
    """
    check_lora_fits(pipe.transformer, Path(folder) / "pytorch_lora_weights.safetensors")
    if hasattr(pipe, "load_lora_weights"):
        pipe.load_lora_weights(str(folder))
    else:
        pipe.transformer.load_lora_adapter(str(folder), prefix=None, weight_name="pytorch_lora_weights.safetensors")


#: the tensors of a LoRA layer in diffusers' (and peft's) form, by name: the down projection A (r, in_features) and
#: the up projection B (out_features, r)
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def lora_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of the safetensors file ``path`` by name, read from its header alone (``safe_open``).

    Raises:
        ValueError: the file cannot be read as safetensors (empty, truncated, another format; one line).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except Exception as err:  # safetensors raises its own SafetensorError (not an OSError) for a bad header
        if isinstance(err, FileNotFoundError):
            raise ValueError(f"the LoRA file {str(path)!r} does not exist") from None
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"the LoRA file {str(path)!r} cannot be read as safetensors ({why}): it is empty, cut "
                         "short or not a LoRA that flowgrpo or diffusers wrote") from None


def check_lora_fits(transformer: torch.nn.Module, path: str | Path) -> None:
    """Refuse a LoRA file whose tensors do not fit ``transformer``, before diffusers loads it: diffusers 0.42 loads
    the tensors of modules the model has not with a warning (a LoRA of a deeper model: its extra blocks dropped),
    and widens a layer whose LoRA is wider than it (FLUX's loader, made for Control LoRAs: a LoRA of a model with
    more input channels changed ``x_embedder`` to its width, silently). Only the shapes are read (``safe_open``).

    Checked: the transformer's tensors (the keys under ``transformer.`` of a pipeline LoRA, every key of a
    transformer's own); for each ``<module>.lora_A.weight`` (r, in) and ``<module>.lora_B.weight`` (out, r): the
    module exists and is a ``Linear`` of ``in`` → ``out`` features (the file's header is read by
    :func:`lora_shapes`). A file with no key in this form (another
    trainer's naming, which diffusers converts) is left to diffusers, and so are the shapes of a LoRA on a layer
    that is not a ``Linear``.

    Raises:
        ValueError: one line naming the file, the first tensor that does not fit, and why; or that the file cannot
        be read (:func:`lora_shapes`).
    """
    shapes = lora_shapes(path)
    prefixed = any(k.startswith("transformer.") for k in shapes)
    ours = {k.removeprefix("transformer."): v for k, v in shapes.items()
            if not prefixed or k.startswith("transformer.")}
    layers = {k: v for k, v in ours.items() if k.endswith(_LORA_SUFFIXES)}
    modules = dict(transformer.named_modules())
    for key, shape in sorted(layers.items()):
        name, side = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        module = modules.get(name)
        module = getattr(module, "base_layer", module)  # a transformer that already has a LoRA adapter
        if module is None:
            raise ValueError(f"the LoRA {str(path)!r} does not fit this model: its tensor {key!r} is for the "
                             f"module {name!r}, which {type(transformer).__name__} has not (a LoRA of another "
                             "model?)")
        if not isinstance(module, torch.nn.Linear):  # a LoRA of a convolution: its kernel shapes are diffusers'
            continue
        want = (shape[0], module.in_features) if side == "lora_A" else (module.out_features, shape[1])
        if tuple(shape) != want:
            raise ValueError(f"the LoRA {str(path)!r} does not fit this model: its tensor {key!r} has shape "
                             f"{tuple(shape)}, and {name!r} is a Linear of {module.in_features} -> "
                             f"{module.out_features} features (a LoRA of another model?)")


def _save_transformer_lora(tr, folder: str | Path, layers: dict[str, torch.Tensor]) -> None:
    """``layers`` as diffusers' ``ModelMixin.save_lora_adapter`` writes a transformer's LoRA: one safetensors file
    named as diffusers names it, with the adapter config in its metadata (read back by ``load_lora_adapter``)."""
    import json

    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE

    config = _adapter_metadata(tr)
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_tensors({k: v.contiguous() for k, v in layers.items()}, (Path(folder) / LORA_WEIGHT_NAME_SAFE),
              metadata={"format": "pt", LORA_ADAPTER_METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)})


def _adapter_metadata(tr) -> dict:
    """The LoRA's peft config as saved beside its weights, every set (``target_modules``) as a sorted list: a set's
    order follows the process's string hashing (``PYTHONHASHSEED``), so the same weights would otherwise be saved
    as other bytes by every process."""
    return {k: sorted(v) if isinstance(v, set) else v for k, v in tr.peft_config["default"].to_dict().items()}


def make_trainable(adapter, config, objective) -> None:
    """Make the adapter's transformer trainable (:func:`~flowgrpo.models.lora.setup_trainable`), LoRA weights in
    float32 whatever the model's dtype. The list of trained parameters is not kept: the optimizer takes them from
    the prepared module (:func:`~flowgrpo.parallel.trainable_parameters`), and under FSDP2 a list kept here would
    hold every original, unsharded parameter (the whole model, moved to the device before sharding) for the whole
    run, on the main process (the others' are on the meta device)."""
    m = config.model
    params = setup_trainable(
        adapter, finetune=m.finetune, rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.lora_target_modules,
        need_reference=objective.needs_reference, gradient_checkpointing=m.gradient_checkpointing,
        sharded=config.parallel.sharding == "fsdp2",
    )
    if m.finetune == "lora":
        for p in params:
            p.data = p.data.float()
