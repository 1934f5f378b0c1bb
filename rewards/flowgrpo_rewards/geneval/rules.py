"""GenEval's verdict rules as pure functions on detections.

GenEval (Ghosh, Hajishirzi & Schmidt, "GenEval: An Object-Focused Framework for Evaluating Text-to-Image
Alignment", NeurIPS 2023 Datasets and Benchmarks, arXiv 2310.11513) scores an image by detecting objects and
checking the prompt's clauses. This module reproduces the rules of the benchmark's own scorer,
``evaluation/evaluate_images.py`` in djghosh13/geneval, with its default options:

* **Selection** (:func:`select_objects`): per class, detections with score **strictly above** 0.3 (0.9
  when the prompt's tag is ``counting``), most confident first, at most 16 per class; non-maximum
  suppression is off (IoU threshold 1.0) unless asked for.
* **Numeric precision**: the original works on mmdet's float32 detection arrays, so scores are compared with
  the thresholds in float32, and box centres, sizes, offsets, norms and IoUs are float32 arithmetic here too
  (a float64 re-computation flips relations whose components lie within float32 rounding of a boundary).
* **Include clauses** are ANDed: a clause ``{class, count}`` needs at least ``count`` detections of the class.
  Colour and position are checked only on the ``count`` most confident of them.
* **Colour**: each of those objects is classified among :data:`COLORS` (zero-shot CLIP, see
  :mod:`flowgrpo_rewards.geneval.colors`); all ``count`` must get the asked colour.
* **Position** (:func:`relative_position`): every one of the clause's objects must stand in the asked relation
  to every object of the target clause, and the target clause must itself have passed.
* **Exclude clauses**: ``{class, count}`` fails when the number of selected detections of the class is
  ``>= count`` (how the counting task rejects too many objects).

Nothing here loads a model: the detector output comes in as :class:`ImageDetections`, and colours come from
an injected ``color_scores(classname, objects) -> (N, 10)`` function, so every rule is testable by hand.

:func:`partial_credit` is a dense variant for use as a training reward (Flow-GRPO's GenEval reward,
Liu et al. 2025, arXiv 2505.05470, reward server ``gen_eval.py``), defined in its docstring.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np

#: GenEval's ten colour names, in the original's order (the order decides ties in the arg-max).
COLORS: tuple[str, ...] = (
    "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
)
#: The four position relations of GenEval's position task.
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
#: The six GenEval tasks (the ``tag`` of a prompt), in the benchmark's order.
TASKS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

#: ``color_scores(classname, objects) -> (len(objects), len(COLORS))`` scores; the arg-max is the colour.
ColorScorer = Callable[[str, Sequence["Detection"]], np.ndarray]


@dataclass(frozen=True)
class RuleConfig:
    """The options of the original scorer (its ``--options key=value``), defaulting to its defaults.

    Attributes:
        threshold: keep detections with score > this (original ``threshold``, 0.3).
        counting_threshold: the same for prompts tagged ``counting`` (original ``counting_threshold``, 0.9).
        max_objects: at most this many detections per class, most confident first (``max_objects``, 16).
        nms_threshold: greedy per-class NMS drops boxes with IoU >= this; 1.0 turns it off (``max_overlap``).
        position_threshold: dead-zone factor of :func:`relative_position` (``position_threshold``, 0.1).
    """

    threshold: float = 0.3
    counting_threshold: float = 0.9
    max_objects: int = 16
    nms_threshold: float = 1.0
    position_threshold: float = 0.1

    def __post_init__(self) -> None:
        for name in ("threshold", "counting_threshold"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if self.max_objects < 1:
            raise ValueError(f"max_objects must be >= 1, got {self.max_objects}")
        if not 0.0 < self.nms_threshold <= 1.0:
            raise ValueError(f"nms_threshold must be in (0, 1] (1 = no NMS), got {self.nms_threshold}")
        if self.position_threshold < 0:
            raise ValueError(f"position_threshold must be >= 0, got {self.position_threshold}")

    def threshold_for(self, tag: str) -> float:
        """The detection threshold for a prompt with this ``tag`` (0.9 for ``counting``, else 0.3)."""
        return self.counting_threshold if tag == "counting" else self.threshold


@dataclass(frozen=True)
class Detection:
    """One detected object.

    Attributes:
        box: (x1, y1, x2, y2) in pixels of the original image; x2, y2 one past the last mask pixel (mmdet's
            ``mask2bbox`` convention).
        score: detection confidence in [0, 1].
        mask: (H, W) bool instance mask at the image's size, or None (colour crops then use the whole box).
    """

    box: tuple[float, float, float, float]
    score: float
    mask: np.ndarray | None = None


@dataclass(frozen=True)
class ImageDetections:
    """A detector's raw output for one image, before GenEval's selection.

    Attributes:
        boxes: (N, 4) float32, (x1, y1, x2, y2) pixels.
        scores: (N,) float32 in [0, 1].
        labels: (N,) int64 COCO class index in [0, 80), the row of ``object_names.txt``.
        masks: (N, H, W) bool, or None.
    """

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    masks: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.scores)
        if self.boxes.shape != (n, 4) or self.labels.shape != (n,):
            raise ValueError(
                f"detections disagree on N: boxes {self.boxes.shape}, scores {self.scores.shape}, "
                f"labels {self.labels.shape}"
            )
        if self.masks is not None and (self.masks.ndim != 3 or self.masks.shape[0] != n):
            raise ValueError(f"masks must be (N={n}, H, W), got {self.masks.shape}")


@dataclass(frozen=True)
class Verdict:
    """GenEval's verdict on one image: ``correct``, and the failed checks one per line (empty if correct)."""

    correct: bool
    reason: str


