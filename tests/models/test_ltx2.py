"""LTX-2 text-to-video (``LTX2Pipeline``) through the shared adapter conformance suite: the sampled state is the
joint (video, audio) latents, compared with the pipeline's own video and audio latents after every step."""

from __future__ import annotations

from flowgrpo.models.zoo import CASES
from flowgrpo.testing.adapters import AdapterConformance


class TestLTX2(AdapterConformance):
    case = CASES["ltx2"]
