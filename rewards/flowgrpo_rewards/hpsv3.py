"""HPSv3: a Qwen2-VL human-preference model, loaded into transformers' own Qwen2-VL modules.

HPSv3 (Ma et al., "HPSv3: Towards Wide-Spectrum Human Preference Score", ICCV 2025, arXiv 2508.03789; code
github.com/MizzenAI/HPSv3, weights hub ``MizzenAI/HPSv3`` file ``HPSv3.safetensors``) is Qwen2-VL-7B-Instruct with
one added token, ``<|Reward|>``, and a small head on the decoder's last hidden state. The official scorer
(``hpsv3.inference.HPSv3RewardInferencer.reward``, with its released ``HPSv3_7B.yaml``) computes, per (image,
prompt):

1. the image resized (PIL bicubic) to ``smart_resize(H, W)`` with ``min_pixels = max_pixels = 256·28·28``: both
   sides multiples of 28 and about 200,704 pixels (448 x 448 for a square image; :func:`smart_resize`, the
   formula of ``qwen_vl_utils``), then Qwen2-VL's image processor (a no-op resize at that size, ``x/255``, CLIP
   mean/std, 14-pixel patches in pairs of frames, merged 2 x 2 into one token each);
2. one user message, the image followed by :data:`INSTRUCTION` with the prompt and :data:`REWARD_SUFFIX`, in
   Qwen2-VL-Instruct's chat template with the generation prompt, padded on the right;
3. the decoder run on the text embeddings with the vision tower's output scattered into the ``<|image_pad|>``
   positions, **with plain sequential positions 0 … L−1 in all three M-RoPE sections**: the official model calls
   the text decoder directly without position ids, so Qwen2-VL's 3-D vision positions are never used;
4. the head (Linear 3584→1024, ReLU, Dropout, Linear 1024→16, ReLU, Linear 16→2, float32) on the last hidden
   state at the ``<|Reward|>`` token, giving (mu, sigma) of the preference distribution. The score is ``mu``
   (the official README: "we select miu as the final output"), about −5 … 15 for real images.

The PyPI package ``hpsv3`` 1.0.0 pins ``transformers==4.45.2`` (and pulls in trl, deepspeed, datasets), so it cannot
be installed beside flowgrpo; this module loads the official checkpoint into ``transformers.Qwen2VLModel`` by
renaming keys (``visual.*`` unchanged, ``model.*`` → ``language_model.*``; ``lm_head`` unused) and reproduces
steps 1–4. Parity with the package, to 1e-5 in float32, is tested on a random checkpoint in the official format
(``rewards/scripts/hpsv3_reference.py`` records the package's scores). One documented difference: images arrive as
float tensors and the resize is torch's antialiased bicubic of the float image (``resize_backend: torch``, the
default) instead of PIL's 8-bit one; an image already at the target size (448 x 448 for a square image) is not
resized and scores as in the original, and ``resize_backend: pil`` runs PIL's own resize (exact).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from flowgrpo.rewards.base import BaseReward, hub_weights, is_local_path
from flowgrpo_rewards._clip_common import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImagePreprocess,
    check_positive_int,
    check_resize_backend,
    log_loaded,
    n_parameters,
    parse_dtype,
    resolve_file,
)

logger = logging.getLogger(__name__)

DEFAULT_CHECKPOINT = "MizzenAI/HPSv3"
CHECKPOINT_FILE = "HPSv3.safetensors"
DEFAULT_BASE_MODEL = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
#: min_pixels = max_pixels of the official scorer (``prepare_batch``: 256 * 28 * 28).
PIXELS = 256 * 28 * 28
#: Qwen2-VL's resize factor: patch 14 x merge 2.
FACTOR = 28
_MAX_RATIO = 200

#: The official instruction (``hpsv3/dataset/data_collator_qwen.py``: ``INSTRUCTION``), verbatim: it is the text
#: the model was trained to read.
INSTRUCTION = "\n".join([
    "",
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and "
    "give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with "
    "0 being the worst and 10 being the best. ",
    "",
    "**Visual Quality:**  ",
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:",
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, "
    "such as abnormal body structures or nonsensical environmental setups.",
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and "
    "easy to interpret, with no blurring or indistinct areas.",
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other "
    "visual elements (e.g., hair, clothing, shadows).",
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color "
    "scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should "
    "convey a sense of harmony and balance.",
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. ",
    "",
    "**Text Alignment:**  ",
    "Assess how well the image matches the textual prompt across the following sub-dimensions:",
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.",
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate "
    "how well the image adheres to this style.",
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in "
    "the image logically fit the scenario described in the prompt. The environment should support and "
    "enhance the subject without contradictions.",
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, "
    "clothing, accessories, expressions, actions) are faithfully represented in the image. Minor "
    "deviations may be acceptable, but critical attributes should be preserved.",
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are "
    "captured in the image. The generated content should not introduce elements that conflict with or "
    "distort the original description.",
    "Textual prompt - {text_prompt}",
    "",
    "",
    "",
])
#: The official ``prompt_with_special_token``, appended to the instruction.
REWARD_SUFFIX = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


def smart_resize(height: int, width: int, factor: int = FACTOR, min_pixels: int = PIXELS,
                 max_pixels: int = PIXELS) -> tuple[int, int]:
    """(h, w), both multiples of ``factor``, about ``height·width`` rescaled into [min_pixels, max_pixels] at the
    same aspect ratio: each side rounded to a multiple of ``factor``; if the area is then above ``max_pixels``,
    both sides scaled by ``√(HW/max_pixels)`` and floored to multiples, if below ``min_pixels`` scaled by
    ``√(min_pixels/HW)`` and ceiled (Qwen2-VL's ``smart_resize``, qwen_vl_utils ``vision_process.py``, which
    HPSv3 ships as ``hpsv3/dataset/utils.py``).

    Raises:
        ValueError: an aspect ratio above 200 (the reference's limit) or a non-positive side.
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > _MAX_RATIO:
        raise ValueError(f"aspect ratio must be at most {_MAX_RATIO}, got {height}x{width}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def convert_state_dict(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split an official HPSv3 state dict into (``transformers.Qwen2VLModel`` keys, head keys ``{index}.{param}``).

    The official keys follow transformers 4.45's ``Qwen2VLForConditionalGeneration``: ``visual.*`` (kept),
    ``model.*`` (the text decoder, → ``language_model.*``), ``lm_head.weight`` (dropped: the score never reads
    the language-model head) and ``rm_head.*`` (the reward head). A checkpoint wrapped as ``{"model": …}`` is
    unwrapped, as the official loader does.

    Raises:
        ValueError: a key of none of these kinds (not an HPSv3 checkpoint).
    """
    if "model" in state_dict and isinstance(state_dict["model"], dict):
        state_dict = state_dict["model"]
    body, head = {}, {}
    for key, value in state_dict.items():
        if key.startswith("visual."):
            body[key] = value
        elif key.startswith("model."):
            body["language_model." + key.removeprefix("model.")] = value
        elif key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = value
        elif key != "lm_head.weight":
            raise ValueError(f"unexpected key {key!r} in the HPSv3 checkpoint (expected visual.*, model.*, "
                             "lm_head.weight, rm_head.*)")
    return body, head


def build_head(head_state: dict[str, torch.Tensor]) -> nn.Sequential:
    """The released ``ranknet`` head (Linear, ReLU, Dropout, Linear, ReLU, Linear: linear layers at indices 0, 3
    and 5 of the official ``nn.Sequential``) in float32, with ``head_state`` loaded.

    Raises:
        ValueError: a head of another layout (the package's ``rm_head_kwargs`` variants are not released).
    """
    linear = sorted({int(k.split(".")[0]) for k in head_state})
    if linear != [0, 3, 5]:
        raise ValueError(f"HPSv3 head with linear layers at {linear}; the released ranknet head has them at [0, 3, 5]")
    w = [head_state[f"{i}.weight"] for i in linear]
    head = nn.Sequential(nn.Linear(w[0].shape[1], w[0].shape[0]), nn.ReLU(), nn.Dropout(0.05),
                         nn.Linear(w[1].shape[1], w[1].shape[0]), nn.ReLU(), nn.Linear(w[2].shape[1], w[2].shape[0]))
    head.load_state_dict({k: v.float() for k, v in head_state.items()}, strict=True)
    return head.float().eval()


class HPSv3Reward(BaseReward):
    """HPSv3's ``mu`` for each (image, prompt) pair (module docstring).

    Args:
        checkpoint: ``HPSv3.safetensors``, a folder holding it, or a hub repo id (default ``MizzenAI/HPSv3``).
        base_model: folder or hub id of the base Qwen2-VL model's ``config.json``, tokenizer, image processor
            and chat template (default ``Qwen/Qwen2-VL-7B-Instruct``; its weights are not read).
        dtype: ``"bfloat16"`` (default: the release scores in bfloat16), ``"float32"`` or ``"float16"``; the head
            always runs in float32, as in the release.
        batch_size: images per forward pass.
        pixels: the target area (min = max pixels) of the resize; 200,704 = 256·28·28 in the release.
        resize_backend: ``"torch"`` (default; antialiased bicubic of the float image) or ``"pil"`` (the
            reference's own 8-bit PIL resize, exact, on the CPU).

    Calling it: ``images`` (B, 3, H, W) float in [0, 1], ``prompts`` B strings → (B,) float32 ``mu``.

    Raises:
        ValueError: bad settings (at construction); a checkpoint that is not HPSv3's (at :meth:`setup`).
        MissingWeightsError: offline and the checkpoint or base model files are not cached (at :meth:`setup`).
        RuntimeError: the reward is called before :meth:`setup`.
    """

    name = "hpsv3"

    def __init__(self, checkpoint: str = DEFAULT_CHECKPOINT, base_model: str = DEFAULT_BASE_MODEL,
                 dtype: str = "bfloat16", batch_size: int = 8, pixels: int = PIXELS,
                 resize_backend: str = "torch") -> None:
        self.checkpoint = checkpoint
        self.base_model = base_model
        self.dtype = parse_dtype(dtype)
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.pixels = check_positive_int(pixels, "pixels")
        if self.pixels < FACTOR * FACTOR:
            raise ValueError(f"pixels must be at least {FACTOR * FACTOR} (one 28 x 28 token), got {pixels}")
        self.resize_backend = check_resize_backend(resize_backend)
        self.device = torch.device("cpu")
        self.model = self.head = self.processor = None

    # ------------------------------------------------------------------ loading
    def _load_processor(self):
        from transformers import AutoProcessor

        with hub_weights(self.name, "base_model", self.base_model,
                         ["config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                          "chat_template.json"]):
            processor = AutoProcessor.from_pretrained(self.base_model, padding_side="right")
        before = len(processor.tokenizer)
        processor.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]},
                                               replace_extra_special_tokens=False)
        self.reward_token_id = processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        if self.reward_token_id != before:  # the release appends it after the base vocabulary
            raise ValueError(f"{REWARD_TOKEN} got id {self.reward_token_id}, expected {before} (the base tokenizer "
                             f"of {self.base_model!r} already has it?)")
        return processor

    def setup(self, device: torch.device) -> None:
        """Load the processor (with ``<|Reward|>`` added), the config and the checkpoint onto ``device``."""
        import safetensors.torch
        from accelerate import init_empty_weights
        from transformers import AutoConfig, Qwen2VLModel

        super().setup(device)
        self.processor = self._load_processor()
        with hub_weights(self.name, "base_model", self.base_model, ["config.json"]):
            config = AutoConfig.from_pretrained(self.base_model)
        path = resolve_file(self.checkpoint, CHECKPOINT_FILE, "HPSv3 checkpoint", reward=self.name)
        body, head = convert_state_dict(safetensors.torch.load_file(path))
        rows = body["language_model.embed_tokens.weight"].shape[0]
        if rows != len(self.processor.tokenizer):  # the release resizes the embeddings to the tokenizer
            raise ValueError(f"HPSv3 checkpoint {path} has {rows} token embeddings but the tokenizer of "
                             f"{self.base_model!r} with {REWARD_TOKEN} has {len(self.processor.tokenizer)}")
        config.text_config.vocab_size = rows
        config._attn_implementation = "sdpa"
        with init_empty_weights():  # parameters on the meta device; rotary buffers computed for real
            model = Qwen2VLModel(config)
        model.load_state_dict(body, strict=True, assign=True)
        self.model = model.to(self.device, self.dtype).eval()
        self.head = build_head(head).to(self.device)
        self.image_token_id = config.image_token_id
        log_loaded(self.name, self.checkpoint if is_local_path(self.checkpoint) else f"{self.checkpoint} (hub)",
                   n_parameters(self.model))

    # ------------------------------------------------------------------ scoring
    def texts(self, prompts: list[str]) -> list[str]:
        """The chat-template text of each prompt (the image placeholder first, then the instruction)."""
        conversations = [[{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": INSTRUCTION.format(text_prompt=p) + REWARD_SUFFIX}]}]
            for p in prompts]
        return [self.processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                for c in conversations]

    def inputs(self, images: torch.Tensor, prompts: list[str]) -> dict:
        """The processor's inputs for one batch of equal-size images: ``input_ids``, ``attention_mask`` (B, L),
        ``pixel_values`` (patches, 3·2·14·14) and ``image_grid_thw`` (B, 3)."""
        size = smart_resize(*images.shape[-2:], min_pixels=self.pixels, max_pixels=self.pixels)
        pre = ImagePreprocess(size=size, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, resize_mode="squash",
                              resize_backend=self.resize_backend)
        pixels = pre(images.to(self.device))  # (B, 3, h, w), normalised: the processor only cuts patches
        batch = self.processor(text=self.texts(prompts), images=list(pixels), padding=True, return_tensors="pt",
                               do_resize=False, do_rescale=False, do_normalize=False)
        return {k: v.to(self.device) for k, v in batch.items()}

    def mu_sigma(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """(B, 2) float32 (mu, sigma) of equal-size ``images`` (B, 3, H, W) in [0, 1]."""
        batch = self.inputs(images, prompts)
        ids = batch["input_ids"]
        at_token = ids == self.reward_token_id
        if not bool((at_token.sum(1) == 1).all()):
            raise ValueError(f"each HPSv3 input needs exactly one {REWARD_TOKEN} token; a prompt contains it?")
        b, length = ids.shape
        positions = torch.arange(length, device=self.device).expand(b, length)  # sequential, as the release
        with torch.no_grad():
            hidden = self.model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=positions,
                                pixel_values=batch["pixel_values"].to(self.dtype),
                                image_grid_thw=batch["image_grid_thw"]).last_hidden_state
            return self.head(hidden[at_token].float())  # (B, 2)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """HPSv3 ``mu`` of each (image, prompt) pair: (B,) float32 on the CPU."""
        if self.model is None:
            raise RuntimeError("HPSv3Reward.setup(device) must be called before scoring")
        out = [self.mu_sigma(images[i : i + self.batch_size], prompts[i : i + self.batch_size])[:, 0]
               for i in range(0, images.shape[0], self.batch_size)]
        return torch.cat(out).float().cpu()