# --------------------------------------------------------------------------------------------------
# Data shipped with the package (GenEval, MIT licence: data/LICENSE)


@functools.cache
def object_names() -> tuple[str, ...]:
    """GenEval's 80 object names; row i is COCO class index i (``data/object_names.txt``)."""
    text = resources.files(__package__).joinpath("data", "object_names.txt").read_text(encoding="utf-8")
    names = tuple(line.strip() for line in text.splitlines() if line.strip())
    if len(names) != 80:
        raise RuntimeError(f"object_names.txt should list 80 COCO names, found {len(names)}")
    return names


def evaluation_metadata() -> list[dict]:
    """GenEval's 553 evaluation prompts as dicts (``tag``, ``include``, optional ``exclude``, ``prompt``),
    in the benchmark's order (``data/evaluation_metadata.jsonl``); the list index is the prompt's folder
    index."""
    path = resources.files(__package__).joinpath("data", "evaluation_metadata.jsonl")
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------------
# Metadata validation


def validate_metadata(metadata: Mapping, where: str = "metadata") -> None:
    """Raise ``ValueError`` naming ``where`` and the bad field unless ``metadata`` is a valid GenEval spec.

    Valid: ``tag`` one of :data:`TASKS`; ``include`` a non-empty list of clauses ``{"class": one of the 80
    object names, "count": int >= 1}``, optionally ``"color"`` (one of :data:`COLORS`) and ``"position"``
    (``[relation, j]`` with relation in :data:`RELATIONS` and j the index of an earlier include clause);
    ``exclude`` (optional) a list of ``{"class", "count"}`` clauses.
    """
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(metadata).__name__}")
    for key in ("tag", "include"):
        if key not in metadata:
            raise ValueError(f"{where}: missing field {key!r} (GenEval metadata needs 'tag' and 'include')")
    if metadata["tag"] not in TASKS:
        raise ValueError(f"{where}: unknown tag {metadata['tag']!r}; allowed: {list(TASKS)}")
    include = metadata["include"]
    if not isinstance(include, list) or not include:
        raise ValueError(f"{where}: 'include' must be a non-empty list of clauses, got {include!r}")
    names = set(object_names())
    clause_lists = [("include", include)]
    if "exclude" in metadata:
        if not isinstance(metadata["exclude"], list):
            raise ValueError(f"{where}: 'exclude' must be a list of clauses, got {metadata['exclude']!r}")
        clause_lists.append(("exclude", metadata["exclude"]))
    for kind, clauses in clause_lists:
        for i, clause in enumerate(clauses):
            at = f"{where}: {kind}[{i}]"
            if not isinstance(clause, Mapping):
                raise ValueError(f"{at} must be an object, got {clause!r}")
            for key in ("class", "count"):
                if key not in clause:
                    raise ValueError(f"{at}: missing field {key!r}")
            if clause["class"] not in names:
                raise ValueError(
                    f"{at}: unknown class {clause['class']!r}; allowed: the 80 names of object_names()"
                )
            count = clause["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"{at}: 'count' must be an integer >= 1, got {count!r}")
            if kind == "exclude":
                continue
            if "color" in clause and clause["color"] not in COLORS:
                raise ValueError(f"{at}: unknown color {clause['color']!r}; allowed: {list(COLORS)}")
            if "position" in clause:
                pos = clause["position"]
                ok = isinstance(pos, (list, tuple)) and len(pos) == 2 and pos[0] in RELATIONS
                if not ok or isinstance(pos[1], bool) or not isinstance(pos[1], int) or not 0 <= pos[1] < i:
                    raise ValueError(
                        f"{at}: 'position' must be [relation, j] with relation in {list(RELATIONS)} and j "
                        f"the index of an earlier include clause (0..{i - 1}), got {pos!r}"
                    )


# --------------------------------------------------------------------------------------------------
# Selection of detections


def box_iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """IoU of two (x1, y1, x2, y2) boxes with the original's inclusive-pixel convention (width = x2 − x1 + 1),
    in float32 arithmetic as the original computes it on the detector's float32 boxes.

    Used only by the optional NMS (off by default), as in ``compute_iou`` of GenEval's scorer.
    """
    a = np.asarray(box_a[:4], dtype=np.float32)
    b = np.asarray(box_b[:4], dtype=np.float32)
    one, zero = np.float32(1), np.float32(0)

    def area(x1, y1, x2, y2):
        return max(x2 - x1 + one, zero) * max(y2 - y1 + one, zero)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a) + area(*b) - inter
    return float(inter / union) if union else 0.0


