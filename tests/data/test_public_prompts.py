"""``flowgrpo push`` against a local stand-in of the Hub API (127.0.0.1, never the network), and
``flowgrpo prompts`` on small fixtures in the public datasets' own file formats."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flowgrpo.cli import main as cli_main


# ------------------------------------------------------------------ a stand-in of the Hub's HTTP API
class _Hub(BaseHTTPRequestHandler):
    """The four endpoints a commit of small files touches: create repo, validate the card's YAML, preupload
    (every file 'regular', so its bytes travel base64 inside the commit) and the NDJSON commit."""

    repos: dict[str, dict[str, bytes]] = {}
    private: dict[str, bool] = {}
    calls: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the http.server API; repo_info: /api/models/<org>/<name>
        path = self.path.split("?")[0]
        self.calls.append(path)
        repo = "/".join(path.split("/")[3:5])
        if not path.startswith("/api/models/") or repo not in self.repos:
            return self._reply(404, {"error": "Repository not found"})
        return self._reply(200, {"id": repo, "modelId": repo, "private": self.private[repo], "sha": "abc",
                                 "visibility": "private" if self.private[repo] else "public"})

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = self.path.split("?")[0]
        self.calls.append(path)
        if path == "/api/repos/create":
            req = json.loads(body)
            repo = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
            if repo not in self.repos:
                self.repos[repo] = {}
                self.private[repo] = bool(req.get("private")) or req.get("visibility") == "private"  # old / new
            return self._reply(200, {"url": f"http://{self.headers['Host']}/{repo}"})
        if path == "/api/validate-yaml":
            return self._reply(200, {})
        parts = path.split("/")  # /api/models/<org>/<name>/<preupload|commit>/<revision>
        repo = f"{parts[3]}/{parts[4]}"
        if repo not in self.repos:
            return self._reply(404, {"error": "Repository not found"})
        if parts[5] == "preupload":
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if parts[5] == "commit":
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.repos[repo][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return self._reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/abc",
                                     "commitOid": "abc"})
        return self._reply(404, {"error": path})


@pytest.fixture
def hub(monkeypatch):
    """A stand-in Hub on loopback, with the session's offline mode (the root conftest's HF_HUB_OFFLINE) lifted for
    the test: huggingface_hub reads it from ``constants.HF_HUB_OFFLINE`` at each request."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    _Hub.repos, _Hub.private, _Hub.calls = {}, {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_push_uploads_weights_and_card(tmp_path, hub, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    run = tmp_path / "run"
    weights = run / "lora"
    weights.mkdir(parents=True)
    files = {"pytorch_lora_weights.safetensors": bytes(range(256)) * 4,
             "README.md": b"---\nlibrary_name: diffusers\n---\n# card\n", "reward_curve.png": b"\x89PNG fake"}
    for name, data in files.items():
        (weights / name).write_bytes(data)
    (run / "metrics.jsonl").write_text("{}\n")  # not part of the upload
    cli_main(["push", str(run), "me/flux-rl", "--endpoint", hub, "--token", "hf_test"])
    assert _Hub.repos == {"me/flux-rl": files}
    assert _Hub.calls[0] == "/api/repos/create"


def test_push_refuses_a_folder_without_weights(tmp_path, hub):
    with pytest.raises(SystemExit, match="no lora/ or transformer/"):
        cli_main(["push", str(tmp_path), "me/x", "--endpoint", hub, "--token", "t"])


def _a_run(tmp_path):
    weights = tmp_path / "run" / "lora"
    weights.mkdir(parents=True)
    (weights / "pytorch_lora_weights.safetensors").write_bytes(b"w")
    return tmp_path / "run"


def test_push_private_honoured_or_refused(tmp_path, hub, monkeypatch):
    """--private creates the repository private, and refuses an existing public one (create_repo with exist_ok
    leaves its visibility as it is: the weights would have gone public)."""
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    run = _a_run(tmp_path)
    cli_main(["push", str(run), "me/new", "--endpoint", hub, "--token", "t", "--private"])
    assert _Hub.private["me/new"] is True and _Hub.repos["me/new"]
    cli_main(["push", str(run), "me/public", "--endpoint", hub, "--token", "t"])
    _Hub.repos["me/public"] = {}
    with pytest.raises(SystemExit, match="--private, but the Hub repository 'me/public' exists and is public; "
                                         "nothing was uploaded"):
        cli_main(["push", str(run), "me/public", "--endpoint", hub, "--token", "t", "--private"])
    assert _Hub.repos["me/public"] == {}


def test_push_offline_or_unreachable_is_one_line(tmp_path, monkeypatch, capsys):
    hf = pytest.importorskip("huggingface_hub")
    run = _a_run(tmp_path)
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as err:
        cli_main(["push", str(run), "me/x", "--token", "t"])
    assert str(err.value) == ("flowgrpo push: the Hugging Face Hub cannot be reached: offline mode is on "
                              "(HF_HUB_OFFLINE=1); unset it to push")
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", False)
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(SystemExit, match=rf"^flowgrpo push: {dead} cannot be reached \(\w*ConnectError"):
        cli_main(["push", str(run), "me/x", "--token", "t", "--endpoint", dead])


