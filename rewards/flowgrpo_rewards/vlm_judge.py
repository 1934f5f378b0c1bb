"""``vlm_judge``: a vision-language model asked a yes/no question about each image over an OpenAI-compatible
chat-completions API (vLLM, SGLang, TGI, …), scored by the probability of "yes".

For each image the reward sends ``POST {base_url}/chat/completions`` with one user message holding the image
(``data:image/png;base64,…``, 8-bit PNG of ``round(255·x)``) and the question built from the prompt
(``question.format(prompt=…)``), asking for one token with ``logprobs: true, top_logprobs: k``, temperature 0.
From the first generated token's ``top_logprobs`` it sums the probabilities of the tokens that read "yes" and of
those that read "no" (case and surrounding spaces ignored: " Yes", "YES", "yes" all count) and returns

    score = p_yes / (p_yes + p_no)  in [0, 1]

(the yes-probability renormalised over the two answers, the VQAScore-style judge of Lin et al., arXiv 2404.01291,
eq. 1, and of Flow-GRPO's VLM reward). When neither answer is among the top-k tokens the score is NaN ("not
applicable") and a warning is logged.

A video (B, F, 3, H, W) is sent as ``frames`` of its frames (default 8, evenly spaced:
:func:`flowgrpo_rewards.video.select_frames`) in time order, each an image of the same message before the
question (the frames-as-images form of video judges served through image APIs, e.g. Pref-GRPO's UnifiedReward
video judge).

:class:`ChatJudgeBase` is the transport every judge over this API shares (the UnifiedReward judges of
:mod:`flowgrpo_rewards.unified_reward` too): the endpoint check, retries, concurrency and image encoding.

Limits: at most ``max_concurrency`` requests in flight (the server batches concurrent requests; vLLM's continuous
batching does), each attempt bounded by ``timeout`` seconds; timeouts, connection errors and replies 429/500/502/
503/504 are retried ``retries`` times with exponential backoff; then :class:`VlmJudgeError` names the endpoint and
the last error. ``setup`` asks ``GET {base_url}/models`` first, so a server that is down or does not serve
``model`` fails before training starts. Needs ``httpx`` (``pip install "flowgrpo[server]"``).
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from flowgrpo.rewards.base import BaseReward
from flowgrpo.rewards.remote import images_to_png_b64, send_with_retries

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
DEFAULT_QUESTION = 'Does this image show "{prompt}"? Answer yes or no.'


class VlmJudgeError(RuntimeError):
    """The judge endpoint is unreachable, does not serve the model, or replied something unusable."""


class ChatJudgeBase(BaseReward):
    """A judge behind an OpenAI-compatible chat-completions endpoint: connection, ``/models`` check, retries,
    bounded concurrency and image encoding, shared by the VLM judges.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name; None: the only model the endpoint serves.
        timeout: seconds per attempt. retries: further attempts after a retryable failure.
        backoff, max_backoff: seconds of the exponential backoff.
        max_concurrency: requests in flight at once.
        api_key_env: name of the environment variable holding a bearer token (unset: no header).

    Raises:
        ValueError: bad settings (at construction).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", model: str | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.5, max_backoff: float = 8.0, max_concurrency: int = 8,
                 api_key_env: str | None = None) -> None:
        if not float(timeout) > 0 or int(retries) < 0 or int(max_concurrency) < 1 or float(backoff) < 0:
            raise ValueError(f"need timeout > 0, retries >= 0, backoff >= 0, max_concurrency >= 1; got timeout="
                             f"{timeout!r}, retries={retries!r}, backoff={backoff!r}, max_concurrency="
                             f"{max_concurrency!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.max_concurrency = int(max_concurrency)
        self.api_key_env = api_key_env
        self._client = None

    # ------------------------------------------------------------------ connection
    def _http(self):
        if self._client is None:
            try:
                import httpx
            except ImportError as err:
                raise ImportError(f'the {self.name} reward needs httpx: pip install "flowgrpo[server]"') from err
            headers = {}
            if self.api_key_env and os.environ.get(self.api_key_env):
                headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
            self._client = httpx.Client(timeout=self.timeout, headers=headers,
                                        limits=httpx.Limits(max_connections=self.max_concurrency))
        return self._client

    def _send(self, method: str, path: str, body: bytes | None = None) -> dict:
        url = self.base_url + path
        r = send_with_retries(self._http(), method, url, content=body,
                              headers={"Content-Type": "application/json"} if body is not None else None,
                              retries=self.retries, backoff=self.backoff, max_backoff=self.max_backoff,
                              retry_status=RETRY_STATUS, what="VLM judge endpoint", error_cls=VlmJudgeError)
        if r.status_code != 200:
            raise VlmJudgeError(f"VLM judge endpoint {url} replied HTTP {r.status_code}: {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            raise VlmJudgeError(f"VLM judge endpoint {url} sent a reply that is not JSON: {r.text[:200]!r}") from None

    def setup(self, device: torch.device | str | None = None) -> None:
        """Ask ``/models``: the endpoint must answer and serve :attr:`model` (or exactly one model when None).

        Raises:
            VlmJudgeError: the endpoint is down (after the retries), or the model is not served.
        """
        try:
            reply = self._send("GET", "/models")
        except VlmJudgeError as err:
            raise VlmJudgeError(f"{err}. Is an OpenAI-compatible server running there (e.g. `vllm serve MODEL`)? "
                                "Set the reward's kwargs.base_url to it.") from err
        served = [m.get("id") for m in reply.get("data", []) if isinstance(m, dict)] if isinstance(reply, dict) else []
        if self.model is None:
            if len(served) != 1:
                raise VlmJudgeError(f"VLM judge endpoint {self.base_url} serves {served}; name one as kwargs.model")
            self.model = served[0]
        elif self.model not in served:
            raise VlmJudgeError(f"VLM judge endpoint {self.base_url} does not serve {self.model!r}; it serves "
                                f"{served}")
        logger.info("%s: %s at %s", self.name, self.model, self.base_url)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ requests
    def chat(self, content: list[dict], **params) -> dict:
        """One ``POST /chat/completions`` with a single user message of ``content`` parts and the request
        ``params`` (``max_tokens``, ``temperature``, …); returns the reply JSON."""
        import json

        if self.model is None:
            self.setup()
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], **params}
        return self._send("POST", "/chat/completions", json.dumps(body).encode())

    def pooled(self, fn, *iterables) -> list:
        """``[fn(*args) for args in zip(*iterables)]`` with at most ``max_concurrency`` calls in flight."""
        items = list(zip(*iterables, strict=True))
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(items)) or 1,
                                thread_name_prefix=f"{self.name}-judge") as pool:
            return list(pool.map(lambda args: fn(*args), items))

    @staticmethod
    def image_parts(images: torch.Tensor, image_format: str = "png", size: int | None = None) -> list[dict]:
        """``image_url`` content parts (base64 data URLs) of ``images`` (N, 3, H, W) in [0, 1]: the 8-bit
        ``round(255·x)`` pixels as PNG (lossless) or JPEG (quality 95, as Pref-GRPO's client sends), optionally
        resized with PIL's bicubic filter to ``size`` x ``size`` first (Flow-GRPO's UnifiedReward scorer: 512)."""
        if image_format == "png" and size is None:
            return [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}}
                    for b in images_to_png_b64(images)]
        import base64
        import io

        from PIL import Image

        from flowgrpo.images import to_uint8

        parts = []
        for array in to_uint8(images):
            img = Image.fromarray(array)
            if size is not None:
                img = img.resize((size, size), Image.Resampling.BICUBIC)
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=95) if image_format == "jpeg" else img.save(buf, format="PNG")
            mime = "jpeg" if image_format == "jpeg" else "png"
            parts.append({"type": "image_url", "image_url": {
                "url": f"data:image/{mime};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"}})
        return parts

    def __getstate__(self):  # the HTTP pool is not picklable; a copy reconnects lazily
        state = dict(self.__dict__)
        state["_client"] = None
        return state


