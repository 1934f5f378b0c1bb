"""What sits on each device, and which engines launch a run: the rule of ``flowgrpo.parallel`` checked without a
GPU (the meta device stands in for one: moving a module there is observable, and nothing is computed on it).

* ``parallel.text_encoders: offload`` leaves the text encoders in host memory and moves them to the device only
  while prompts are encoded (``adapter.pipe.to(device)`` used to put T5-XXL's 9.5 GB on every GPU);
* under ``parallel.sharding: fsdp2`` the transformer stays in host memory until each block is sharded onto the
  device (so no process ever holds the whole transformer on its device);
* accelerate's FSDP plugin and DeepSpeed engine are refused with one line naming what to use; no shipped
  accelerate config selects them.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from flowgrpo import parallel
from flowgrpo.config import ParallelConfig
from flowgrpo.distributed import launch

REPO = Path(__file__).resolve().parents[1]
META = torch.device("meta")


def _devices(module: torch.nn.Module) -> set[str]:
    return {p.device.type for p in module.parameters()}


@pytest.fixture
def adapter(tiny_flux_dir):
    from flowgrpo.models import load_model

    return load_model(str(tiny_flux_dir), max_sequence_length=16, height=32, width=32)


def test_offloaded_text_encoders_stay_in_host_memory(adapter):
    parallel.place_pipeline(adapter, META, ParallelConfig(text_encoders="offload"))
    pipe = adapter.pipe
    assert _devices(pipe.transformer) == _devices(pipe.vae) == {"meta"}
    assert _devices(pipe.text_encoder) == _devices(pipe.text_encoder_2) == {"cpu"}
    assert adapter.encoders_offload is not None and set(map(id, adapter.encoders_offload.modules)) == {
        id(pipe.text_encoder), id(pipe.text_encoder_2)}


def test_a_sharded_transformer_waits_in_host_memory(adapter):
    parallel.place_pipeline(adapter, META, ParallelConfig(sharding="fsdp2"))
    pipe = adapter.pipe
    assert _devices(pipe.transformer) == {"cpu"}
    assert _devices(pipe.vae) == _devices(pipe.text_encoder) == _devices(pipe.text_encoder_2) == {"meta"}
    assert adapter.encoders_offload is None


def test_by_default_every_part_is_on_the_device(adapter):
    parallel.place_pipeline(adapter, META, ParallelConfig())
    for name, part in adapter.pipe.components.items():
        if isinstance(part, torch.nn.Module):
            assert _devices(part) == {"meta"}, name


class _Spy(torch.nn.Module):
    """Records where it is moved (``to``), and moves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[str] = []

    def to(self, device):
        self.moves.append(str(device))
        return self


def test_offloaded_encoders_are_on_the_device_only_while_encoding(adapter):
    from flowgrpo.sampling.rollout import encode_rows

    spies = [_Spy(), _Spy()]
    adapter.encoders_offload = parallel.EncoderOffload(spies, META)
    seen = []
    adapter.encode_prompts = lambda prompts: seen.append([s.moves[-1] for s in spies]) or _embeds(prompts)
    encode_rows(adapter, ["a", "b", "a"])
    assert seen == [["meta", "meta"]]  # on the device while encoding
    assert [s.moves for s in spies] == [["meta", "cpu"], ["meta", "cpu"]]  # and back in host memory after


def _embeds(prompts):
    from flowgrpo.records import PromptEmbeds

    return PromptEmbeds({"prompt_embeds": torch.zeros(len(prompts), 2, 4)}, {})


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP", "MEGATRON_LM"])
def test_accelerates_own_engines_are_refused_with_what_to_use(kind):
    from accelerate.utils import DistributedType

    acc = SimpleNamespace(distributed_type=getattr(DistributedType, kind), mixed_precision="no")
    with pytest.raises(ValueError, match="parallel.sharding=fsdp2") as err:
        parallel.check_engine(acc, ParallelConfig())
    assert "\n" not in str(err.value)  # one line


def test_accelerate_mixed_precision_is_refused_under_fsdp2():
    from accelerate.utils import DistributedType

    acc = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, mixed_precision="bf16")
    parallel.check_engine(acc, ParallelConfig())  # DDP: accelerate's autocast is as before
    with pytest.raises(ValueError, match="model.dtype"):
        parallel.check_engine(acc, ParallelConfig(sharding="fsdp2"))