def test_geneval_seed_is_honoured(tmp_path):
    pytest.importorskip("flowgrpo_rewards.geneval.prompts")
    for seed in (0, 1):
        cli_main(["prompts", "geneval", "--out", str(tmp_path / f"s{seed}.jsonl"), "--per-task", "4", "--seed",
                  str(seed)])
    assert _lines(tmp_path / "s0.jsonl") != _lines(tmp_path / "s1.jsonl")


# ------------------------------------------------------------------ prompt files
def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_hpd_prompts_from_train_test_and_benchmark_files(tmp_path):
    train = [  # HPDv2 train.json: human_preference, prompt, file_path
        {"human_preference": [1, 0], "prompt": "A cat on a sofa ", "file_path": ["train/0.jpg", "train/1.jpg"]},
        {"human_preference": [0, 1], "prompt": "A cat on a sofa", "file_path": ["train/2.jpg", "train/3.jpg"]},
        {"human_preference": [1, 0], "prompt": "An  old lighthouse\nat dusk", "file_path": ["a.jpg", "b.jpg"]},
    ]
    test = [  # HPDv2 test.json: prompt, image_path, rank, raw_annotations
        {"prompt": "A red fox", "image_path": ["test/0.jpg", "test/1.jpg"], "rank": [1, 2],
         "raw_annotations": [{"rank": [1, 2], "user_hash": "x"}]},
    ]
    (tmp_path / "train.json").write_text(json.dumps(train))
    (tmp_path / "test.json").write_text(json.dumps(test))
    (tmp_path / "anime.json").write_text(json.dumps(["A girl with a sword", "A red fox"]))  # benchmark: strings
    out = tmp_path / "data" / "hpd_train.txt"
    cli_main(["prompts", "hpd", str(tmp_path / "train.json"), "--out", str(out)])
    assert _lines(out) == ["A cat on a sofa", "An old lighthouse at dusk"]
    cli_main(["prompts", "hpd", str(tmp_path / "test.json"), str(tmp_path / "anime.json"), "--out", str(out)])
    assert _lines(out) == ["A red fox", "A girl with a sword"]


def test_pickapic_captions_from_parquet_once_each(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({  # a Pick-a-Pic shard: one row per image pair; the caption repeats
        "are_different": [True, True, True], "best_image_uid": ["u0", "u2", "u4"],
        "caption": ["a corgi astronaut", "a corgi astronaut", "a castle made of cheese"],
        "has_label": [True, True, True], "image_0_uid": ["u0", "u2", "u4"], "image_1_uid": ["u1", "u3", "u5"],
        "jpg_0": [b"\xff\xd8", b"\xff\xd8", b"\xff\xd8"], "jpg_1": [b"\xff\xd8", b"\xff\xd8", b"\xff\xd8"],
        "label_0": [1.0, 0.5, 0.0], "label_1": [0.0, 0.5, 1.0], "model_0": ["sdxl"] * 3, "model_1": ["sd2"] * 3,
    })
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    out = tmp_path / "pickscore_train.txt"
    cli_main(["prompts", "pickapic", str(tmp_path / "train-00000-of-00001.parquet"), "--out", str(out)])
    assert _lines(out) == ["a corgi astronaut", "a castle made of cheese"]


def test_pickapic_captions_from_jsonl_export(tmp_path):
    src = tmp_path / "validation_unique.jsonl"
    src.write_text("".join(json.dumps({"caption": c, "ranking_id": i}) + "\n" for i, c in enumerate(["b", "a", "b"])))
    out = tmp_path / "pickscore_test.txt"
    cli_main(["prompts", "pickapic", str(src), "--out", str(out)])
    assert _lines(out) == ["b", "a"]


def test_ocr_prompts_keep_only_quoted_targets(tmp_path, caplog):
    src = tmp_path / "ocr.txt"
    src.write_text('A neon sign that says "OPEN"\nA beach at sunset\nA mug printed with ""\n'
                   'A poster reading "Hello World"\n')
    out = tmp_path / "ocr_train.txt"
    with caplog.at_level("WARNING"):
        cli_main(["prompts", "ocr", str(src), "--out", str(out)])
    assert _lines(out) == ['A neon sign that says "OPEN"', 'A poster reading "Hello World"']
    assert "dropped 2 of 4" in caplog.text


def test_geneval_prompts_are_generated_specs(tmp_path):
    pytest.importorskip("flowgrpo_rewards.geneval.prompts")
    out = tmp_path / "geneval_train.jsonl"
    cli_main(["prompts", "geneval", "--out", str(out), "--per-task", "3"])
    specs = [json.loads(line) for line in _lines(out)]
    assert len(specs) == 15  # five training tasks × 3
    assert all("prompt" in s and "tag" in s and "include" in s for s in specs)
