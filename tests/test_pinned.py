"""What a build and a run record of the numerics and the base model's bytes (flowgrpo.builds.repeatable, and the
report's base-model block in flowgrpo.training.report). Expected digests are hashlib's of the bytes written here; the
parsed texts are hand-made."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

AMD_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu vme sse sse2 avx fma avx2 bmi2 sha_ni

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: not the first processor
flags\t\t: avx512f
"""

TORCH_CONFIG = """PyTorch built with:
  - GCC 13.3
  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64 architecture applications
  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)
  - CPU capability usage: AVX512
  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=mkl, TORCH_VERSION=2.14.1, USE_MKL=ON,
"""


def test_the_cpu_and_the_math_libraries_are_read_from_their_texts():
    from flowgrpo.builds.repeatable import parse_cpuinfo, parse_torch_config

    assert parse_cpuinfo(AMD_CPUINFO) == {"vendor": "AuthenticAMD", "model": "AMD EPYC 7B13 64-Core Processor",
                                          "family": "25", "model_number": "1", "isa": ["avx", "avx2", "fma"]}
    assert parse_cpuinfo("") == {}
    assert parse_torch_config(TORCH_CONFIG) == {"mkl": "2024.2-Product Build 20240605", "onednn": "v3.12.0",
                                                "blas": "mkl", "lapack": "mkl", "torch_capability_usage": "AVX512"}
    openblas = "  - Build settings: BLAS_INFO=open, LAPACK_INFO=open, TORCH_VERSION=2.14.1"
    assert parse_torch_config(openblas) == {"blas": "open", "lapack": "open"}


def test_numerics_names_this_machines_cpu_and_blas():
    from flowgrpo.builds.repeatable import numerics

    n = numerics()
    assert n["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "cpu" in n and n["pinned"] is False
    if Path("/proc/cpuinfo").is_file():
        assert n["cpu"]["vendor"] and n["cpu"]["model"]
    if "BLAS_INFO=mkl" in torch.__config__.show():
        assert n["blas"] == "mkl" and n["mkl"].startswith("20")


def _pipeline(folder: Path) -> dict[str, bytes]:
    """A pipeline folder's weight files: the transformer in two shards, the VAE in one; a text encoder (not hashed)."""
    files = {"transformer/diffusion_pytorch_model-00002-of-00002.safetensors": b"second shard",
             "transformer/diffusion_pytorch_model-00001-of-00002.safetensors": b"first shard",
             "vae/diffusion_pytorch_model.safetensors": b"vae bytes", "text_encoder/model.safetensors": b"te"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def test_weights_digest_hashes_the_transformer_and_the_vae(tmp_path):
    from flowgrpo.builds.repeatable import weights_digest

    _pipeline(tmp_path)
    assert weights_digest(tmp_path) == {
        "transformer": hashlib.sha256(b"first shard" + b"second shard").hexdigest(),  # shards in name order
        "vae": hashlib.sha256(b"vae bytes").hexdigest()}
    assert weights_digest(tmp_path / "text_encoder") == {}  # no component there


def test_the_summary_and_the_report_name_the_base_models_bytes_and_numerics(tmp_path):
    from flowgrpo.training.report import base_model_record, format_report

    _pipeline(tmp_path)
    built = {"torch": "2.14.1+cu130", "threads": 1, "cpu_capability": "AVX2", "blas": "mkl",
             "mkl": "2024.2-Product Build 20240605", "pinned": True,
             "cpu": {"vendor": "AuthenticAMD", "model": "AMD EPYC 7B13 64-Core Processor"}}
    (tmp_path / "flowgrpo_digits.json").write_text(json.dumps({"seed": 0, "numerics": built}))
    base = base_model_record(str(tmp_path))
    transformer = hashlib.sha256(b"first shardsecond shard").hexdigest()
    assert base["name"] == base["path"] == str(tmp_path)
    assert base["sha256"] == {"transformer": transformer, "vae": hashlib.sha256(b"vae bytes").hexdigest()}
    assert base["built_with"] == built and "cpu_capability" in base["machine"]
    lines = [ln.strip() for ln in format_report({"base_model": base}).splitlines()]
    assert f"base model {tmp_path}" in lines
    assert f"transformer sha256 {transformer}" in lines
    assert ("built with: AMD EPYC 7B13 64-Core Processor (AuthenticAMD), torch 2.14.1+cu130 kernels AVX2, "
            "BLAS mkl 2024.2-Product Build 20240605, 1 thread, pinned") in lines
    assert any(ln.startswith("this run:") for ln in lines)
    hub = base_model_record("black-forest-labs/FLUX.1-dev")  # not a local folder: its name only
    assert set(hub) == {"name", "machine"}


def test_only_the_main_process_hashes_the_base_model_at_the_end_of_a_run(tmp_path, monkeypatch):
    """``write_summary`` runs on every process; the others take the main process's record (a broadcast, here
    the value rank 0 would send) and never read the weights."""
    from types import SimpleNamespace

    import flowgrpo.builds.repeatable
    from flowgrpo.distributed import dist
    from flowgrpo.training import report

    _pipeline(tmp_path)
    hashed = []
    monkeypatch.setattr(flowgrpo.builds.repeatable, "weights_digest", lambda folder: hashed.append(folder) or {})
    sent = {"name": str(tmp_path), "sha256": {"transformer": "rank 0's"}}
    monkeypatch.setattr(dist, "broadcast_object", lambda obj: sent if obj is None else obj)
    run = SimpleNamespace(out=tmp_path, weights_dir=tmp_path / "weights", cfg=SimpleNamespace(
        train=SimpleNamespace(num_epochs=1), model=SimpleNamespace(pretrained=str(tmp_path))))
    summary, _ = report.write_summary(run, {}, {}, torch.zeros(0), torch.zeros(0), [], extra_seconds={},
                                      main=False)
    assert hashed == [] and summary["base_model"] is sent
    summary, _ = report.write_summary(run, {}, {}, torch.zeros(0), torch.zeros(0), [], extra_seconds={},
                                      main=True)
    assert hashed == [tmp_path] and summary["base_model"]["path"] == str(tmp_path)
