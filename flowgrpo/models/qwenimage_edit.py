"""The Qwen-Image-Edit-Plus adapter (Qwen-Image-Edit-2509 / 2511): image editing with a diffusers
``QwenImageEditPlusPipeline`` behind the :class:`~flowgrpo.models.base.ModelAdapter` interface.

It is Qwen-Image (:mod:`flowgrpo.models.qwenimage`: true CFG with per-token renormalisation, timestep, packing, σ
grid) with one or more source images, as ``QwenImageEditPlusPipeline.__call__`` (diffusers 0.42) uses them:

* **in the text encoder**: each source resized to the pipeline's ``CONDITION_IMAGE_SIZE`` area (384², aspect
  kept, sides rounded to 32) and shown to Qwen2.5-VL as ``Picture k: <|vision_start|><|image_pad|><|vision_end|>``
  before the instruction, inside the edit template (64 system tokens dropped); the negative prompt (``" "``)
  sees the same images, so its embedding is per row, not shared;
* **in context**: each source resized to the ``VAE_IMAGE_SIZE`` area (1024², aspect kept), VAE-encoded with the
  posterior's mode, normalised ``(z − mean) / std`` and packed; their tokens follow the target's, with their
  own (1, h/2, w/2) entries in the transformer's ``img_shapes``; the velocity is the first N (target) tokens.

Both are encoded once per (prompt, images) and shared by the group. The pipeline runs one prompt per call
(``batch_size`` 1); a batch here pads the text embeddings to a common length with an attention mask, and needs
every row's sources to give the same token count (same number of sources, same aspect ratios): a batch that
mixes them raises ``ValueError``. The output size is the configured one (the pipeline's default is 1024² at
the last source's aspect ratio).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

from flowgrpo.models.base import PromptEmbeds
from flowgrpo.models.empty import empty_components
from flowgrpo.models.qwenimage import (
    QwenImageAdapter,
    build_qwen25vl_encoder,
    build_qwen_tokenizer,
    build_qwenimage_vae,
    build_tiny_qwen_transformer,
)

__all__ = ["QwenImageEditPlusAdapter", "load_qwenimage_edit_plus_adapter", "build_tiny_qwenimage_edit_plus"]


def _pad_rows(rows: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, L_i, D) embeddings and (1, L_i) masks → (B, max L, D) zero-padded and (B, max L) long masks."""
    length = max(r.shape[1] for r in rows)
    emb = torch.zeros(len(rows), length, rows[0].shape[-1], dtype=rows[0].dtype, device=rows[0].device)
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=rows[0].device)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        emb[i, : r.shape[1]] = r[0]
        mask[i, : r.shape[1]] = m[0]
    return emb, mask