class VlmJudgeReward(ChatJudgeBase):
    """Yes-probability of a VLM judge behind an OpenAI-compatible endpoint (module docstring).

    Args:
        question: the question, with ``{prompt}`` replaced by the image's prompt.
        top_logprobs: k, alternatives returned for the answer token (1–20 in the OpenAI API).
        frames: for videos, which frames are sent (:func:`flowgrpo_rewards.video.select_frames`; default 8).
        base_url, model, timeout, retries, backoff, max_backoff, max_concurrency, api_key_env: the endpoint
            (:class:`ChatJudgeBase`).

    Calling it: images (B, 3, H, W) or videos (B, F, 3, H, W) float in [0, 1], ``prompts`` B strings → (B,)
    float32 in [0, 1].

    Raises:
        ValueError: bad settings (at construction), or a ``question`` without ``{prompt}``.
        VlmJudgeError: see the module docstring (at :meth:`setup` or when scoring).
    """

    name = "vlm_judge"
    modalities = ("image", "video")

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", model: str | None = None,
                 question: str = DEFAULT_QUESTION, top_logprobs: int = 5, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, max_backoff: float = 8.0, max_concurrency: int = 8,
                 api_key_env: str | None = None, frames=8) -> None:
        from flowgrpo_rewards.video import check_frames

        if "{prompt}" not in question:
            raise ValueError(f"question must contain '{{prompt}}', got {question!r}")
        if not 1 <= int(top_logprobs) <= 20:
            raise ValueError(f"top_logprobs must be in 1..20, got {top_logprobs!r}")
        super().__init__(base_url, model, timeout, retries, backoff, max_backoff, max_concurrency, api_key_env)
        self.question = question
        self.top_logprobs = int(top_logprobs)
        self.frames = check_frames(frames)

    # ------------------------------------------------------------------ scoring
    def _score_one(self, parts: list[dict], prompt: str) -> float:
        reply = self.chat(parts + [{"type": "text", "text": self.question.format(prompt=prompt)}], max_tokens=1,
                          temperature=0.0, logprobs=True, top_logprobs=self.top_logprobs)
        try:
            top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            pairs = [(str(t["token"]).strip().lower(), float(t["logprob"])) for t in top]
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise VlmJudgeError(f"VLM judge endpoint {self.base_url} replied without choices[0].logprobs.content[0]"
                                f".top_logprobs ({type(err).__name__}: {err}); does the server support logprobs? "
                                f"Reply: {str(reply)[:300]}") from None
        p_yes = sum(math.exp(lp) for tok, lp in pairs if tok == "yes")
        p_no = sum(math.exp(lp) for tok, lp in pairs if tok == "no")
        if p_yes + p_no == 0:
            logger.warning("vlm_judge: neither 'yes' nor 'no' among the top %d tokens %s: NaN", self.top_logprobs,
                           [t for t, _ in pairs])
            return math.nan
        return p_yes / (p_yes + p_no)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(B,) float32 CPU yes-probabilities; at most ``max_concurrency`` requests in flight.

        Raises:
            VlmJudgeError: a request failed after its retries or the reply was unusable.
        """
        scores = self.pooled(self._score_one, media_parts(self, images, self.frames), list(prompts))
        return torch.tensor(scores, dtype=torch.float32)


def media_parts(judge: ChatJudgeBase, images: torch.Tensor, frames, image_format: str = "png",
                size: int | None = None) -> list[list[dict]]:
    """Per sample, the ``image_url`` parts that show it: one image, or the chosen ``frames`` of a video (B, F, 3,
    H, W) in time order (:func:`flowgrpo_rewards.video.select_frames`)."""
    if images.ndim == 4:
        return [[p] for p in judge.image_parts(images, image_format, size)]
    from flowgrpo_rewards.video import select_frames

    idx = select_frames(images.shape[1], frames)
    flat = judge.image_parts(images[:, idx].reshape(-1, *images.shape[2:]), image_format, size)
    return [flat[i * len(idx) : (i + 1) * len(idx)] for i in range(images.shape[0])]