def test_shipped_accelerate_configs_are_plain_launches():
    """The sharding is flowgrpo's: no shipped launch config selects accelerate's FSDP or DeepSpeed, or lists
    block classes by hand (the old fsdp.yaml named FLUX's and SD3's blocks, which no single model has)."""
    files = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))
    assert {f.name for f in files} >= {"default.yaml", "multi_gpu.yaml", "multi_node.yaml", "fsdp.yaml"}
    for f in files:
        cfg = yaml.safe_load(f.read_text())
        assert cfg["distributed_type"] in ("NO", "MULTI_GPU", "MULTI_CPU"), f.name
        assert not {k for k in cfg if k.startswith(("fsdp", "deepspeed"))}, f.name
        assert cfg.get("mixed_precision", "no") == "no", f.name


def test_the_wrap_rule_is_the_models_own_list():
    """The blocks come from the model's ``_no_split_modules`` (or a list the adapter gives); a list naming
    classes the model lacks is refused by name."""
    from diffusers import FluxTransformer2DModel

    tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=1,
                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    blocks = parallel.shard_blocks(tr)
    assert [type(b).__name__ for b in blocks] == ["FluxTransformerBlock"] * 2 + ["FluxSingleTransformerBlock"]
    with pytest.raises(ValueError, match="JointTransformerBlock"):
        parallel.shard_blocks(tr, ["JointTransformerBlock"])


# ---------------------------------------------------------------- the device mesh (issue 41, case 2)
def test_the_mesh_shape_is_replicate_by_shard_by_context():
    assert parallel.mesh_shape(16, 2, 1) == (2, 8, 1)  # 2 nodes of 8: shard inside a node
    assert parallel.mesh_shape(64, 8, 2) == (8, 4, 2)
    assert parallel.mesh_shape(1) == (1, 1, 1)
    with pytest.raises(ValueError, match=r"world size 6 .*replicate=4 x parallel.context_degree=1 = 4") as err:
        parallel.mesh_shape(6, 4, 1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="world size 8 .*replicate=1 x parallel.context_degree=3 = 3"):
        parallel.mesh_shape(8, 1, 3)


def test_one_process_gets_a_named_mesh_of_size_one():
    mesh = parallel.device_mesh(torch.device("cpu"), ParallelConfig(sharding="fsdp2"))
    try:
        assert mesh.mesh_dim_names == ("replicate", "shard", "context") and tuple(mesh.shape) == (1, 1, 1)
        assert parallel.device_mesh(torch.device("cpu")) is mesh  # made once per layout
        assert parallel.fsdp_mesh(mesh).mesh_dim_names == ("shard_context",)  # plain FSDP without replicas
    finally:
        parallel.release()


@pytest.mark.parametrize(("setting", "named"), [({"replicate": 2}, "parallel.replicate=2"),
                                                ({"offload": "cpu"}, "parallel.offload=cpu")])
def test_settings_for_sharded_runs_are_refused_without_sharding(setting, named):
    with pytest.raises(ValueError, match=named):
        ParallelConfig(**setting)
    ParallelConfig(sharding="fsdp2", **setting)


