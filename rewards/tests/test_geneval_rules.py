"""GenEval's verdict rules on synthetic detections, against verdicts computed by hand.

Expected values follow from GenEval's rules as stated in ``evaluation/evaluate_images.py`` of
djghosh13/geneval (threshold > 0.3, > 0.9 for counting, at most 16 per class, include clauses ANDed, exclude
fails at >= count, colour and position on the top ``count`` objects, the 0.1·(size_A + size_B) dead zone and
the ±0.5 rule).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flowgrpo_rewards.geneval.rules import (
    COLORS,
    TASKS,
    Detection,
    ImageDetections,
    RuleConfig,
    box_iou,
    evaluate,
    evaluation_metadata,
    object_names,
    partial_credit,
    relative_position,
    select_objects,
    validate_metadata,
)


def det(x1, y1, x2, y2, score=0.95):
    return Detection((float(x1), float(y1), float(x2), float(y2)), score)


def one_hot_colors(mapping):
    """A colour scorer giving each object of class k the colour mapping[k] (a name, or a list per object)."""
    calls = []

    def score(classname, objects):
        calls.append((classname, len(objects)))
        wanted = mapping[classname]
        names = wanted if isinstance(wanted, list) else [wanted] * len(objects)
        out = np.zeros((len(objects), len(COLORS)))
        for i, name in enumerate(names[: len(objects)]):
            out[i, COLORS.index(name)] = 5.0
        return out

    score.calls = calls
    return score


def no_colors(classname, objects):
    raise AssertionError("the colour classifier must not be called for this prompt")


# ------------------------------------------------------------------------------------------------------------
# Shipped data


def test_shipped_data_is_geneval():
    specs = evaluation_metadata()
    assert len(specs) == 553
    counts = {t: sum(s["tag"] == t for s in specs) for t in TASKS}
    assert counts == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100,
                      "color_attr": 100}
    names = object_names()
    assert len(names) == 80 and names[0] == "person" and names[79] == "toothbrush"
    assert names[64] == "computer mouse"  # COCO index 64 ("mouse" in COCO's own label list)
    for i, spec in enumerate(specs):
        validate_metadata(spec, f"spec {i}")


# ------------------------------------------------------------------------------------------------------------
# Selection


def detections(rows, masks=False):
    """rows: (label, score, box)."""
    boxes = np.array([r[2] for r in rows], dtype=np.float32).reshape(-1, 4)
    return ImageDetections(boxes=boxes, scores=np.array([r[1] for r in rows], dtype=np.float32),
                           labels=np.array([r[0] for r in rows], dtype=np.int64))


def test_select_thresholds_strictly_sorts_and_maps_by_coco_index():
    dets = detections([
        (64, 0.5, (0, 0, 5, 5)),   # computer mouse
        (64, 0.3, (0, 0, 6, 6)),   # float32(0.3): not above 0.3 in float32, as in the original: dropped
        (64, 0.8, (1, 1, 5, 5)),
        (0, 0.31, (2, 2, 9, 9)),   # person, just above
        (5, 0.1, (0, 0, 1, 1)),    # bus, below
    ])
    sel = select_objects(dets, 0.3)
    assert set(sel) == {"computer mouse", "person"}
    assert [d.score for d in sel["computer mouse"]] == pytest.approx([0.8, 0.5])
    assert sel["computer mouse"][0].box == (1.0, 1.0, 5.0, 5.0)
    assert len(sel["person"]) == 1


def test_counting_threshold_is_0_9():
    cfg = RuleConfig()
    assert cfg.threshold_for("counting") == 0.9
    assert all(cfg.threshold_for(t) == 0.3 for t in TASKS if t != "counting")
    dets = detections([(74, 0.95, (0, 0, 5, 5)), (74, 0.92, (10, 0, 15, 5)), (74, 0.5, (20, 0, 25, 5))])
    spec = {"tag": "counting", "include": [{"class": "clock", "count": 2}],
            "exclude": [{"class": "clock", "count": 3}], "prompt": "a photo of two clocks"}
    # at 0.9 the third clock does not count: exactly two -> correct
    v = evaluate(select_objects(dets, cfg.threshold_for("counting")), spec, no_colors)
    assert v.correct and v.reason == ""
    # the same detections at the ordinary 0.3 would be three clocks and fail the exclude clause
    v = evaluate(select_objects(dets, 0.3), spec, no_colors)
    assert not v.correct and v.reason == "expected clock<3, found 3"


def test_at_most_16_per_class():
    dets = detections([(13, 0.4 + 0.01 * i, (i, 0, i + 1, 1)) for i in range(20)])
    sel = select_objects(dets, 0.3)
    assert len(sel["bench"]) == 16
    assert sel["bench"][0].score == pytest.approx(0.59) and sel["bench"][-1].score == pytest.approx(0.44)
    assert len(select_objects(dets, 0.3, max_objects=3)["bench"]) == 3


def test_no_nms_by_default_and_optional_nms():
    same = (0, 0, 9, 9)
    dets = detections([(13, 0.9, same), (13, 0.8, same), (13, 0.7, (50, 50, 59, 59))])
    assert len(select_objects(dets, 0.3)["bench"]) == 3  # duplicates kept: no NMS
    kept = select_objects(dets, 0.3, nms_threshold=0.5)["bench"]
    assert [d.score for d in kept] == pytest.approx([0.9, 0.7])


def test_select_rejects_labels_outside_coco():
    with pytest.raises(ValueError, match="label out of range"):
        select_objects(detections([(80, 0.9, (0, 0, 1, 1))]), 0.3)


# ------------------------------------------------------------------------------------------------------------
# Position


B = (0, 0, 10, 10)  # reference object: centre (5, 5), size (10, 10); dead zone per axis 0.1·(10+10) = 2


@pytest.mark.parametrize(
    ("box_a", "expected"),
    [
        ((20, 0, 30, 10), {"right of"}),  # offset (20, 0): revised (18, 0)/20 → dx 0.9
        ((-20, 0, -10, 10), {"left of"}),
        ((0, -20, 10, -10), {"above"}),  # image y grows downwards
        ((0, 20, 10, 30), {"below"}),
        ((20, 20, 30, 30), {"right of", "below"}),  # (18, 18)/28.28 → 0.636 each
        ((20, 15, 30, 25), {"right of", "below"}),  # offset (20, 15): (18, 13)/25 → 0.72, 0.52
        ((20, 12, 30, 22), {"right of"}),  # offset (20, 12): (18, 10)/23.32 → 0.77, 0.43
        ((12, 20, 22, 30), {"below"}),  # offset (12, 20): (10, 18)/23.32 → 0.43, 0.77
        ((4, 0, 14, 10), set()),  # offset 4: revised 2, 2/4 = 0.5 exactly is not > 0.5
        ((1.5, 0, 11.5, 10), set()),  # offset 1.5 inside the dead zone of 2
        ((0, 0, 10, 10), set()),  # same place
        ((3, 0, 13, 10), set()),  # offset 3: revised 1, 1/3 < 0.5 → none, although outside the dead zone
        ((5, 0, 15, 10), {"right of"}),  # offset 5: revised 3, 3/5 = 0.6 > 0.5
    ],
)
def test_relative_position(box_a, expected):
    assert relative_position(box_a, B) == expected


def test_dead_zone_scales_with_object_sizes():
    # A 40 wide at offset 5: dead zone 0.1·(40 + 10) = 5 → nothing; with threshold 0 → right of (dx = 1)
    a = (5 - 20 + 5, 0, 5 + 20 + 5, 10)
    assert relative_position(a, B) == set()
    assert relative_position(a, B, threshold=0.0) == {"right of"}


# ------------------------------------------------------------------------------------------------------------
# Verdicts per task


def spec(tag, include, exclude=None):
    s = {"tag": tag, "include": include, "prompt": "p"}
    if exclude:
        s["exclude"] = exclude
    return s


def test_single_object():
    s = spec("single_object", [{"class": "bench", "count": 1}])
    assert evaluate({"bench": [det(0, 0, 9, 9)]}, s, no_colors).correct
    v = evaluate({"cow": [det(0, 0, 9, 9)]}, s, no_colors)
    assert not v.correct and v.reason == "expected bench>=1, found 0"


def test_two_object_clauses_are_anded():
    s = spec("two_object", [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}])
    both = {"bench": [det(0, 0, 9, 9)], "sports ball": [det(20, 20, 25, 25)]}
    assert evaluate(both, s, no_colors).correct
    v = evaluate({"bench": [det(0, 0, 9, 9)]}, s, no_colors)
    assert not v.correct and v.reason == "expected sports ball>=1, found 0"
    v = evaluate({}, s, no_colors)
    assert v.reason == "expected bench>=1, found 0\nexpected sports ball>=1, found 0"


def test_counting_include_and_exclude():
    s = spec("counting", [{"class": "handbag", "count": 4}], [{"class": "handbag", "count": 5}])
    bags = [det(10 * i, 0, 10 * i + 5, 5) for i in range(6)]
    assert not evaluate({"handbag": bags[:3]}, s, no_colors).correct  # too few
    assert evaluate({"handbag": bags[:4]}, s, no_colors).correct
    v = evaluate({"handbag": bags[:5]}, s, no_colors)  # exclude: 5 >= 5
    assert not v.correct and v.reason == "expected handbag<5, found 5"


def test_exclude_clause_is_independent_of_include():
    s = spec("counting", [{"class": "cup", "count": 1}],
             [{"class": "cup", "count": 2}, {"class": "fork", "count": 1}])
    assert evaluate({"cup": [det(0, 0, 1, 1)]}, s, no_colors).correct
    v = evaluate({"cup": [det(0, 0, 1, 1)], "fork": [det(5, 5, 6, 6)]}, s, no_colors)
    assert not v.correct and v.reason == "expected fork<1, found 1"


def test_colors_uses_injected_scores_on_top_count_objects():
    s = spec("colors", [{"class": "car", "count": 1, "color": "pink"}])
    cars = [det(0, 0, 9, 9, 0.9), det(20, 0, 29, 9, 0.8)]
    scorer = one_hot_colors({"car": ["pink", "red"]})
    assert evaluate({"car": cars}, s, scorer).correct
    assert scorer.calls == [("car", 1)]  # only the most confident car is classified
    v = evaluate({"car": cars}, s, one_hot_colors({"car": "red"}))
    assert not v.correct and v.reason == "expected pink car>=1, found 0 pink; and 1 red"


def test_colors_argmax_ties_go_to_the_first_colour():
    s = spec("colors", [{"class": "car", "count": 1, "color": "red"}])
    assert evaluate({"car": [det(0, 0, 9, 9)]}, s, lambda k, objs: np.ones((len(objs), 10))).correct


def test_color_scorer_shape_is_checked():
    s = spec("colors", [{"class": "car", "count": 1, "color": "red"}])
    with pytest.raises(ValueError, match=r"\(1, 10\)"):
        evaluate({"car": [det(0, 0, 9, 9)]}, s, lambda k, objs: np.ones((len(objs), 3)))


def test_color_attr():
    s = spec("color_attr", [{"class": "bus", "count": 1, "color": "green"},
                            {"class": "microwave", "count": 1, "color": "purple"}])
    objs = {"bus": [det(0, 0, 9, 9)], "microwave": [det(20, 0, 29, 9)]}
    assert evaluate(objs, s, one_hot_colors({"bus": "green", "microwave": "purple"})).correct
    v = evaluate(objs, s, one_hot_colors({"bus": "green", "microwave": "green"}))
    assert not v.correct and v.reason == "expected purple microwave>=1, found 0 purple; and 1 green"


@pytest.mark.parametrize("relation", ["left of", "right of", "above", "below"])
def test_position_each_relation(relation):
    s = spec("position", [{"class": "teddy bear", "count": 1},
                          {"class": "dog", "count": 1, "position": [relation, 0]}])
    placed = {"left of": (-20, 0, -10, 10), "right of": (20, 0, 30, 10), "above": (0, -20, 10, -10),
              "below": (0, 20, 10, 30)}
    for where, box in placed.items():
        v = evaluate({"teddy bear": [det(*B)], "dog": [det(*box)]}, s, no_colors)
        assert v.correct == (where == relation), (relation, where)
        if where != relation:
            assert v.reason == f"expected dog {relation} target, found {where} target"


def test_position_dead_zone_fails():
    s = spec("position", [{"class": "kite", "count": 1}, {"class": "wine glass", "count": 1,
                                                           "position": ["right of", 0]}])
    v = evaluate({"kite": [det(*B)], "wine glass": [det(1.5, 0, 11.5, 10)]}, s, no_colors)
    assert not v.correct and v.reason == "expected wine glass right of target, found  target"


def test_position_needs_a_passed_target():
    s = spec("position", [{"class": "teddy bear", "count": 1},
                          {"class": "dog", "count": 1, "position": ["right of", 0]}])
    v = evaluate({"dog": [det(20, 0, 30, 10)]}, s, no_colors)
    assert not v.correct
    assert v.reason == "expected teddy bear>=1, found 0\nno target for dog to be right of"


def test_position_checks_every_pair_of_top_count_objects():
    s = spec("position", [{"class": "cat", "count": 2},
                          {"class": "dog", "count": 1, "position": ["right of", 0]}])
    cats = [det(0, 0, 10, 10, 0.9), det(0, 40, 10, 50, 0.8), det(100, 0, 110, 10, 0.7)]  # third: not in top 2
    dog = [det(30, 20, 40, 30)]
    assert evaluate({"cat": cats, "dog": dog}, s, no_colors).correct
    cats[1] = det(50, 40, 60, 50, 0.8)  # now the dog is left of one of the two cats
    assert not evaluate({"cat": cats, "dog": dog}, s, no_colors).correct


# ------------------------------------------------------------------------------------------------------------
# Partial credit


def test_partial_counting_credit():
    s = spec("counting", [{"class": "clock", "count": 3}], [{"class": "clock", "count": 4}])
    clocks = [det(10 * i, 0, 10 * i + 5, 5) for i in range(8)]
    cases = [(0, 0.0), (1, 1 / 3), (2, 2 / 3), (3, 1.0), (4, 2 / 3), (5, 1 / 3), (6, 0.0), (8, 0.0)]
    for found, expected in cases:
        assert partial_credit({"clock": clocks[:found]}, s, no_colors) == pytest.approx(expected), found


def test_partial_two_object_is_mean_over_clauses():
    s = spec("two_object", [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}])
    assert partial_credit({"bench": [det(0, 0, 9, 9)]}, s, no_colors) == pytest.approx(0.5)
    assert partial_credit({"bench": [det(0, 0, 9, 9)], "sports ball": [det(1, 1, 2, 2)]}, s, no_colors) == 1.0


def test_partial_colour_credit_only_at_the_right_count():
    s = spec("colors", [{"class": "car", "count": 1, "color": "pink"}])
    one, two = [det(0, 0, 9, 9)], [det(0, 0, 9, 9), det(20, 0, 29, 9)]
    assert partial_credit({"car": one}, s, one_hot_colors({"car": "pink"})) == 1.0
    # (1 + 0) / 2
    assert partial_credit({"car": one}, s, one_hot_colors({"car": "red"})) == pytest.approx(0.5)
    assert partial_credit({"car": two}, s, one_hot_colors({"car": "pink"})) == 0.0  # count 0, colour withheld
    s2 = spec("colors", [{"class": "car", "count": 2, "color": "pink"}])
    # count right, one of two pink: (1 + 1/2) / 2
    assert partial_credit({"car": two}, s2, one_hot_colors({"car": ["pink", "red"]})) == pytest.approx(0.75)


def test_partial_color_attr():
    s = spec("color_attr", [{"class": "bus", "count": 1, "color": "green"},
                            {"class": "microwave", "count": 1, "color": "purple"}])
    objs = {"bus": [det(0, 0, 9, 9)], "microwave": [det(20, 0, 29, 9)]}
    # bus (1 + 1)/2 = 1, microwave (1 + 0)/2 = 0.5 → 0.75
    scorer = one_hot_colors({"bus": "green", "microwave": "red"})
    assert partial_credit(objs, s, scorer) == pytest.approx(0.75)


def test_partial_position():
    s = spec("position", [{"class": "teddy bear", "count": 1},
                          {"class": "dog", "count": 1, "position": ["right of", 0]}])
    right, wrong = [det(20, 0, 30, 10)], [det(-20, 0, -10, 10)]
    assert partial_credit({"teddy bear": [det(*B)], "dog": right}, s, no_colors) == 1.0
    # teddy 1; dog: count 1, position 0 → 0.5; mean 0.75
    assert partial_credit({"teddy bear": [det(*B)], "dog": wrong}, s, no_colors) == pytest.approx(0.75)
    # no target: teddy 0; dog count 1, position 0 → 0.5; mean 0.25
    assert partial_credit({"dog": right}, s, no_colors) == pytest.approx(0.25)
    # two teddies: teddy count 0 and not satisfied → dog position 0: (0 + 0.5) / 2
    two_teddies = {"teddy bear": [det(*B), det(*B)], "dog": right}
    assert partial_credit(two_teddies, s, no_colors) == pytest.approx(0.25)


def perfect_detections(s):
    """Detections that satisfy spec ``s`` exactly (counts met, positions laid out), with the colours asked."""
    objects, colours = {}, {}
    anchor = (100, 100, 110, 110)
    offsets = {"left of": (-30, 0), "right of": (30, 0), "above": (0, -30), "below": (0, 30)}
    for i, clause in enumerate(s["include"]):
        if "position" in clause:
            dx, dy = offsets[clause["position"][0]]
            boxes = [(anchor[0] + dx, anchor[1] + dy, anchor[2] + dx, anchor[3] + dy)]
        elif i == 0:
            boxes = [(100 + 3 * k, 100, 110 + 3 * k, 110) for k in range(clause["count"])]
        else:
            boxes = [(300 + 20 * k, 300, 310 + 20 * k, 310) for k in range(clause["count"])]
        objects[clause["class"]] = [det(*b) for b in boxes]
        if "color" in clause:
            colours[clause["class"]] = clause["color"]
    return objects, one_hot_colors(colours)


def test_every_evaluation_prompt_is_passed_by_perfect_detections():
    for i, s in enumerate(evaluation_metadata()):
        objects, scorer = perfect_detections(s)
        v = evaluate(objects, s, scorer)
        assert v.correct, (i, s["prompt"], v.reason)
        assert math.isclose(partial_credit(objects, s, scorer), 1.0), (i, s["prompt"])
        assert not evaluate({}, s, scorer).correct


# ------------------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"include": [{"class": "cow", "count": 1}]}, "missing field 'tag'"),
        ({"tag": "single_object"}, "missing field 'include'"),
        ({"tag": "shapes", "include": [{"class": "cow", "count": 1}]}, "unknown tag 'shapes'"),
        ({"tag": "single_object", "include": []}, "non-empty list"),
        ({"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]}, "unknown class 'unicorn'"),
        ({"tag": "single_object", "include": [{"class": "cow", "count": 0}]}, "'count' must be an integer"),
        ({"tag": "single_object", "include": [{"class": "cow"}]}, r"include\[0\]: missing field 'count'"),
        ({"tag": "colors", "include": [{"class": "cow", "count": 1, "color": "teal"}]},
         "unknown color 'teal'"),
        ({"tag": "position", "include": [{"class": "cow", "count": 1, "position": ["above", 0]}]},
         "'position'"),
        ({"tag": "position", "include": [{"class": "cow", "count": 1},
                                         {"class": "dog", "count": 1, "position": ["near", 0]}]},
         "'position'"),
    ],
)
def test_validate_metadata_names_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        validate_metadata(bad, "line 7")
    with pytest.raises(ValueError, match="line 7"):
        validate_metadata(bad, "line 7")


def test_rule_config_rejects_bad_options():
    with pytest.raises(ValueError, match="counting_threshold"):
        RuleConfig(counting_threshold=1.5)
    with pytest.raises(ValueError, match="max_objects"):
        RuleConfig(max_objects=0)


# --------------------------------------------------------------------------------------------------
# Selection order and numeric precision, as the original computes them


def test_equal_scores_are_taken_last_detected_first():
    """The original orders a class's detections by argsort(score)[::-1]; NumPy sorts its (at most 16-element)
    per-class arrays stably, so of two equal scores the later detection comes first, and it is the one a
    count-1 clause checks."""
    boxes = np.array([[300, 0, 310, 10], [200, 0, 210, 10], [100, 0, 110, 10], [50, 0, 60, 10]], dtype=np.float32)
    scores = np.array([0.8, 0.8, 0.5, 0.8], dtype=np.float32)
    dog, cat = object_names().index("dog"), object_names().index("cat")
    dets = ImageDetections(boxes, scores, np.array([dog, dog, cat, dog]))
    objects = select_objects(dets, 0.3)
    assert [o.box[0] for o in objects["dog"]] == [50.0, 200.0, 300.0]  # rows 3, 1, 0
    # "a dog left of a cat": the cat is at x 100-110; row 3 (x 50, left of it) is checked, not row 0 (x 300)
    md = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                         {"class": "dog", "count": 1, "position": ["left of", 0]}]}
    assert evaluate(objects, md, one_hot_colors({})).correct


def test_scores_are_compared_with_the_threshold_in_float32():
    """mmdet's scores are float32: float32(0.3) is not above 0.3 and float32(0.90000004) is above 0.9, even when
    given as float64."""
    eps_above_09 = float(np.nextafter(np.float32(0.9), np.float32(1)))
    dets = ImageDetections(np.zeros((3, 4), np.float32) + [0, 0, 5, 5], np.array([0.3, 0.3000001, eps_above_09]),
                           np.array([0, 0, 0]))
    assert [o.score for o in select_objects(dets, 0.3)["person"]] == [eps_above_09, pytest.approx(0.3000001)]
    assert len(select_objects(dets, 0.9)["person"]) == 1


def official_relative_position_float32(box_a, box_b, threshold=0.1):
    """GenEval's relative_position restated on float32 arrays (the detector's dtype), step by step."""
    boxes = np.array([box_a, box_b], dtype=np.float32).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - np.float32(threshold) * (dim_a + dim_b), np.float32(0)) * np.sign(offset)
    if np.all(np.abs(revised) < np.float32(1e-3)):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    return {name for name, hit in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5),
                                   ("below", dy > 0.5)) if hit}


def near_boundary_boxes(n, seed):
    """Pairs of float32 boxes whose horizontal component dx lies within rounding of 0.5."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        wa, wb = rng.uniform(1, 300, 2)
        norm = rng.uniform(0.2 * (wa + wb) + 1, 600)
        ox = 0.5 * norm + 0.1 * (wa + wb)  # (|ox| - 0.1 (wa + wb)) / norm = 0.5 exactly in real numbers
        if ox >= norm:
            continue
        oy = math.sqrt(norm * norm - ox * ox)
        a = np.float32([ox - wa / 2, oy, ox + wa / 2, oy + 5]).tolist()
        b = np.float32([-wb / 2, 0, wb / 2, 5]).tolist()
        yield a, b