class QwenImageEditPlusAdapter(QwenImageAdapter):
    """Adapter for a loaded :class:`diffusers.QwenImageEditPlusPipeline` (arguments and errors as
    :class:`~flowgrpo.models.qwenimage.QwenImageAdapter`)."""

    image_conditioned = True

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list] | None = None) -> PromptEmbeds:
        """Per row: the instruction with its sources through Qwen2.5-VL, the negative prompt with the same
        sources, and the sources' packed VAE latents (module docstring). No gradient.

        Returns batched ``prompt_embeds`` (B, L, D), ``prompt_mask`` (B, L), ``negative_prompt_embeds``
        (B, L', D), ``negative_prompt_mask`` (B, L'), ``image_latents`` (B, M, 4·C); shared ``image_shapes``
        (S, 3) long, the (1, h/2, w/2) of each source.

        Raises:
            ValueError: no images, a count that differs from the prompts', an empty image list, or rows whose
                sources give different token counts.
        """
        if images is None or len(images) != len(prompts) or any(len(i) == 0 for i in images):
            raise ValueError("Qwen-Image-Edit-Plus needs one non-empty list of source images per prompt")
        rows = [self._encode_row(p, imgs) for p, imgs in zip(prompts, images, strict=True)]
        shapes = {r[4] for r in rows}
        if len(shapes) > 1:
            raise ValueError(f"sources of one batch must give the same latent shapes, got {sorted(shapes)}; "
                             "resize the source images to one aspect ratio")
        pos, mask = _pad_rows([r[0] for r in rows], [r[1] for r in rows])
        neg, neg_mask = _pad_rows([r[2] for r in rows], [r[3] for r in rows])
        latents = torch.cat([r[5] for r in rows])
        return PromptEmbeds(
            {"prompt_embeds": pos, "prompt_mask": mask, "negative_prompt_embeds": neg,
             "negative_prompt_mask": neg_mask, "image_latents": latents},
            {"image_shapes": torch.tensor(rows[0][4], dtype=torch.long)},
        )

    def _encode_row(self, prompt: str, images: list):
        pipe = self.pipe
        cond, vae_pixels, shapes = [], [], []
        for img in images:
            w, h = img.size
            cw, ch = edit_plus.calculate_dimensions(edit_plus.CONDITION_IMAGE_SIZE, w / h)
            vw, vh = edit_plus.calculate_dimensions(edit_plus.VAE_IMAGE_SIZE, w / h)
            cond.append(pipe.image_processor.resize(img, ch, cw))
            vae_pixels.append(pipe.image_processor.preprocess(img, vh, vw).unsqueeze(2))
            shapes.append((1, vh // pipe.vae_scale_factor // 2, vw // pipe.vae_scale_factor // 2))
        pos, mask = self._text(prompt, cond)
        neg, neg_mask = self._text(self.negative_prompt, cond)
        latents = torch.cat([self._encode_image(x) for x in vae_pixels], dim=1)
        return pos, mask, neg, neg_mask, tuple(shapes), latents

    def _text(self, prompt: str, cond: list) -> tuple[torch.Tensor, torch.Tensor]:
        emb, mask = self.pipe.encode_prompt(prompt=[prompt], image=cond, device=self.device,
                                            max_sequence_length=self.max_sequence_length)
        if mask is None:
            mask = torch.ones(emb.shape[:2], dtype=torch.long, device=emb.device)
        return emb, mask

    def _encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        vae, c = self.pipe.vae, self.pipe.latent_channels
        z = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode()  # (1, C, 1, h, w)
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        z = (z - mean) / std
        return QwenImageEditPlusPipeline._pack_latents(z, 1, c, z.shape[3], z.shape[4]).float()

    def _context(self, embeds: PromptEmbeds) -> tuple[torch.Tensor | None, list[tuple[int, int, int]]]:
        return embeds["image_latents"], [tuple(s) for s in embeds["image_shapes"].tolist()]


def load_qwenimage_edit_plus_adapter(path: str, *, dtype: torch.dtype, height: int | None, width: int | None,
                                     max_sequence_length: int,
                                     empty_transformer: bool = False) -> QwenImageEditPlusAdapter:
    """``QwenImageEditPlusPipeline.from_pretrained(path)`` in ``dtype``, wrapped; the size defaults to 1024 px
    (the pipeline's square default); ``max_sequence_length`` is clipped to 1024."""
    pipe = QwenImageEditPlusPipeline.from_pretrained(
        path, torch_dtype=dtype, **empty_components(path, ["transformer"] if empty_transformer else [], dtype))
    size = pipe.default_sample_size * pipe.vae_scale_factor
    return QwenImageEditPlusAdapter(pipe, height=height or size, width=width or size,
                                    max_sequence_length=min(max_sequence_length, 1024))


# the edit template QwenImageEditPlusPipeline.__init__ sets, used only to train the toy tokenizer
_EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


def build_tiny_qwenimage_edit_plus(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 32,
                                   seed: int = 0, transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny Qwen-Image-Edit-Plus pipeline and ``save_pretrained`` it into ``out_dir``.

    The classes of Qwen-Image-Edit-2509 at toy size: those of :func:`~flowgrpo.models.qwenimage.
    build_tiny_qwenimage` (with a 2-block Qwen2.5-VL vision tower that sees the sources) plus a
    ``Qwen2VLProcessor`` whose image processor keeps at most 112² pixels (16 vision tokens). ``sample_size`` is
    only checked.

    Raises:
        ValueError: ``sample_size`` not a positive multiple of 16.
    """
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    if sample_size <= 0 or sample_size % 16:
        raise ValueError(f"tiny Qwen-Image-Edit sample_size must be a positive multiple of 16, got {sample_size}")
    tok = build_qwen_tokenizer([_EDIT_TEMPLATE.format("Picture 1: " + " ".join(words)), " "])
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112),
                                 tokenizer=tok, video_processor=Qwen2VLVideoProcessor())
    transformer, scheduler = build_tiny_qwen_transformer(seed, transformer_kwargs)
    pipe = QwenImageEditPlusPipeline(scheduler=scheduler, vae=build_qwenimage_vae(seed),
                                     text_encoder=build_qwen25vl_encoder(tok, hidden=16, seed=seed), tokenizer=tok,
                                     processor=processor, transformer=transformer)
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out
