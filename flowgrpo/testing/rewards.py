"""A conformance test class for reward plugins: run it over your rewards to check the Reward protocol.

Subclass :class:`RewardConformance` in a test module (the subclass's name must start with ``Test``)::

    from flowgrpo.testing.rewards import RewardConformance
    from my_package.rewards import MyReward

    class TestMyReward(RewardConformance):
        reward_factory = staticmethod(lambda: MyReward(checkpoint="tests/data/tiny.pt"))
        metadata_factory = staticmethod(lambda n: [{"tag": "cat"} for _ in range(n)])
        required_metadata_fields = ("tag",)

and run ``pytest``. Every ``test_*`` method checks one clause of the protocol (:mod:`flowgrpo.rewards.base`):

* the input forms it declares (``modalities``: images (B, 3, H, W), videos (B, F, 3, H, W)) are scored and the
  others refused with a ``ValueError`` naming the reward;
* construction loads no weights (no checkpoint is read and no sizable tensor is held before ``setup``);
* ``setup(device)`` then a call returns a (B,) float32 CPU tensor, for images on the CPU and on ``device``;
* permuting the batch permutes the scores, and scores do not depend on the batch they are scored in;
* the same input gives the same scores, also from another thread (the background scorer's worker);
* NaN appears only where the reward documents it (:attr:`RewardConformance.nan_case`);
* the inputs are not modified;
* bad input raises ``ValueError``: a wrong image shape, lengths that differ, a missing metadata field (named in
  the message), and images that are not float in [0, 1] (uint8, integer or bool tensors; values on the 0-255 or
  [-1, 1] scale, above 1 or NaN), whose message names the reward (``reward.name``).
  :func:`flowgrpo.rewards.base.check_reward_inputs` (called by ``BaseReward``) does all of these.

A group-wise reward (``group_wise = True``, :mod:`flowgrpo.rewards.base`) gets inputs that form one group (one
prompt and one metadata dict repeated); the batch-independence clause does not apply to it (its scores depend on
the group by design) and is replaced by: scored through the trainer's per-group path with two interleaved groups,
each group's scores equal those of the group scored alone, and composition (also GDPO) accepts them.

Class attributes to set (plain functions must be wrapped in ``staticmethod``; classes need not be):

``reward_factory``  () → a new, not yet set up reward. Required.
``metadata_factory``  (n) → n metadata dicts valid for the reward. Default: n empty dicts.
``prompt_factory``  (n) → n prompts. Default: a fixed list of varied prompts.
``image_factory``  (n, height, width, generator) → (n, 3, H, W) float in [0, 1] on the CPU. Default: smooth
    random colour fields with per-image noise, on the 8-bit grid, so that images differ in content and detail.
``video_factory``  (n, frames, height, width, generator) → (n, F, 3, H, W) float in [0, 1] on the CPU, for a
    reward tested on videos. Default: :func:`default_videos` (each frame the previous one shifted by a pixel).
``input_form``  ``"image"`` or ``"video"``: the form the clauses are checked on. Default: images when the reward
    lists ``"image"`` in its ``modalities``, else videos. ``num_frames``: F of the test videos (default 3).
``required_metadata_fields``  metadata keys the reward needs (each one is removed in turn). Default: none.
``device``  the device for ``setup`` (default ``"cpu"``). ``image_size`` (H, W) (default (64, 64)).
``atol``, ``rtol``  tolerance of the batch-order and batch-size comparisons (batched kernels may round
    differently); ``determinism_atol`` for the repeat-call comparison (default 0: bitwise equal).
``nan_case``  None, or a staticmethod () → (images, prompts, metadata, expected_nan_mask) for a reward that
    documents NaN ("not applicable"); scores must be NaN exactly where the (B,) bool mask is True.
``max_init_tensor_elements``  the most tensor elements an unset-up reward may hold (default 65,536: constants
    such as normalisation statistics are fine, weights are not).

Needs pytest (``pip install "flowgrpo[test]"``).
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable

import torch

try:
    import pytest
except ImportError as err:  # pragma: no cover - the class is only useful under pytest
    raise ImportError('flowgrpo.testing.rewards needs pytest: pip install "flowgrpo[test]"') from err

from flowgrpo.algo.advantages import compute_advantages
from flowgrpo.images import to_uint8
from flowgrpo.rewards.base import MODALITIES, Reward, is_group_wise, modalities_of, score_groups
from flowgrpo.rewards.compose import ComposedReward

_PROMPTS = [
    "a photo of a cat",
    "a red car on a street at night",
    "two apples and a banana on a table",
    'a sign that says "open"',
    "an oil painting of a lighthouse in a storm",
    "a close-up of a leaf with water drops",
    "a blue bird on a wire",
    "a city skyline at dawn",
]


def default_images(n: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """(n, 3, H, W) float32 on the 8-bit grid: smooth colour fields plus noise of a different strength per image."""
    low = torch.rand(n, 3, max(height // 8, 2), max(width // 8, 2), generator=generator)
    x = torch.nn.functional.interpolate(low, size=(height, width), mode="bilinear", align_corners=False)
    amp = torch.linspace(0.0, 0.5, n).view(n, 1, 1, 1) if n > 1 else torch.full((1, 1, 1, 1), 0.25)
    x = x + amp * (torch.rand(n, 3, height, width, generator=generator) - 0.5)
    return torch.from_numpy(to_uint8(x)).permute(0, 3, 1, 2).float() / 255  # on the 8-bit grid


def default_videos(n: int, frames: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """(n, F, 3, H, W) float32 on the 8-bit grid: :func:`default_images` as frame 0, each later frame the one
    before it shifted one pixel right and down (wrapping), so consecutive frames are alike but not equal."""
    first = default_images(n, height, width, generator)
    return torch.stack([torch.roll(first, shifts=(f, f), dims=(-2, -1)) for f in range(frames)], dim=1)


def _tensor_elements(obj, seen: set[int], depth: int = 0) -> int:
    """Tensor elements reachable from ``obj`` through attributes, containers and modules (depth-limited)."""
    if id(obj) in seen or depth > 6:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, torch.nn.Module):
        return sum(t.numel() for t in list(obj.parameters()) + list(obj.buffers()))
    if isinstance(obj, dict):
        return sum(_tensor_elements(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple | set | frozenset):
        return sum(_tensor_elements(v, seen, depth + 1) for v in obj)
    if isinstance(obj, str | bytes | int | float | bool | type(None)) or inspect.ismodule(obj) or \
            inspect.isclass(obj) or inspect.isroutine(obj):
        return 0
    state = getattr(obj, "__dict__", None)
    return _tensor_elements(state, seen, depth + 1) if isinstance(state, dict) else 0


class _LoadSpy:
    """Records calls to the functions that read weights (torch.load, safetensors, load_state_dict)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        targets = [(torch, "load"), (torch.nn.Module, "load_state_dict")]
        try:
            import safetensors
            import safetensors.torch

            targets += [(safetensors.torch, "load_file"), (safetensors.torch, "load"), (safetensors, "safe_open")]
        except ImportError:
            pass
        for owner, attr in targets:
            if hasattr(owner, attr):
                monkeypatch.setattr(owner, attr, self._wrap(f"{getattr(owner, '__name__', owner)}.{attr}",
                                                            getattr(owner, attr)))

    def _wrap(self, label: str, fn: Callable):
        def spy(*args, **kwargs):
            self.calls.append(label)
            return fn(*args, **kwargs)

        return spy