def test_relative_position_is_float32_arithmetic_at_the_boundaries():
    float64_differs = 0
    for a, b in near_boundary_boxes(400, seed=3):
        expected = official_relative_position_float32(a, b)
        assert relative_position(a, b) == expected, (a, b)
        float64_differs += relative_position(np.float64(a), np.float64(b)) != expected  # same: cast inside
        boxes = np.array([a, b], dtype=np.float64).reshape(2, 2, 2)
        off = boxes.mean(axis=-2)[0] - boxes.mean(axis=-2)[1]
        dims = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
        rev = np.maximum(np.abs(off) - 0.1 * dims.sum(axis=0), 0) * np.sign(off)
        float64_differs += bool((rev[0] / np.linalg.norm(off) > 0.5) != ("right of" in expected))
    assert float64_differs > 0  # these cases tell float32 from float64 arithmetic


def test_box_iou_is_the_originals_inclusive_float32_iou():
    rng = np.random.default_rng(4)
    for _ in range(200):
        a = np.sort(rng.uniform(0, 100, (2, 2)), axis=0).T.reshape(-1)[[0, 2, 1, 3]].astype(np.float32)
        b = np.sort(rng.uniform(0, 100, (2, 2)), axis=0).T.reshape(-1)[[0, 2, 1, 3]].astype(np.float32)
        inter_w = max(min(a[2], b[2]) - max(a[0], b[0]) + np.float32(1), np.float32(0))
        inter_h = max(min(a[3], b[3]) - max(a[1], b[1]) + np.float32(1), np.float32(0))
        inter = inter_w * inter_h
        union = (a[2] - a[0] + np.float32(1)) * (a[3] - a[1] + np.float32(1)) + \
            (b[2] - b[0] + np.float32(1)) * (b[3] - b[1] + np.float32(1)) - inter
        assert box_iou(a, b) == float(inter / union)