def test_cpu_offload_on_cuda_adds_a_cpu_backend_to_the_process_group(monkeypatch):
    """FSDP2's CPU shards reduce (the clipping norm) on the CPU: NCCL alone cannot (no GPU here: the kwargs only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (kwargs,) = parallel.process_group_kwargs(ParallelConfig(sharding="fsdp2", offload="cpu"))
    assert kwargs.backend == "cuda:nccl,cpu:gloo"
    (kwargs,) = parallel.process_group_kwargs(ParallelConfig(sharding="fsdp2"))
    assert kwargs.to_kwargs() == {"timeout": datetime.timedelta(hours=1)}  # accelerate's backend left as it is


def test_the_collective_timeout_reaches_init_process_group(monkeypatch):
    """``parallel.collective_timeout_s`` is the timeout accelerate gives ``init_process_group`` (NCCL's default,
    10 minutes, aborted a run whose main process exported alone for longer): a two-process CPU launch's
    environment, the call recorded and stopped there."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    class Stop(Exception):
        pass

    seen = {}

    def init_process_group(backend=None, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Stop

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for key, value in {"ACCELERATE_USE_CPU": "true", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    AcceleratorState._reset_state(True)
    try:
        with pytest.raises(Stop):
            Accelerator(cpu=True, kwargs_handlers=parallel.process_group_kwargs(
                ParallelConfig(collective_timeout_s=5400)))
    finally:
        AcceleratorState._reset_state(True)
    assert seen["timeout"] == datetime.timedelta(seconds=5400) and seen["backend"] == "gloo"
    with pytest.raises(ValueError, match="collective_timeout_s"):
        ParallelConfig(collective_timeout_s=0)


# ---------------------------------------------------------------- the launch (case 8)
ACCELERATE_CPU_TWO = {"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": "29500"}  # what `accelerate launch --cpu --num_processes 2` gives its process


def test_a_cpu_launch_of_several_processes_that_started_one_is_refused():
    with pytest.raises(ValueError, match="ACCELERATE_USE_CPU=true torchrun --nproc_per_node N") as err:
        launch.check_launch(ACCELERATE_CPU_TWO)
    assert "\n" not in str(err.value)
    launch.check_launch({**ACCELERATE_CPU_TWO, "WORLD_SIZE": "2", "RANK": "0"})  # torchrun started them
    launch.check_launch({**ACCELERATE_CPU_TWO, "OMPI_COMM_WORLD_SIZE": "2"})  # mpirun started them
    launch.check_launch({k: v for k, v in ACCELERATE_CPU_TWO.items() if not k.startswith("MASTER")})  # asked 1
    launch.check_launch({**ACCELERATE_CPU_TWO, "ACCELERATE_USE_CPU": "False"})  # GPUs: accelerate runs torchrun


@pytest.mark.slow
def test_accelerate_launch_cpu_with_two_processes_refuses_in_one_line(tmp_path):
    """The real launch: ``accelerate launch --cpu --num_processes 2 flowgrpo/train.py CONFIG`` (main's code started
    one process that trained alone)."""
    import subprocess
    import sys

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "model": {"pretrained": "tiny"},
                                   "train": {"num_epochs": 1}}))
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "flowgrpo/train.py", str(cfg)],
                          cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1800)
    assert proc.returncode != 0
    assert "torchrun --nproc_per_node N flowgrpo/train.py CONFIG" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # our line is the only one: accelerate's launcher (no -q) printed a CalledProcessError traceback after it
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [ln for ln in lines if ln.startswith("error: accelerate launch --cpu")] and len(lines) == 1, \
        proc.stderr[-3000:]


@pytest.mark.slow
def test_a_bad_override_under_accelerate_launch_is_one_line_without_its_traceback(tmp_path):
    """Issue 54, F15: a refusal of the config under ``accelerate launch`` (no ``-q``) was followed by accelerate's
    ``CalledProcessError`` traceback repeating the child's stderr. The line is now the last output: the child ends
    its launcher after it (``launch.end_launcher``), and the launcher's SIGTERM back ends the child quietly. Its
    exit status is accelerate's 143 (accelerate 1.16 exits 1 for any failed child, 128 + the signal when ended:
    the refusal's 2 cannot pass through it)."""
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "flowgrpo/train.py", "configs/tiny_jpeg.yaml", f"output_dir={tmp_path / 'x'}",
                           "algo.clip_rnage=1"],
                          cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [("error: unknown config key 'algo.clip_rnage': the algo section's keys moved (docs"
            "/configs.md: where each setting lives); did you mean 'objective.clip_range'?")], \
        proc.stderr[-3000:]
    assert proc.returncode == 143, proc.stderr[-3000:]


def _wait_for_exec(pid: int) -> None:
    """Until the child has exec'd its command (a forked child shows its parent's command line before that: on a
    loaded machine the test read pytest's own)."""
    import psutil

    for _ in range(6000):
        if "time.sleep" in " ".join(psutil.Process(pid).cmdline()):
            return
        __import__("time").sleep(0.01)


def test_the_launcher_is_ended_only_when_it_is_accelerates(monkeypatch):
    """:func:`launch.end_launcher` signals its parent only when that parent's command is accelerate's launch."""
    import signal
    import subprocess
    import sys

    killed = []
    monkeypatch.setattr(__import__("os"), "kill", lambda pid, sig: killed.append((pid, sig)))
    shell = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "accelerate", "launch"])
    try:
        _wait_for_exec(shell.pid)
        _wait_for_exec(launcher.pid)
        assert not launch.end_launcher(shell.pid) and killed == []
        assert launch.end_launcher(launcher.pid) and killed == [(launcher.pid, signal.SIGTERM)]
        assert not launch.end_launcher(2**22 + 12345)  # no such process
    finally:
        monkeypatch.undo()  # the real os.kill, for Popen.kill
        for p in (shell, launcher):
            p.kill()
            p.wait()


