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


class VlmJudgeReward(BaseReward):
    """Yes-probability of a VLM judge behind an OpenAI-compatible endpoint (module docstring).

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name; None: the only model the endpoint serves.
        question: the question, with ``{prompt}`` replaced by the image's prompt.
        top_logprobs: k, alternatives returned for the answer token (1–20 in the OpenAI API).
        timeout: seconds per attempt. retries: further attempts after a retryable failure.
        backoff, max_backoff: seconds of the exponential backoff.
        max_concurrency: requests in flight at once.
        api_key_env: name of the environment variable holding a bearer token (unset: no header).

    Raises:
        ValueError: bad settings (at construction), or a ``question`` without ``{prompt}``.
        VlmJudgeError: see the module docstring (at :meth:`setup` or when scoring).
    """

    name = "vlm_judge"

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", model: str | None = None,
                 question: str = DEFAULT_QUESTION, top_logprobs: int = 5, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, max_backoff: float = 8.0, max_concurrency: int = 8,
                 api_key_env: str | None = None) -> None:
        if "{prompt}" not in question:
            raise ValueError(f"question must contain '{{prompt}}', got {question!r}")
        if not 1 <= int(top_logprobs) <= 20:
            raise ValueError(f"top_logprobs must be in 1..20, got {top_logprobs!r}")
        if not float(timeout) > 0 or int(retries) < 0 or int(max_concurrency) < 1 or float(backoff) < 0:
            raise ValueError(f"need timeout > 0, retries >= 0, backoff >= 0, max_concurrency >= 1; got timeout="
                             f"{timeout!r}, retries={retries!r}, backoff={backoff!r}, max_concurrency="
                             f"{max_concurrency!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.question = question
        self.top_logprobs = int(top_logprobs)
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
                raise ImportError('the vlm_judge reward needs httpx: pip install "flowgrpo[server]"') from err
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
        logger.info("vlm_judge: %s at %s", self.model, self.base_url)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ scoring
    def _body(self, png_b64: str, prompt: str) -> bytes:
        import json

        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64}"}},
                   {"type": "text", "text": self.question.format(prompt=prompt)}]
        return json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}],
                           "max_tokens": 1, "temperature": 0.0, "logprobs": True,
                           "top_logprobs": self.top_logprobs}).encode()

    def _score_one(self, png_b64: str, prompt: str) -> float:
        reply = self._send("POST", "/chat/completions", self._body(png_b64, prompt))
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
        if self.model is None:
            self.setup()
        encoded = images_to_png_b64(images)
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(encoded)) or 1,
                                thread_name_prefix="vlm-judge") as pool:
            scores = list(pool.map(self._score_one, encoded, list(prompts)))
        return torch.tensor(scores, dtype=torch.float32)

    def __getstate__(self):  # the HTTP pool is not picklable; a copy reconnects lazily
        state = dict(self.__dict__)
        state["_client"] = None
        return state
