"""The model card written beside every saved LoRA or full transformer: ``README.md`` in the weights folder, the
Hugging Face Hub convention (YAML metadata between ``---`` lines, then Markdown), so ``flowgrpo push`` uploads
the weights and their description together.

The card states the base model, the algorithm and its settings, the before/after evaluation figures, the
reward curve and before/after pictures (copied into the folder so the links work on the Hub), the full
resolved config, and how to load the weights with diffusers.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import yaml

from flowgrpo.models import EMBEDDED_MODELS, resolve_pretrained
from flowgrpo.writing.outputs import replace_file, write_text_file

logger = logging.getLogger(__name__)

FIGURES = ("reward_curve.png", "before_after.png")


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not Path(name).exists() and not name.startswith((".", "/"))


def _load_snippet(base: str, pipeline_class: str, finetune: str, repo: str, prompt: str, call: dict) -> str:
    """The loading code; ``call`` holds the keyword arguments of the pipeline call (the run's evaluation
    settings: without them a small base model's own defaults, e.g. 512 px, may draw noise)."""
    args = "".join(f", {k}={v!r}" for k, v in call.items() if v is not None)
    generate = f"image = pipe({prompt!r}{args}).images[0]\n"
    if finetune == "lora":
        return (f"import torch\nfrom diffusers import {pipeline_class}\n\n"
                f'pipe = {pipeline_class}.from_pretrained("{base}", torch_dtype=torch.bfloat16)\n'
                f'pipe.load_lora_weights("{repo}")  # this folder, or its Hub repo id\n' + generate)
    transformer_class = {"FluxPipeline": "FluxTransformer2DModel",
                         "StableDiffusion3Pipeline": "SD3Transformer2DModel"}.get(pipeline_class,
                                                                                   "FluxTransformer2DModel")
    return (f"import torch\nfrom diffusers import {pipeline_class}, {transformer_class}\n\n"
            f'transformer = {transformer_class}.from_pretrained("{repo}")  # this folder, or its Hub repo id\n'
            f'pipe = {pipeline_class}.from_pretrained("{base}", transformer=transformer)\n' + generate)


def _figures_table(summary: dict, exclude: frozenset[str] = frozenset()) -> str:
    keys = sorted({k.rsplit("_", 1)[0] for k in summary if k.endswith(("_before", "_after")) and k not in exclude})
    if not keys:
        return "No evaluation figures were recorded.\n"

    def cell(v):
        return f"{v:.4g}" if isinstance(v, float | int) else "-"

    rows = [f"| {k} | {cell(summary.get(f'{k}_before'))} | {cell(summary.get(f'{k}_after'))} |" for k in keys]
    return "| figure | before | after |\n|---|---|---|\n" + "\n".join(rows) + "\n"


def card_task(pipeline_class: str) -> str:
    """The Hugging Face task tag of a pipeline class: ``image-to-video`` or ``text-to-video`` for a video family
    (:data:`~flowgrpo.models.VIDEO_FAMILIES`), else ``text-to-image``."""
    from flowgrpo.models import VIDEO_FAMILIES

    if pipeline_class in VIDEO_FAMILIES:
        return "image-to-video" if "ImageToVideo" in pipeline_class else "text-to-video"
    return "text-to-image"


def _card_metadata(m, pipeline_class: str = "FluxPipeline") -> dict:
    """The card's YAML header for model settings ``m`` of a ``pipeline_class`` model: library, tags (its task,
    :func:`card_task`), and the base model when it is a Hub id."""
    meta = {"library_name": "diffusers", "tags": ["flowgrpo", card_task(pipeline_class), "reinforcement-learning",
                                                  "lora" if m.finetune == "lora" else "full-finetune"]}
    if _is_hub_id(m.pretrained):
        meta["base_model"] = m.pretrained
    return meta


def _algorithm(config) -> str:
    """The card's algorithm line: the SDE-ratio objective's sampler, chunker, advantages, clip range and KL weight,
    or another objective's name and advantages."""
    s, o, a = config.sampling, config.objective, config.advantage
    if getattr(o, "chunker", None) is None:
        return f"objective `{o.name}`, advantages `{a.name}`"
    return (f"SDE `{s.sde_kind}` (noise level {s.noise_level:g}, {s.num_steps} steps), chunker\n  `{o.chunker.name}`, "
            f"advantages `{a.name}`, clip range {o.clip_low:g}/{o.clip_high:g},\n  KL β {o.kl_beta:g}")


def model_card(config, summary: dict, *, pipeline_class: str = "FluxPipeline", repo: str = ".",
               figures: tuple[str, ...] = FIGURES, base_folder: str | None = None,
               prompt: str = "a photo of a cat", call: dict | None = None,
               exclude: frozenset[str] = frozenset()) -> str:
    """The card's text (``README.md``) for a run's weights.

    Args:
        config: the run's :class:`~flowgrpo.config.Config`.
        summary: the run's summary (``summary.json``): figures ``<name>_before`` / ``<name>_after``, ``epochs``,
            ``phase_seconds``.
        pipeline_class: the base model's diffusers pipeline class (``FluxPipeline``, ``StableDiffusion3Pipeline``).
        repo: how the loading snippet names the weights (a folder or a Hub repo id).
        figures: picture files beside the card to show.
        base_folder: where an embedded base model lives (:data:`~flowgrpo.models.EMBEDDED_MODELS`).
        prompt: the example prompt of the loading code.
        call: the loading code's pipeline-call arguments (default :func:`pipeline_call` of ``config``).
        exclude: summary keys left out of the figures table (a task's per-group figures).
    """
    m, t = config.model, config.train
    base = m.pretrained
    meta = _card_metadata(m, pipeline_class)
    rewards = ", ".join(f"`{r.name}` (weight {r.weight:g})" for r in config.rewards)
    evals = ", ".join(f"`{r.name}`" for r in config.eval_rewards) or "none"
    pics = "".join(f"![{f.removesuffix('.png').replace('_', ' ')}]({f})\n\n" for f in figures)
    config_yaml = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    return f"""---
{yaml.safe_dump(meta, sort_keys=False).strip()}
---

# {Path(config.output_dir).name}: {m.finetune} fine-tune of `{base}` by reinforcement learning

Trained with flowgrpo — GRPO-family reinforcement learning for flow-matching models.

* **Base model:** `{base}` ({pipeline_class}{", built by flowgrpo in " + base_folder if base_folder else ""})
* **Weights:** {"LoRA (rank " + str(m.lora_rank) + ", alpha " + str(m.lora_alpha) + ")" if m.finetune == "lora"
                else "the full transformer"}
* **Algorithm:** {_algorithm(config)}
* **Training:** {summary.get("epochs", t.num_epochs)} epochs of {t.prompts_per_epoch} prompts × G = {t.group_size},
  AdamW lr {t.lr:g}, seed {t.seed}; prompts `{config.data.train_prompts}`
* **Rewards optimised:** {rewards}; scored at evaluation only: {evals}

## Results (held-out evaluation, the same seeds before and after)

{_figures_table(summary, exclude)}
{pics}## How to load

```python
{_load_snippet(base_folder or base, pipeline_class, m.finetune, repo, prompt, call or pipeline_call(config))}```

## Config

<details><summary>the resolved training config</summary>

```yaml
{config_yaml}```

</details>
"""


def pipeline_call(config, height: int | None = None, width: int | None = None) -> dict:
    """The pipeline-call arguments that reproduce the run's evaluation images: size (``height``/``width``, else
    the config's), steps, guidance and text length."""
    m, e = config.model, config.eval_sampling
    return {"height": height or m.height, "width": width or m.width, "num_inference_steps": e.num_steps,
            "guidance_scale": e.guidance_scale, "max_sequence_length": m.max_sequence_length}


def write_model_card(config, summary: dict, weights_dir: str | Path, run_dir: str | Path, *,
                     pipeline_class: str = "FluxPipeline", prompt: str = "a photo of a cat",
                     call: dict | None = None, exclude: frozenset[str] = frozenset()) -> Path | None:
    """Write ``weights_dir/README.md`` (:func:`model_card`; ``exclude``: summary keys left out of its figures
    table) and copy the run's figures beside it. Returns the card's path, or None (with a warning) when
    ``weights_dir`` does not exist."""
    weights_dir, run_dir = Path(weights_dir), Path(run_dir)
    if not weights_dir.is_dir():
        logger.warning("no weights in %s: no model card written", weights_dir)
        return None
    figures = tuple(name for name in FIGURES if (run_dir / name).exists())
    for name in figures:
        replace_file(weights_dir / name, lambda tmp, name=name: shutil.copyfile(run_dir / name, tmp))
    path = weights_dir / "README.md"
    base = config.model.pretrained
    folder = resolve_pretrained(base) if base in EMBEDDED_MODELS else None  # already built for training
    write_text_file(path, model_card(config, summary, pipeline_class=pipeline_class, repo=str(weights_dir),
                                     figures=figures, base_folder=folder, prompt=prompt, call=call, exclude=exclude))
    return path