# ---------------------------------------------------------------- frozen modules placed by rule (case 4)
class _Placed(torch.nn.Module):
    """A module that records where ``.to`` sends it (its weights stay put: no GPU here)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.where = "cpu"

    def to(self, device):
        self.where = torch.device(device).type
        return self


class _ScoringReward:
    """A reward holding a module; it records where its module is when it scores."""

    def __init__(self) -> None:
        self.model = _Placed()
        self.group_wise = False
        self.seen: list[str] = []

    def setup(self, device) -> None:
        self.model.to(device)

    def __call__(self, images, prompts, metadata):
        self.seen.append(self.model.where)
        return torch.zeros(images.shape[0])


def test_offloaded_reward_models_are_on_the_device_only_while_scoring():
    from flowgrpo.rewards.compose import ComposedReward

    gpu = torch.device("cuda", 0)
    for rule, between in (("device", "cuda"), ("offload", "cpu")):
        reward = _ScoringReward()
        composed = ComposedReward({"r": reward}, {"r": 1.0})
        composed.setup(gpu)
        parallel.place_rewards(composed, gpu, ParallelConfig(reward_models=rule))
        assert reward.model.where == between, rule
        composed(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
        assert reward.seen == ["cuda"], rule  # scored on the device either way
        assert reward.model.where == between, rule
        assert composed.group_wise == []  # the wrapper answers as the reward


@pytest.fixture
def wan22(tmp_path_factory):
    from flowgrpo.models.random_pipelines import CASES
    from tests.models.test_video_models import _load

    case = CASES["wan22"]
    return case, _load(case, tmp_path_factory)


@pytest.mark.parametrize("rule", ["offload", "shard"])
def test_the_other_wan_expert_offloaded_or_sharded_gives_the_same_velocity(wan22, rule):
    from torch.distributed.tensor import DTensor

    case, adapter = wan22
    x = adapter.initial_latents(2, [torch.Generator().manual_seed(0) for _ in range(2)])
    embeds = adapter.encode_prompts(list(case.prompts))
    sigma = torch.tensor([0.5, 0.5])  # the low-noise side: the untrained transformer_2
    with torch.no_grad():
        whole = adapter.velocity(x, sigma, embeds, 4.0)
    expert = adapter.pipe.transformer_2
    assert parallel.other_expert(adapter) is expert
    try:
        parallel.place_pipeline(adapter, torch.device("cpu"), ParallelConfig(experts=rule))
        with torch.no_grad():
            placed = adapter.velocity(x, sigma, embeds, 4.0)
        if rule == "shard":
            assert all(isinstance(p, DTensor) for p in expert.parameters())
            assert not any(isinstance(p, DTensor) for p in adapter.transformer.parameters())
        else:  # diffusers' block-level group offloading hooks on the expert
            from diffusers.hooks.group_offloading import _is_group_offload_enabled

            assert _is_group_offload_enabled(expert) and not _is_group_offload_enabled(adapter.transformer)
        torch.testing.assert_close(placed, whole, rtol=0, atol=1e-6)
    finally:
        parallel.release()


def test_experts_placement_is_refused_for_a_model_with_one_transformer(adapter):
    with pytest.raises(ValueError, match="parallel.experts=offload .*FluxTransformer2DModel here has no second"):
        parallel.place_pipeline(adapter, META, ParallelConfig(experts="offload"))


def test_sharded_text_encoders_encode_as_whole_ones(adapter):
    from torch.distributed.tensor import DTensor

    prompts = ["a red cube", "a blue ball"]
    whole = adapter.encode_prompts(prompts)
    try:
        parallel.place_pipeline(adapter, torch.device("cpu"), ParallelConfig(text_encoders="shard"))
        for name in ("text_encoder", "text_encoder_2"):
            assert all(isinstance(p, DTensor) for p in getattr(adapter.pipe, name).parameters()), name
        sharded = adapter.encode_prompts(prompts)
        assert sharded.tensors.keys() == whole.tensors.keys()
        for key in whole.tensors:
            torch.testing.assert_close(sharded.tensors[key], whole.tensors[key], rtol=0, atol=1e-6)
    finally:
        parallel.release()


# ---------------------------------------------------------------- gradient sync (case 6), DDP's side
class _Wrapped(torch.nn.Module):
    """Stands in for DDP: a ``no_sync`` context that records its use."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @__import__("contextlib").contextmanager
    def no_sync(self):
        self.calls += 1
        yield


