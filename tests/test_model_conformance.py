"""Every model adapter runs the shared conformance suite (flowgrpo.models.conformance) on its tiny random
pipeline: registry, pipeline parity, SDE at noise 0, exact on-policy log-probs, LoRA round trip through the
pipeline's loader, one epoch of training with the per_step and chunk strategies.

A new adapter: one case in flowgrpo.models.zoo.CASES and one line here.
"""

from __future__ import annotations

from flowgrpo.models.conformance import AdapterConformance
from flowgrpo.models.zoo import CASES


class TestFlux(AdapterConformance):
    case = CASES["flux"]


class TestSD3(AdapterConformance):
    case = CASES["sd3"]


class TestQwenImage(AdapterConformance):
    case = CASES["qwenimage"]


class TestZImage(AdapterConformance):
    case = CASES["zimage"]


class TestFlux2Klein(AdapterConformance):
    case = CASES["flux2_klein"]


class TestFlux2(AdapterConformance):
    case = CASES["flux2"]


class TestKontext(AdapterConformance):
    case = CASES["kontext"]


class TestQwenImageEditPlus(AdapterConformance):
    case = CASES["qwenimage_edit_plus"]
