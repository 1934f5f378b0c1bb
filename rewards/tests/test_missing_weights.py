"""Reward weights missing offline: one line naming the reward, the `hf download` command and the config key that
takes a local path; no traceback from the training script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from flowgrpo.rewards.base import MissingWeightsError, hub_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _rewards():
    from flowgrpo_rewards.aesthetic import AestheticReward
    from flowgrpo_rewards.clip_score import ClipScoreReward
    from flowgrpo_rewards.hps import HPSv2Reward
    from flowgrpo_rewards.image_reward import ImageReward
    from flowgrpo_rewards.pickscore import PickScoreReward

    return {
        "hpsv2": (HPSv2Reward, {}, "checkpoint", "hf download xswu/HPSv2 HPS_v2.1_compressed.pt"),
        "pickscore": (PickScoreReward, {}, "checkpoint", "hf download yuvalkirstain/PickScore_v1"),
        "clip_score": (ClipScoreReward, {}, "checkpoint", "hf download openai/clip-vit-large-patch14"),
        "clip_score_dfn5b": (ClipScoreReward, {"variant": "dfn5b"}, "checkpoint",
                             "hf download apple/DFN5B-CLIP-ViT-H-14-378"),
        "aesthetic": (AestheticReward, {}, "mlp_checkpoint", "hf download trl-lib/ddpo-aesthetic-predictor"),
        # the tokenizer comes first: its error when bert-base-uncased is not in the local cache, else the model's
        "image_reward": (ImageReward, {}, ("tokenizer", "model"), (
            "hf download bert-base-uncased", "hf download THUDM/ImageReward ImageReward.pt med_config.json")),
    }


@pytest.mark.parametrize("case", ["hpsv2", "pickscore", "clip_score", "clip_score_dfn5b", "aesthetic", "image_reward"])
def test_each_reward_names_the_download_and_the_config_key(case):
    pytest.importorskip("open_clip")
    cls, kwargs, key, command = _rewards()[case]
    with pytest.raises(MissingWeightsError) as info:
        cls(**kwargs).setup("cpu")
    if isinstance(key, tuple):
        key, command = info.value.key, dict(zip(key, command, strict=True))[info.value.key]
    message = str(info.value)
    assert "\n" not in message
    assert command in message and "--local-dir DIR" in message and f"`{key}: " in message
    assert "huggingface-cli" not in message
    assert info.value.key == key


def test_geneval_detector_names_its_key():
    from flowgrpo_rewards.geneval.detector import Mask2FormerDetector

    with pytest.raises(MissingWeightsError, match=r"hf download facebook/mask2former-swin-small-coco-instance.*"
                                                  r"`detector: DIR`"):
        Mask2FormerDetector().setup("cpu")


def test_local_paths_keep_their_own_error(tmp_path):
    """A missing local file is not a download problem: the original error passes through."""
    with pytest.raises(FileNotFoundError), hub_weights("r", "checkpoint", str(tmp_path / "model")):
        raise FileNotFoundError("no such file")
    with pytest.raises(MissingWeightsError, match=r"`hf download org/model w\.pt --local-dir DIR`"), \
            hub_weights("r", "checkpoint", "org/model", ["w.pt"]):
        raise OSError("offline")


#: the training script, run with its model load replaced by an exit: the reward's weights are checked before the
#: base model is built or loaded (minutes on a fresh machine), so the test does not depend on the machine's speed
SCRIPT = """
import runpy, sys
import flowgrpo.runner

def reached(*args, **kwargs):
    sys.exit("the model load was reached before the reward's weights were checked")

flowgrpo.runner.load_model_from_config = reached
sys.argv = ["flowgrpo/train.py", *sys.argv[1:]]
runpy.run_path("flowgrpo/train.py", run_name="__main__")
"""


def test_the_training_script_ends_in_one_line_naming_the_key(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(  # no wall-clock limit: nothing slow runs before the reward's check
        [sys.executable, "-c", SCRIPT, "rewards=[{name: hpsv2}]", f"output_dir={tmp_path / 'r'}"],
        cwd=REPO, capture_output=True, text=True, env=env,
    )
    assert "the model load was reached" not in proc.stderr
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "reward 'hpsv2'" in errors[0]
    assert "`hf download xswu/HPSv2 HPS_v2.1_compressed.pt --local-dir DIR`" in errors[0]
    assert "`checkpoint: DIR`" in errors[0]
