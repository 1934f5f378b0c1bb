"""``flowgrpo push`` against a local stand-in of the Hub API (127.0.0.1, never the network): the weights and the
card uploaded, --private honoured or refused, a folder without weights and an unreachable Hub one line each."""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flowgrpo.cli import main as cli_main


def refused(capsys, argv: list[str]) -> str:
    """``flowgrpo push`` with ``argv`` refused as every command refuses: exit status 2 and one line
    ``flowgrpo push: error: …`` on stderr; returns what follows the prefix."""
    with pytest.raises(SystemExit) as err:
        cli_main(["push", *argv])
    line = capsys.readouterr().err
    assert err.value.code == 2 and line.startswith("flowgrpo push: error: ") and line.count("\n") == 1, line
    return line.removeprefix("flowgrpo push: error: ").rstrip("\n")


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


def test_push_refuses_a_folder_without_weights(tmp_path, hub, capsys):
    assert "no lora/ or transformer/" in refused(capsys, [str(tmp_path), "me/x", "--endpoint", hub, "--token", "t"])


def test_push_of_a_folder_that_does_not_exist_says_so(tmp_path, hub, capsys):
    """Not "holds no lora/ or transformer/ folder": the folder is not there (a typo), and a file is not a folder."""
    gone = tmp_path / "runs" / "tpyo"
    assert refused(capsys, [str(gone), "me/x", "--endpoint", hub, "--token", "t"]).startswith(
        f"{str(gone)!r} does not exist; give a run folder")
    (tmp_path / "f").write_text("x")
    assert refused(capsys, [str(tmp_path / "f"), "me/x", "--endpoint", hub, "--token", "t"]).startswith(
        f"{str(tmp_path / 'f')!r} is a file, not a run folder")


@pytest.mark.parametrize("repo_id", ["not a repo id!!", "me/x/y"])
def test_push_refuses_a_bad_repo_id_in_one_line_before_the_hub_is_called(tmp_path, hub, repo_id, capsys):
    """Before: a HFValidationError traceback."""
    _Hub.calls.clear()
    line = refused(capsys, [str(_a_run(tmp_path)), repo_id, "--endpoint", hub, "--token", "t"])
    assert re.match(rf"'{re.escape(repo_id)}' is not a Hub repository id \(.*write owner/name", line), line
    assert _Hub.calls == []


def _a_run(tmp_path):
    weights = tmp_path / "run" / "lora"
    weights.mkdir(parents=True)
    (weights / "pytorch_lora_weights.safetensors").write_bytes(b"w")
    return tmp_path / "run"


def test_push_private_honoured_or_refused(tmp_path, hub, monkeypatch, capsys):
    """--private creates the repository private, and refuses an existing public one (create_repo with exist_ok
    leaves its visibility as it is: the weights would have gone public)."""
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    run = _a_run(tmp_path)
    cli_main(["push", str(run), "me/new", "--endpoint", hub, "--token", "t", "--private"])
    assert _Hub.private["me/new"] is True and _Hub.repos["me/new"]
    cli_main(["push", str(run), "me/public", "--endpoint", hub, "--token", "t"])
    _Hub.repos["me/public"] = {}
    capsys.readouterr()
    assert refused(capsys, [str(run), "me/public", "--endpoint", hub, "--token", "t", "--private"]).startswith(
        "--private, but the Hub repository 'me/public' exists and is public; nothing was uploaded")
    assert _Hub.repos["me/public"] == {}


def test_push_offline_or_unreachable_is_one_line(tmp_path, monkeypatch, capsys):
    hf = pytest.importorskip("huggingface_hub")
    run = _a_run(tmp_path)
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", True)
    assert refused(capsys, [str(run), "me/x", "--token", "t"]) == (
        "the Hugging Face Hub cannot be reached: offline mode is on (HF_HUB_OFFLINE=1); unset it to push")
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", False)
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    line = refused(capsys, [str(run), "me/x", "--token", "t", "--endpoint", dead])
    assert re.match(rf"{dead} cannot be reached \(\w*ConnectError", line), line


@pytest.mark.parametrize("where", ["folder", "file"])
def test_push_refuses_weights_behind_a_symbolic_link_and_sends_nothing(tmp_path, hub, capsys, where):
    """Fresh-user trial 6: a run whose transformer/ was a link to a folder outside the run went on to upload what
    the link points at (training refuses the same folder). flowgrpo makes no links: one is a user's."""
    pytest.importorskip("huggingface_hub")
    _Hub.calls.clear()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "pytorch_lora_weights.safetensors").write_bytes(b"not the run's")
    run = tmp_path / "run"
    run.mkdir()
    if where == "folder":
        (run / "lora").symlink_to(elsewhere)
    else:
        (run / "lora").mkdir()
        (run / "lora" / "pytorch_lora_weights.safetensors").symlink_to(elsewhere / "pytorch_lora_weights.safetensors")
    line = refused(capsys, [str(run), "me/x", "--endpoint", hub, "--token", "t"])
    assert "is a symbolic link" in line and "nothing was sent" in line
    assert _Hub.calls == []