def select_objects(
    detections: ImageDetections, threshold: float, *, max_objects: int = 16, nms_threshold: float = 1.0,
    classnames: Sequence[str] | None = None,
) -> dict[str, list[Detection]]:
    """GenEval's selection: per class, score > ``threshold``, most confident first, at most ``max_objects``.

    As the original: scores are float32 (the detector's dtype; other dtypes are cast) and compared with the
    threshold in float32, so a score equal to float32(0.3) is not above 0.3. The order is the original's
    ``argsort(scores)[::-1]`` over the class's detections in detector order: equal scores come last-detected
    first. (NumPy's default sort is stable on arrays of at most 16 elements and may order ties otherwise on
    longer ones; a stable sort is used here for any length, so ties are deterministic.)

    Detector labels are mapped to names by COCO index (``classnames[label]``, default :func:`object_names`),
    never by the detector's own label strings. With ``nms_threshold < 1`` a greedy per-class NMS then drops
    every later box whose :func:`box_iou` with a kept one is >= ``nms_threshold`` (after the cap, as in the
    original).

    Returns:
        ``{classname: [Detection, ...]}`` sorted by descending score; classes with no detection are absent.

    Raises:
        ValueError: a label outside ``[0, len(classnames))``.
    """
    names = object_names() if classnames is None else tuple(classnames)
    labels = np.asarray(detections.labels)
    if labels.size and (labels.min() < 0 or labels.max() >= len(names)):
        raise ValueError(f"detector label out of range [0, {len(names)}): {labels.min()}..{labels.max()}")
    scores = np.asarray(detections.scores, dtype=np.float32)
    selected: dict[str, list[Detection]] = {}
    for index, name in enumerate(names):
        rows = np.flatnonzero(labels == index)  # the class's detections in detector order
        rows = rows[np.argsort(scores[rows], kind="stable")[::-1]]  # descending; ties: later detection first
        rows = rows[scores[rows] > np.float32(threshold)][:max_objects].tolist()
        if not rows:
            continue
        kept: list[int] = []
        while rows:
            best = rows.pop(0)
            kept.append(best)
            if nms_threshold < 1.0:
                best_box = detections.boxes[best]
                rows = [r for r in rows if box_iou(best_box, detections.boxes[r]) < nms_threshold]
        selected[name] = [
            Detection(
                box=tuple(float(v) for v in detections.boxes[r]),
                score=float(scores[r]),
                mask=None if detections.masks is None else detections.masks[r],
            )
            for r in kept
        ]
    return selected