def test_ddp_skips_the_all_reduce_of_a_steps_earlier_packs_only_when_asked():
    ddp = _Wrapped()
    with parallel.gradient_sync(ddp, sync=False, every_micro_batch=False):  # gradient_sync=step, an early pack
        pass
    assert ddp.calls == 1
    for sync, every in ((True, False), (False, True), (True, True)):  # the last pack, or micro_batch
        with parallel.gradient_sync(ddp, sync=sync, every_micro_batch=every):
            pass
    assert ddp.calls == 1


# ---------------------------------------------------------------- swapped weights under FSDP2 (case 5, the kind)
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class _Net(torch.nn.Module):
    _no_split_modules = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("kind", ["ema", "old_copy"])
def test_every_swap_of_sharded_weights_reaches_the_forwards(kind, reshard_after_forward):
    """A forward inside a swap computes with the swapped-in values and one after it with the trained values, whether
    or not FSDP2 kept the weights a forward gathered before (main's EMA swap left them: evaluation ran on the
    trained weights with reshard_after_forward=false, and the rollout after it on the EMA)."""
    import copy

    from flowgrpo.algo.objectives.nft import NFTConfig
    from flowgrpo.algo.objectives.old_copy import OldCopy
    from flowgrpo.training.ema import EMA

    torch.manual_seed(0)
    shadow_net = _Net()  # the values the swap puts in
    trained_net = copy.deepcopy(shadow_net)
    with torch.no_grad():
        for p in trained_net.parameters():
            p.add_(0.5)
    model = copy.deepcopy(shadow_net)
    x = torch.randn(3, 4)
    try:
        parallel.shard(model, mesh=parallel.device_mesh(torch.device("cpu")), param_dtype=None,
                       reshard=reshard_after_forward)
        params = list(model.parameters())
        swap = EMA(params, 0.5) if kind == "ema" else OldCopy(params, NFTConfig(), model=model)
        with torch.no_grad():
            for p in params:
                p.add_(0.5)  # training moved the weights away from the shadow
            for _ in range(2):  # twice: the first swap's restore must reach the next one too
                assert torch.equal(model(x), trained_net(x))  # gathers the trained weights
                with swap.swapped(model) if kind == "ema" else swap.swapped():
                    torch.testing.assert_close(model(x), shadow_net(x), rtol=0, atol=1e-6)
                torch.testing.assert_close(model(x), trained_net(x), rtol=0, atol=1e-6)
    finally:
        parallel.release()


def test_end_worker_flushes_and_skips_the_teardown(tmp_path):
    """A torchrun worker ends through ``dist.end_worker``: the group destroyed, buffered output kept, the exit code
    as asked, and no atexit handler (the interpreter's teardown) run."""
    script = tmp_path / "w.py"
    script.write_text(
        "import atexit, sys, torch.distributed as td\n"
        "from flowgrpo.distributed import dist\n"
        "td.init_process_group('gloo', store=td.HashStore(), rank=0, world_size=1)\n"
        "atexit.register(lambda: print('teardown ran', flush=True))\n"
        "print('figures'); sys.stderr.write('note')\n"
        "dist.end_worker(3)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as under a launcher
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1800, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "figures\n", "note")


# ---------------------------------------------------------------- models fetched main-process-first
def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


FETCHER = textwrap.dedent("""
    import os, sys
    import torch.distributed
    from diffusers import DiffusionPipeline
    from flowgrpo.distributed import dist
    from flowgrpo.models import fetch_first

    log = sys.argv[1]
    def note(text):
        with open(log, "a") as f:
            f.write(f"{text}\\n")
    DiffusionPipeline.download = classmethod(lambda cls, name, **kw: note(f"rank {dist.rank()} fetched {name}"))
    torch.distributed.init_process_group("gloo")
    fetch_first("org/model", local_main=os.environ["LOCAL_RANK"] == "0")
    note(f"rank {dist.rank()} loads")
    fetch_first(sys.argv[2], local_main=os.environ["LOCAL_RANK"] == "0")  # a local folder: nothing fetched
    dist.end_worker()
""")


