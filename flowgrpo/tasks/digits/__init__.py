"""The embedded digits task: the digits, their splits and prompts (:mod:`.data`), a small FLUX-architecture model
drawing handwritten digits (:mod:`.model`), the
reward classifier, the independent judge and the diversity measures (:mod:`.scoring`), and the per-digit table of
the end-of-run report (:mod:`.report`). Its rewards, ``digit_correctness`` and ``digit_judge``, are entry points
of the flowgrpo-rewards distribution."""