class RewardConformance:
    """Protocol checks for one reward; subclass it as ``Test…`` and set :attr:`reward_factory` (see module doc)."""

    reward_factory: Callable | None = None
    metadata_factory: Callable | None = None
    prompt_factory: Callable | None = None
    image_factory: Callable | None = None
    video_factory: Callable | None = None
    input_form: str | None = None
    num_frames: int = 3
    required_metadata_fields: tuple[str, ...] = ()
    device: str = "cpu"
    image_size: tuple[int, int] = (64, 64)
    atol: float = 1e-5
    rtol: float = 1e-5
    determinism_atol: float = 0.0
    nan_case: Callable | None = None
    max_init_tensor_elements: int = 65_536
    seed: int = 0

    # ------------------------------------------------------------------ helpers
    def _hook(self, attr: str) -> Callable | None:
        raw = inspect.getattr_static(self, attr, None)
        if raw is None:
            return None
        if isinstance(raw, staticmethod | classmethod):
            return getattr(self, attr)
        return raw  # a class or a plain callable stored on the class: call it without binding self

    def make_reward(self):
        factory = self._hook("reward_factory")
        if factory is None:
            raise TypeError(f"{type(self).__name__} must set reward_factory (a class or a staticmethod)")
        return factory()

    def is_group_wise(self) -> bool:
        """Whether the reward under test scores whole groups (asked of a fresh, not set-up instance)."""
        cache = type(self).__dict__.get("_group_wise_cache")
        if cache is None:
            cache = is_group_wise(self.make_reward())
            type(self)._group_wise_cache = cache
        return cache

    def form(self) -> str:
        """The input form the clauses run on: :attr:`input_form`, else images if the reward scores them."""
        if self.input_form is not None:
            return self.input_form
        return "image" if "image" in modalities_of(self.make_reward()) else "video"

    def make_images(self, n: int, g: torch.Generator, form: str | None = None) -> torch.Tensor:
        """(n, 3, H, W) images or (n, F, 3, H, W) videos from the factories, in ``form`` (default :meth:`form`)."""
        h, w = self.image_size
        if (form or self.form()) == "video":
            return (self._hook("video_factory") or default_videos)(n, self.num_frames, h, w, g)
        return (self._hook("image_factory") or default_images)(n, h, w, g)

    def make_inputs(self, n: int, seed: int | None = None, *, group: int = 0):
        """(images (n, 3, H, W) or videos (n, F, 3, H, W) on the CPU, prompts, metadata) from the factories; for a
        group-wise reward the n samples form one group: the factories' entry ``group`` repeated."""
        g = torch.Generator().manual_seed(self.seed if seed is None else seed)
        images = self.make_images(n, g)
        k = n + group if self.is_group_wise() else n
        prompts = (self._hook("prompt_factory") or (lambda m: [_PROMPTS[i % len(_PROMPTS)] for i in range(m)]))(k)
        metadata = (self._hook("metadata_factory") or (lambda m: [{} for _ in range(m)]))(k)
        if self.is_group_wise():
            return images, [prompts[group]] * n, [dict(metadata[group]) for _ in range(n)]
        return images, list(prompts), list(metadata)

    @pytest.fixture(scope="class")
    def reward(self):
        """One reward per test class, set up once on :attr:`device` (setup may be slow)."""
        r = self.make_reward()
        r.setup(torch.device(self.device))
        return r

    def assert_scores(self, scores, n: int) -> torch.Tensor:
        assert isinstance(scores, torch.Tensor), f"a reward must return a torch.Tensor, got {type(scores)}"
        assert scores.shape == (n,), f"expected shape ({n},), got {tuple(scores.shape)}"
        assert scores.dtype == torch.float32, f"expected float32, got {scores.dtype}"
        assert scores.device.type == "cpu", f"scores must be on the CPU, got {scores.device}"
        return scores

    def _close(self, a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
        return bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True))

    # ------------------------------------------------------------------ construction
    def test_follows_protocol(self):
        r = self.make_reward()
        assert isinstance(r, Reward), "a reward needs a `name`, `setup(device)` and `__call__(images, prompts, meta)`"
        assert isinstance(r.name, str) and r.name, f"`name` must be a non-empty string, got {r.name!r}"

    def test_init_loads_no_weights(self, monkeypatch):
        spy = _LoadSpy(monkeypatch)
        r = self.make_reward()
        assert not spy.calls, f"__init__ read weights ({spy.calls}); load them in setup(device)"
        held = _tensor_elements(r, set())
        assert held <= self.max_init_tensor_elements, (
            f"the reward holds {held} tensor elements before setup(); build or load models in setup(device)"
        )

    # ------------------------------------------------------------------ input forms
    def test_modalities_are_declared(self):
        forms = modalities_of(self.make_reward())
        assert set(forms) <= set(MODALITIES) and forms, f"modalities {forms!r}"
        assert self.form() in forms, f"the suite runs on {self.form()!r} inputs, which the reward does not score"

    @pytest.mark.parametrize("form", MODALITIES)
    def test_undeclared_input_forms_are_refused_naming_the_reward(self, reward, form):
        if form in modalities_of(reward):
            pytest.skip(f"the reward scores {form}s")
        _, prompts, metadata = self.make_inputs(2)
        images = self.make_images(2, torch.Generator().manual_seed(self.seed), form)
        with pytest.raises(ValueError, match=re.escape(reward.name)):
            reward(images.to(self.device), prompts, metadata)

    # ------------------------------------------------------------------ output contract
    @pytest.mark.parametrize("n", [1, 3])
    def test_output_shape_dtype_device(self, reward, n):
        images, prompts, metadata = self.make_inputs(n)
        self.assert_scores(reward(images.to(self.device), prompts, metadata), n)

    def test_images_on_cpu_or_device_score_alike(self, reward):
        images, prompts, metadata = self.make_inputs(3)
        a = self.assert_scores(reward(images, prompts, metadata), 3)
        b = self.assert_scores(reward(images.to(self.device), prompts, metadata), 3)
        assert self._close(a, b, self.atol, self.rtol), f"CPU images gave {a}, {self.device} images gave {b}"

    def test_no_nan_unless_documented(self, reward):
        images, prompts, metadata = self.make_inputs(4)
        s = reward(images.to(self.device), prompts, metadata)
        assert not torch.isnan(s).any(), f"NaN on ordinary inputs: {s}; NaN means 'not applicable' (set nan_case)"
        assert torch.isfinite(s).all(), f"infinite scores on ordinary inputs: {s}"

    def test_nan_where_documented(self, reward):
        case = self._hook("nan_case")
        if case is None:
            pytest.skip("the reward documents no NaN case")
        images, prompts, metadata, expected = case()
        s = self.assert_scores(reward(images.to(self.device), prompts, metadata), images.shape[0])
        expected = torch.as_tensor(expected, dtype=torch.bool)
        assert torch.equal(torch.isnan(s), expected), f"NaN at {torch.isnan(s).tolist()}, documented {expected}"

    # ------------------------------------------------------------------ batch structure
    def test_batch_order_equivariance(self, reward):
        n = 5
        images, prompts, metadata = self.make_inputs(n)
        perm = torch.tensor([3, 0, 4, 1, 2])
        s = reward(images.to(self.device), prompts, metadata)
        sp = reward(images[perm].to(self.device), [prompts[i] for i in perm], [metadata[i] for i in perm])
        assert self._close(sp, s[perm], self.atol, self.rtol), f"permuted input scored {sp}, expected {s[perm]}"
        if torch.unique(s).numel() == 1:
            pytest.skip(f"every image scored {float(s[0])}: order equivariance is not observable on these inputs")

    def test_scores_do_not_depend_on_batch(self, reward):
        if self.is_group_wise():
            pytest.skip("a group-wise reward scores relative to its group (see test_group_wise_*)")
        images, prompts, metadata = self.make_inputs(4)
        together = reward(images.to(self.device), prompts, metadata)
        alone = torch.cat([reward(images[i : i + 1].to(self.device), prompts[i : i + 1], metadata[i : i + 1])
                           for i in range(4)])
        assert self._close(together, alone, self.atol, self.rtol), f"batch of 4: {together}, one by one: {alone}"

    # ------------------------------------------------------------------ determinism, threads, inputs untouched
    def test_deterministic(self, reward):
        images, prompts, metadata = self.make_inputs(3)
        a = reward(images.to(self.device), prompts, metadata)
        b = reward(images.to(self.device), prompts, metadata)
        assert self._close(a, b, self.determinism_atol, 0.0), f"two calls on the same input: {a} vs {b}"

    def test_callable_from_worker_thread(self, reward):
        images, prompts, metadata = self.make_inputs(3)
        here = reward(images.to(self.device), prompts, metadata)
        box: dict = {}

        def work():
            try:
                box["scores"] = reward(images.to(self.device), prompts, metadata)
            except BaseException as err:  # noqa: BLE001 - re-raised below in the test thread
                box["error"] = err

        t = threading.Thread(target=work)
        t.start()
        t.join(120)
        if "error" in box:
            raise box["error"]
        assert self._close(box["scores"], here, self.determinism_atol, 0.0), "a worker thread scored differently"

    def test_does_not_modify_inputs(self, reward):
        images, prompts, metadata = self.make_inputs(3)
        images = images.to(self.device)
        kept = (images.clone(), list(prompts), [dict(m) for m in metadata])
        reward(images, prompts, metadata)
        assert torch.equal(images, kept[0]), "the reward modified the images in place"
        assert prompts == kept[1] and metadata == kept[2], "the reward modified the prompts or metadata"

    # ------------------------------------------------------------------ bad input
    @pytest.mark.parametrize("bad", ["one_channel", "no_batch_dim", "not_a_tensor"])
    def test_bad_images_raise_value_error(self, reward, bad):
        images, prompts, metadata = self.make_inputs(2)
        if images.ndim == 5:  # a video: drop channels or the batch dimension of (B, F, 3, H, W)
            wrong = {"one_channel": images[:, :, :1], "no_batch_dim": images[0, 0],
                     "not_a_tensor": images.numpy()}[bad]
        else:
            wrong = {"one_channel": images[:, :1], "no_batch_dim": images[0], "not_a_tensor": images.numpy()}[bad]
        with pytest.raises(ValueError):
            reward(wrong, prompts, metadata)

    @pytest.mark.parametrize("bad", ["uint8", "int64", "bool"])
    def test_non_float_images_raise_value_error_naming_the_reward(self, reward, bad):
        images, prompts, metadata = self.make_inputs(2)
        dtype = {"uint8": torch.uint8, "int64": torch.int64, "bool": torch.bool}[bad]
        wrong = (images * 255).round().to(dtype) if bad != "bool" else images > 0.5
        with pytest.raises(ValueError, match=re.escape(reward.name)):
            reward(wrong.to(self.device), prompts, metadata)

    @pytest.mark.parametrize("bad", ["0_255", "minus1_1", "above_1", "nan"])
    def test_out_of_range_images_raise_value_error_naming_the_reward(self, reward, bad):
        images, prompts, metadata = self.make_inputs(2)
        # the whole batch on another scale, or one pixel of one image outside [0, 1]
        wrong = {"0_255": images * 255, "minus1_1": images * 2 - 1}.get(bad, images.clone())
        extreme = {"0_255": 255.0, "minus1_1": -1.0, "above_1": 1.0 + 1e-6, "nan": float("nan")}[bad]
        wrong[1, 0, 0, 0] = extreme
        with pytest.raises(ValueError, match=re.escape(reward.name)):
            reward(wrong.to(self.device), prompts, metadata)

    def test_length_mismatch_raises_value_error(self, reward):
        images, prompts, metadata = self.make_inputs(3)
        with pytest.raises(ValueError):
            reward(images.to(self.device), prompts[:2], metadata)
        with pytest.raises(ValueError):
            reward(images.to(self.device), prompts, metadata[:2])

    def test_missing_metadata_field_raises_value_error(self, reward):
        if not self.required_metadata_fields:
            pytest.skip("the reward needs no metadata field")
        images, prompts, metadata = self.make_inputs(2)
        for field in self.required_metadata_fields:
            broken = [dict(m) for m in metadata]
            broken[1].pop(field, None)
            with pytest.raises(ValueError, match=field):
                reward(images.to(self.device), prompts, broken)

    # ------------------------------------------------------------------ group-wise rewards
    def test_group_wise_flag_is_a_bool(self):
        flag = getattr(self.make_reward(), "group_wise", False)
        assert isinstance(flag, bool), f"group_wise must be True or False, got {flag!r}"

    def test_group_wise_interleaved_groups_score_as_alone(self, reward):
        if not self.is_group_wise():
            pytest.skip("a point-wise reward")
        a = self.make_inputs(3, seed=self.seed, group=0)
        b = self.make_inputs(3, seed=self.seed + 1, group=1)
        order = torch.tensor([0, 3, 1, 4, 2, 5])  # a0 b0 a1 b1 a2 b2
        images = torch.cat([a[0], b[0]])[order].to(self.device)
        prompts = [(a[1] + b[1])[i] for i in order]
        metadata = [(a[2] + b[2])[i] for i in order]
        group_ids = torch.tensor([0, 1, 0, 1, 0, 1])
        together = self.assert_scores(score_groups(reward, images, prompts, metadata, group_ids), 6)
        alone_a = reward(a[0].to(self.device), a[1], a[2])
        alone_b = reward(b[0].to(self.device), b[1], b[2])
        assert self._close(together[0::2], alone_a, self.atol, self.rtol), f"{together[0::2]} vs {alone_a}"
        assert self._close(together[1::2], alone_b, self.atol, self.rtol), f"{together[1::2]} vs {alone_b}"

    def test_group_wise_composes_and_feeds_gdpo(self, reward):
        if not self.is_group_wise():
            pytest.skip("a point-wise reward")
        images, prompts, metadata = self.make_inputs(4)
        group_ids = torch.zeros(4, dtype=torch.long)
        composed = ComposedReward({"g": reward}, {"g": 1.0})
        with pytest.raises(ValueError, match="group_ids"):
            composed(images.to(self.device), prompts, metadata)
        rewards = composed(images.to(self.device), prompts, metadata, group_ids)
        assert rewards.components["g"].shape == (4,)
        adv = compute_advantages(rewards, group_ids, multi_reward="gdpo")
        assert torch.isfinite(adv.values).all()
