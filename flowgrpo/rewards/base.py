"""The Reward protocol: what every reward plugin implements.

A reward scores a batch of decoded images against their prompts::

    scores = reward(images, prompts, metadata)   # (B,) float32

* ``images``: (B, 3, H, W) float32 in [0, 1], on any device (a reward moves them where it needs them), or, from a
  video model, **videos** (B, F, 3, H, W) float32 in [0, 1] (F frames in time order). A reward says which forms
  it scores in its class attribute ``modalities`` (``("image",)`` unless it says otherwise; ``("video",)`` or
  ``("image", "video")``); a form it does not score is a ``ValueError`` naming the reward and the way out
  (``video_frames`` scores any image reward over the frames). Anything else (``uint8`` or other non-float
  tensors, values outside [0, 1], NaN) is a ``ValueError`` naming the reward (:func:`check_reward_inputs`, which
  :class:`BaseReward` calls and the conformance suite checks).
* ``prompts``: list of B strings.
* ``metadata``: list of B dicts, the extra fields of the prompt file's JSONL lines (``{}`` for plain text
  prompts). A reward that needs a field raises ``ValueError`` naming the field when it is absent: bad input is
  an error, not a NaN.
* returns (B,) float32 on the CPU. ``NaN`` means "not applicable to this sample" (see
  :mod:`flowgrpo.rewards.compose`).

A **group-wise** reward sets the class attribute ``group_wise = True``: it is then called once per group with the G
images of one prompt (all ``prompts`` equal) and scores them relative to each other (a rank, a win rate), so its
scores depend on the other members of the group. The trainer scores group-wise rewards after the rollout, when
every group is complete (:func:`score_groups`); evaluation images have no groups, so evaluation leaves them out.

A reward may implement the optional hook ``check_training_prompts(prompts)``: the trainer calls it once at setup,
before :meth:`Reward.setup`, with the :class:`~flowgrpo.data.prompts.PromptSet` the policy trains on (``prompts``,
``metadata``, ``source``), whether the reward is listed under ``rewards`` or ``eval_rewards``. It may log a
warning (a benchmark reward warns when training prompts overlap its evaluation set) or raise ``ValueError`` for
prompts it cannot score; it returns nothing.

A reward may also implement ``check_prompts(prompts)``: called before the model loads with every
:class:`~flowgrpo.data.prompts.PromptSet` the reward will score (the training set for ``rewards``, the evaluation
set for ``rewards`` and ``eval_rewards``), it raises ``ValueError`` for prompts or metadata it cannot score (the
digits rewards: a missing or out-of-range ``digit``), so a bad prompt file stops the run in one line before any
weights load.

For evaluation, a reward may implement ``batch_metrics(images, prompts, metadata) -> dict[str, float]``:
whole-set figures reported as ``eval/<key>`` in place of the per-image mean (a key ``<group>/<figure>`` is a
per-group figure, kept off the console's evaluation line), and ``report_table(summary) -> GroupTable | None``:
the per-group table (:class:`~flowgrpo.records.GroupTable`) of the end-of-run report and of the panels under
``before_after.png``, built from ``summary.json``'s figures (the digits judge: its per-digit table).

A reward may declare that its score is **differentiable** in the images: the class attribute ``differentiable =
True`` (read by the configuration check of the reward-gradient objectives, before anything is constructed; an
instance may set it False when its settings make the score piecewise constant, e.g. a 0/1 verdict) and the method
``score_differentiable(images, prompts, metadata) -> (B,) float32`` on the images' device, with the autograd graph
back to ``images`` (no ``torch.no_grad``, no host copy, no 8-bit rounding). Its values equal ``__call__``'s. The
ReFL / DRaFT objective (:mod:`flowgrpo.algo.objectives.reward_backprop`) backpropagates through it;
:func:`is_differentiable` and :func:`differentiable_scores` are the checks and the call.

A reward whose score reads the prompt text declares it: ``text_conditioned = True`` (class attribute); SRPO's relative
reward (:mod:`flowgrpo.algo.objectives.srpo`) puts control phrases in the prompt, which change only such a score.

A reward may declare the **range of its score**, ``typical_range = (lo, hi)`` (class or instance attribute, floats,
lo < hi, in the score's own units): its bounds where it has them (a probability: (0, 1)), else where the scores of
ordinary images lie (PickScore ≈ 18–24), with the source in the reward's docstring. ReFL's hinge relu(m − R) reads
it (:func:`typical_range`) to refuse a margin m at or below every score the composed reward can take, where no
sample would ever get a gradient.

Plugins are classes (or factories) registered in the ``flowgrpo.rewards`` entry-point group; they are constructed
with the keyword arguments of the config's ``rewards[i].kwargs`` and must not load weights in ``__init__``:
heavy state is loaded in :meth:`Reward.setup`, which the trainer calls once with the device to use.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Reward(Protocol):
    """A reward plugin. ``name`` is a short identifier used in metric names (``reward/<name>/mean``)."""

    name: str

    def setup(self, device: torch.device) -> None:
        """Load weights onto ``device``. Called once before the first scoring; cheap rewards do nothing."""

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        """Score ``images`` (B, 3, H, W) float in [0, 1]; return (B,) float32 on the CPU."""


#: The input forms a reward can declare in ``modalities``: images (B, 3, H, W) and videos (B, F, 3, H, W).
MODALITIES = ("image", "video")


def modalities_of(reward) -> tuple[str, ...]:
    """The input forms ``reward`` scores: its ``modalities`` attribute, ``("image",)`` when it has none.

    Raises:
        ValueError: a ``modalities`` that is empty or names a form other than ``"image"`` and ``"video"``.
    """
    forms = tuple(getattr(reward, "modalities", ("image",)))
    if not forms or any(f not in MODALITIES for f in forms):
        raise ValueError(f"reward {getattr(reward, 'name', reward)!r}: modalities must be a non-empty subset of "
                         f"{MODALITIES}, got {forms!r}")
    return forms


class BaseReward:
    """Optional convenience base: a no-op :meth:`setup` and the shared input check (:func:`check_reward_inputs`)
    before :meth:`score`, so a subclass only ever sees float images (B, 3, H, W) in [0, 1] — or videos
    (B, F, 3, H, W) if it lists ``"video"`` in :attr:`modalities`."""

    name: str = "reward"
    modalities: tuple[str, ...] = ("image",)

    def setup(self, device: torch.device) -> None:  # noqa: D401 - protocol method
        self.device = torch.device(device)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        check_reward_inputs(images, prompts, metadata, self.name, modalities_of(self))
        return self.score(images, prompts, metadata)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        raise NotImplementedError


def is_differentiable(reward) -> bool:
    """Whether ``reward`` (an instance, a class or a factory) declares a score differentiable in the images: its
    ``differentiable`` attribute is True and it has ``score_differentiable`` (module docstring)."""
    return getattr(reward, "differentiable", False) is True and callable(getattr(reward, "score_differentiable", None))


def typical_range(reward, name: str = "reward") -> tuple[float, float] | None:
    """The ``typical_range`` ``reward`` declares (module docstring) as ``(lo, hi)`` floats, or None when it
    declares none.

    Raises:
        ValueError: a declaration that is not two finite numbers lo < hi (naming the reward).
    """
    value = getattr(reward, "typical_range", None)
    if value is None:
        return None
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"reward {name!r}: typical_range must be two numbers (lo, hi), got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"reward {name!r}: typical_range must be finite with lo < hi, got {value!r}")
    return lo, hi


def differentiable_scores(reward, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                          name: str = "reward") -> torch.Tensor:
    """``reward.score_differentiable`` after the shared input check: (B,) float32 on the images' device, with
    gradient to ``images`` (B, 3, H, W) float in [0, 1].

    Raises:
        ValueError: the reward ``name`` declares no differentiable score (naming it), bad inputs
            (:func:`check_reward_inputs`), or a result that is not (B,) float.
    """
    if not is_differentiable(reward):
        raise ValueError(f"reward {name!r} has no differentiable score (differentiable = True and "
                         "score_differentiable); a reward-gradient objective cannot train on it")
    check_reward_inputs(images, prompts, metadata, name, modalities_of(reward))
    out = reward.score_differentiable(images, prompts, metadata)
    if not isinstance(out, torch.Tensor) or out.shape != (images.shape[0],) or not out.is_floating_point():
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"reward {name!r}: score_differentiable returned {shape}, expected a ({images.shape[0]},) "
                         "float tensor")
    return out.float()


def is_group_wise(reward) -> bool:
    """Whether ``reward`` scores whole groups (its ``group_wise`` attribute is True)."""
    return getattr(reward, "group_wise", False) is True


def score_groups(reward, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                 group_ids: torch.Tensor) -> torch.Tensor:
    """Call a group-wise ``reward`` once per group and put the scores back in batch order.

    Args:
        images: (B, 3, H, W) or (B, F, 3, H, W) float in [0, 1]; prompts, metadata: B each.
        group_ids: (B,) long; the members of a group need not be adjacent.

    Returns:
        (B,) float32 on the CPU.

    Raises:
        ValueError: the lengths differ, a group mixes prompts, or the reward returns other than (G,) scores.
    """
    check_reward_inputs(images, prompts, metadata, getattr(reward, "name", "reward"), modalities_of(reward))
    if group_ids.shape != (images.shape[0],):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({images.shape[0]},)")
    out = torch.full((images.shape[0],), float("nan"))
    for g in torch.unique(group_ids):
        idx = torch.nonzero(group_ids == g).flatten()
        group_prompts = [prompts[i] for i in idx]
        if len(set(group_prompts)) > 1:
            raise ValueError(f"group {int(g)} mixes prompts {sorted(set(group_prompts))}; a group is the samples "
                             "of one prompt")
        scores = torch.as_tensor(reward(images[idx], group_prompts, [metadata[i] for i in idx]),
                                 dtype=torch.float32).cpu()
        if scores.shape != (len(idx),):
            raise ValueError(f"group-wise reward {getattr(reward, 'name', reward)!r} returned shape "
                             f"{tuple(scores.shape)} for a group of {len(idx)}")
        out[idx] = scores
    return out


def check_reward_inputs(
    images: torch.Tensor, prompts: list[str], metadata: list[dict], name: str = "reward",
    modalities: tuple[str, ...] = ("image",),
) -> None:
    """The input contract every reward shares: raise ``ValueError`` naming the reward ``name`` unless

    * ``images`` is a (B, 3, H, W) image tensor (``"image"`` in ``modalities``) or a (B, F, 3, H, W) video tensor
      with F >= 1 (``"video"`` in ``modalities``) of a floating dtype (float32, float16, bfloat16, float64): 8-bit
      (``uint8``) or integer images are refused, since a reward that rescales them silently sees other pixels
      than the official scorer; a video given to an image reward is refused with the way to score it frame by
      frame (the ``video_frames`` reward);
    * every value is in [0, 1]: values in [0, 255] or [-1, 1] are refused, not rescaled; NaN or infinite values
      are refused naming the divergence that produced them (non-finite latents or weights), not the range;
    * ``prompts`` and ``metadata`` have length B.

    The range check reads the tensor's min and max (one device synchronisation per call).
    """
    image = isinstance(images, torch.Tensor) and images.ndim == 4 and images.shape[1] == 3
    video = isinstance(images, torch.Tensor) and images.ndim == 5 and images.shape[2] == 3 and images.shape[1] >= 1
    shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
    if video and "video" not in modalities:
        raise ValueError(f"{name}: scores images (B, 3, H, W), got a video (B, F, 3, H, W) = {shape}; score its "
                         f"frames with {{name: video_frames, kwargs: {{base: {name}}}}}")
    if image and "image" not in modalities:
        raise ValueError(f"{name}: scores videos (B, F, 3, H, W), got images (B, 3, H, W) = {shape}")
    if not (image or video):
        forms = " or ".join({"image": "(B, 3, H, W)", "video": "(B, F, 3, H, W)"}[m] for m in modalities)
        raise ValueError(f"{name}: images must be a {forms} float tensor in [0, 1], got {shape}")
    if not images.is_floating_point():
        raise ValueError(
            f"{name}: images must be a float tensor with values in [0, 1], got dtype {images.dtype}; convert 8-bit "
            "images with images.float() / 255"
        )
    if images.numel():
        low, high = torch.aminmax(images.detach())
        if not (bool(low >= 0) and bool(high <= 1)):  # False for NaN as well
            bad = int((~torch.isfinite(images.detach())).sum())  # read only on this error path
            if bad:
                raise ValueError(
                    f"{name}: {bad} of the {images.numel()} image values are NaN or infinite: the images were "
                    "generated from non-finite latents, i.e. the model's weights or its sampling diverged (a run "
                    "with too high a train.lr, or a checkpoint written from such weights); this is not a pixel-range "
                    "problem"
                )
            raise ValueError(
                f"{name}: image values must lie in [0, 1], got min {float(low):.6g}, max {float(high):.6g} "
                "(NaN counts as out of range); map [-1, 1] decoder output with (x + 1) / 2 and clamp"
            )
    if len(prompts) != images.shape[0] or len(metadata) != images.shape[0]:
        raise ValueError(
            f"{name}: got {images.shape[0]} images but {len(prompts)} prompts and {len(metadata)} metadata dicts"
        )


class MissingWeightsError(OSError):
    """A reward's weights are not on this machine and cannot be downloaded (offline, or no such hub repo).

    The message is one line: which reward, what is missing, the ``hf download`` command that fetches it, and the
    reward's config key that takes the local path instead. The training script prints it without a traceback.
    ``reward`` and ``key`` hold the reward's name and that keyword argument.
    """

    def __init__(self, message: str, reward: str = "", key: str = "") -> None:
        super().__init__(message)
        self.reward, self.key = reward, key


def is_local_path(spec: str) -> bool:
    """True for an existing path or anything shaped like a path (``./x``, ``/x``, ``~/x``, ``a/b/c``, ``x.pt``);
    False for a hub repo id ``name`` or ``owner/name``."""
    if Path(spec).expanduser().exists():
        return True
    return spec.startswith((".", "/", "~", "\\")) or spec.count("/") > 1 or "\\" in spec or spec.endswith(
        (".pt", ".pth", ".bin", ".safetensors", ".json"))


@contextlib.contextmanager
def hub_weights(reward: str, key: str, repo: str, files: Sequence[str] = (), local_hint: str = "DIR") -> Iterator[None]:
    """Turn a failed hub download inside the block into a one-line :class:`MissingWeightsError`.

    Args:
        reward: the reward's name (``hpsv2``).
        key: the reward's keyword argument (config ``rewards[i].kwargs.<key>``) that takes a local path.
        repo: the hub repo id the block downloads from; nothing is converted when it is a local path
            (:func:`is_local_path`): errors about local files keep their own message.
        files: the files to download (empty: the whole repo).
        local_hint: what to set ``key`` to once downloaded (``DIR`` or ``DIR/<file>``).

    Raises:
        MissingWeightsError: the block raised ``OSError`` (what the hub client and transformers raise offline,
            for unknown repos and missing files), or an error caused by one (open_clip wraps it in a
            ``RuntimeError``), and ``repo`` is a hub id.
    """
    try:
        yield
    except MissingWeightsError:
        raise
    except Exception as err:
        if is_local_path(repo) or not _caused_by_os_error(err):
            raise
        cause = " ".join(str(err).split())
        cause = cause if len(cause) <= 160 else cause[:157] + "..."
        command = " ".join(["hf download", repo, *files, "--local-dir DIR"])
        raise MissingWeightsError(
            f"reward {reward!r}: cannot get {', '.join(files) or 'the weights'} from the Hugging Face hub repo "
            f"{repo!r} ({type(err).__name__}: {cause}). On a machine with network run `{command}`, copy DIR here "
            f"and set `{key}: {local_hint}` in this reward's kwargs (rewards[].kwargs.{key}).",
            reward, key,
        ) from err


def _caused_by_os_error(err: BaseException) -> bool:
    """True when ``err`` or an exception in its ``__cause__`` / ``__context__`` chain is an ``OSError``."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False
