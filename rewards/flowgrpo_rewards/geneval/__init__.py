"""GenEval (Ghosh et al. 2023, arXiv 2310.11513): rules, detector, colour classifier, reward, prompts.

Modules: :mod:`.rules` (pure verdict functions on detections), :mod:`.detector` (Mask2Former through
transformers with mmdetection's post-processing), :mod:`.colors` (zero-shot CLIP colours), :mod:`.reward` (the
``geneval`` / ``geneval_strict`` rewards), :mod:`.prompts` (training prompts disjoint from the evaluation set,
``check_overlap``), :mod:`.evaluation` (GenEval's folder layout and summary, used by ``eval/geneval.py``).

``data/`` holds GenEval's 553 evaluation prompts and 80 object names from djghosh13/geneval (commit af4902f),
under the MIT licence in ``data/LICENSE``.
"""