# --------------------------------------------------------------------------------------------------
# Position and colour


def relative_position(box_a: Sequence[float], box_b: Sequence[float], threshold: float = 0.1) -> set[str]:
    """The relations of object A to object B (``relative_position`` of GenEval's scorer), in float32.

    With centres c = ((x1+x2)/2, (y1+y2)/2), sizes s = (x2−x1, y2−y1) and offset o = c_A − c_B (image y grows
    downwards), the dead-zone-reduced offset is r = sign(o)·max(|o| − threshold·(s_A + s_B), 0) per axis.
    If both |r| < 1e-3 the objects overlap and no relation holds; otherwise (dx, dy) = r / ‖o‖ and
    dx < −0.5 → "left of", dx > 0.5 → "right of", dy < −0.5 → "above", dy > 0.5 → "below" (a diagonal
    offset can give two relations, or none when neither component exceeds half the distance).

    Returns:
        a subset of :data:`RELATIONS`.
    """
    a = np.asarray(box_a[:4], dtype=np.float32).reshape(2, 2)  # float32 throughout, as the original
    b = np.asarray(box_b[:4], dtype=np.float32).reshape(2, 2)
    offset = a.mean(axis=0) - b.mean(axis=0)
    size_a, size_b = a[1] - a[0], b[1] - b[0]
    dead_zone = np.float32(threshold) * (np.abs(size_a) + np.abs(size_b))
    revised = np.maximum(np.abs(offset) - dead_zone, 0.0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def classify_colors(color_scores: ColorScorer, classname: str, objects: Sequence[Detection]) -> list[str]:
    """Arg-max colour name of each object under ``color_scores`` (first colour of :data:`COLORS` on a tie).

    Raises:
        ValueError: the scorer returned something other than (len(objects), 10).
    """
    scores = np.asarray(color_scores(classname, objects))
    if scores.shape != (len(objects), len(COLORS)):
        raise ValueError(
            f"color_scores must return ({len(objects)}, {len(COLORS)}) scores for {classname!r}, "
            f"got {scores.shape}"
        )
    return [COLORS[int(i)] for i in scores.argmax(axis=1)]


def _cached(color_scores: ColorScorer) -> Callable[[str, Sequence[Detection]], list[str]]:
    """Colour names per (class, number of objects), computed once per image (objects come sorted)."""
    cache: dict[tuple[str, int], list[str]] = {}

    def colors_of(classname: str, objects: Sequence[Detection]) -> list[str]:
        key = (classname, len(objects))
        if key not in cache:
            cache[key] = classify_colors(color_scores, classname, objects)
        return cache[key]

    return colors_of


# --------------------------------------------------------------------------------------------------
# Verdicts


def _position_failure(name: str, relation: str, found: Sequence[Detection], targets: Sequence[Detection],
                      threshold: float) -> str | None:
    """The original's reason for the first (object, target) pair, objects then targets in order, whose
    :func:`relative_position` (dead-zone factor ``threshold``) lacks ``relation``; None when every pair has it."""
    for obj in found:
        for target_obj in targets:
            actual = relative_position(obj.box, target_obj.box, threshold)
            if relation not in actual:
                return f"expected {name} {relation} target, found {' and '.join(sorted(actual))} target"
    return None


def evaluate(
    objects: Mapping[str, Sequence[Detection]], metadata: Mapping, color_scores: ColorScorer,
    position_threshold: float = 0.1,
) -> Verdict:
    """GenEval's verdict on one image (``evaluate`` of the original scorer).

    Args:
        objects: :func:`select_objects` output, each list sorted by descending score.
        metadata: the prompt's spec (validated with :func:`validate_metadata`).
        color_scores: colour classifier, called only for clauses with a colour whose count is met.
        position_threshold: dead-zone factor of :func:`relative_position`.

    Returns:
        :class:`Verdict`; ``reason`` lists every failed check in the original's wording, one per line.

    Raises:
        ValueError: invalid ``metadata``.
    """
    validate_metadata(metadata)
    colors_of = _cached(color_scores)
    correct = True
    reasons: list[str] = []
    passed_groups: list[Sequence[Detection] | None] = []  # per include clause: its objects if it passed
    for clause in metadata["include"]:
        name, count = clause["class"], clause["count"]
        found = list(objects.get(name, []))[:count]
        passed = True
        if len(found) < count:
            passed = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in clause:
                colors = colors_of(name, found)
                hits = colors.count(clause["color"])
                if hits < count:
                    passed = False
                    histogram = ", ".join(f"{colors.count(c)} {c}" for c in COLORS if c in colors)
                    reasons.append(f"expected {clause['color']} {name}>={count}, found {hits} "
                                   f"{clause['color']}; and {histogram}")
            if "position" in clause and passed:
                relation, target = clause["position"]
                targets = passed_groups[target]
                if targets is None:
                    passed = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    failure = _position_failure(name, relation, found, targets, position_threshold)
                    if failure is not None:
                        passed = False
                        reasons.append(failure)
        correct = correct and passed
        passed_groups.append(found if passed else None)
    for clause in metadata.get("exclude", []):
        name, count = clause["class"], clause["count"]
        n = len(objects.get(name, []))
        if n >= count:
            correct = False
            reasons.append(f"expected {name}<{count}, found {n}")
    return Verdict(correct, "\n".join(reasons))


def partial_credit(
    objects: Mapping[str, Sequence[Detection]], metadata: Mapping, color_scores: ColorScorer,
    position_threshold: float = 0.1,
) -> float:
    """Dense GenEval score in [0, 1] for training: the mean over include clauses of a clause credit.

    For a clause asking for N_req objects of a class of which N_found were selected (all of them, not only the
    top N_req), the credits are (after Flow-GRPO's reward server, arXiv 2505.05470):

    * count: max(0, 1 − |N_found − N_req| / N_req) (clipped at 0, so the score stays in [0, 1]; Flow-GRPO
      leaves it unclipped, which goes negative when N_found > 2·N_req);
    * colour (clauses with a colour): (objects classified the asked colour) / N_req when N_found = N_req,
      else 0;
    * position (clauses with a position): 1 when N_found = N_req, the target clause is satisfied and every
      (object, target object) pair is in the asked relation, else 0;

    and the clause credit is the mean of the credits the clause has (one to three). A clause is *satisfied*
    (can serve as a position target) when N_found = N_req and its colour and position credits, if any, are 1.
    Exclude clauses are not used: the count credit already penalises surplus objects. This differs from
    Flow-GRPO, which averages the flat list of all credits of all clauses; averaging per clause first weighs
    every clause of the prompt equally.

    Returns:
        a float in [0, 1]; 1 exactly when every clause is satisfied.

    Raises:
        ValueError: invalid ``metadata``.
    """
    validate_metadata(metadata)
    colors_of = _cached(color_scores)
    clause_credits: list[float] = []
    satisfied: list[Sequence[Detection] | None] = []
    for clause in metadata["include"]:
        name, required = clause["class"], clause["count"]
        found = list(objects.get(name, []))
        exact = len(found) == required
        parts = [max(0.0, 1.0 - abs(len(found) - required) / required)]
        ok = exact
        if "color" in clause:
            color_credit = colors_of(name, found).count(clause["color"]) / required if exact else 0.0
            parts.append(color_credit)
            ok = ok and color_credit == 1.0
        if "position" in clause:
            relation, target = clause["position"]
            targets = satisfied[target]
            position_ok = exact and targets is not None and all(
                relation in relative_position(obj.box, t.box, position_threshold)
                for obj in found
                for t in targets
            )
            parts.append(1.0 if position_ok else 0.0)
            ok = ok and position_ok
        clause_credits.append(math.fsum(parts) / len(parts))
        satisfied.append(found if ok else None)
    return math.fsum(clause_credits) / len(clause_credits)


def details(objects: Mapping[str, Sequence[Detection]]) -> dict[str, list[list[float]]]:
    """``{classname: [[x1, y1, x2, y2, score], ...]}``: the ``details`` field of a GenEval result line."""
    return {name: [[*obj.box, obj.score] for obj in objs] for name, objs in objects.items()}