@pytest.mark.slow
def test_a_hub_model_is_fetched_by_the_local_main_process_before_the_others_load(tmp_path):
    """Two processes (torchrun, gloo) with a recording download (no network): only local rank 0 fetches, and
    before any process goes on to load (every rank downloaded at once)."""
    log = tmp_path / "log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", _free_port(), "--no-python", sys.executable,
                           "-c", FETCHER, str(log), str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = log.read_text().splitlines()
    assert lines[0] == "rank 0 fetched org/model" and sorted(lines[1:]) == ["rank 0 loads", "rank 1 loads"], lines


_IN_PLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__setitem__"}


class _InPlaceOnOutputs(torch.overrides.TorchFunctionMode):
    """Records every in-place operation whose target is one of ``outputs`` or a view of the same base."""

    def __init__(self, outputs: list) -> None:
        super().__init__()
        self.outputs, self.hits = outputs, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        in_place = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))
        if in_place and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            if any(t is o or (t._base is not None and t._base is o._base) for o in self.outputs):
                self.hits.append(name)
        return func(*args, **(kwargs or {}))


def test_no_in_place_operation_touches_a_sharded_flux_blocks_output(tiny_flux_dir):
    """Under FSDP2 (and on resume) torch warns once per process that a wrapped FLUX block "returned a view tensor",
    since an in-place operation on that view would skip FSDP2's pre-backward all-gather and could give wrong
    gradients (issue 54). The view is FluxSingleTransformerBlock's split of its output into text and image tokens
    (``hidden_states[:, :text_seq_len]``, diffusers 0.42); this records every in-place operation of a forward of
    the model and its backward and finds none on any output of the blocks FSDP2 wraps (flowgrpo.parallel.
    shard_blocks), views included: the warning cannot apply here (docs/many_gpus.md). The resumed sharded update
    equals the uninterrupted run's in tests/training/test_sharding.py
    (test_checkpoints_resume_with_another_process_count)."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    outputs: list = []

    def keep(module, args, out):
        outputs.extend(o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor))

    for block in parallel.shard_blocks(model):
        block.register_forward_hook(keep)
    c, n, t = model.config, 16, 8
    g = torch.Generator().manual_seed(0)
    with _InPlaceOnOutputs(outputs) as mode:
        v = model(hidden_states=torch.randn(1, n, c.in_channels, generator=g),
                  encoder_hidden_states=torch.randn(1, t, c.joint_attention_dim, generator=g),
                  pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=g),
                  timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                  img_ids=torch.zeros(n, 3), txt_ids=torch.zeros(t, 3)).sample
        v.square().mean().backward()
    assert any(o._base is not None for o in outputs)  # the view FSDP2 warns about is there
    assert mode.hits == []


def test_torchrun_on_a_machine_without_a_gpu_runs_on_the_cpu_and_says_so(monkeypatch, caplog):
    """Issue 54, F7: torchrun without ACCELERATE_USE_CPU=true on a CPU-only machine failed on every rank with
    "unknown process-group backend 'undefined'" after the checkpoint loaded; it runs on the CPU with gloo, as
    accelerate launch --cpu does (checked by hand: a 2-process torchrun of configs/tiny_jpeg.yaml trains)."""
    import logging

    import torch

    from flowgrpo.distributed import launch

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    env = {"WORLD_SIZE": "2", "RANK": "0"}
    with caplog.at_level(logging.INFO, logger="flowgrpo.distributed.launch"):
        assert launch.cpu_without_accelerator(env) is True
    assert env["ACCELERATE_USE_CPU"] == "true"
    assert "no accelerator (GPU) on this machine: the 2 processes run on the CPU with gloo" in caplog.text
    # a user's own setting, one process, or a machine with a GPU: nothing changes
    for given in ({"WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "false"}, {"WORLD_SIZE": "1"}, {}):
        before = dict(given)
        assert launch.cpu_without_accelerator(given) is False and given == before
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert launch.cpu_without_accelerator({"WORLD_SIZE": "2"}) is False
