"""Decoupled rollouts on Ray (``runtime.engine: ray``; docs/async.md).

What runs where::

    training processes (torchrun / accelerate, FSDP2 …)          Ray rollout workers (actors)
    rank 0: RayRollouts ── set_weights(version, state) ──────────▶ RolloutWorker: the policy (same builder)
            │            ── rollout((epoch, rank), request) ─────▶   objective.rollout(adapter, request)
            │            ◀── record, images, behaviour log-probs ─┘   (its version recorded)
            └─ broadcast: each rank takes its own share (dist.local_slice's), scores and trains it

The trainer stays in the launched processes; rank 0 drives Ray. An epoch's rollout is one request per data rank,
keyed ``(epoch, data rank)``: exactly the request that rank would have sampled itself
(:meth:`~flowgrpo.training.loop.Trainer.rollout_request`), so with ``runtime.max_staleness: 0`` the records (and the
run) equal the in-process ones bit for bit. The *version* of the policy is the number of epoch updates applied; a
group is trained at most ``max_staleness`` versions after the version that sampled it: the requests of epochs
e … e + S are in flight while epoch e trains (the rollout of a later epoch waits for its version; no group is ever
dropped). Weights go to the workers through Ray's object store: the trained parameters (LoRA: the adapter only) as
the rollout uses them (a forward-process objective's old copy swapped in), gathered whole from FSDP2 shards.

Off-policy correction: the SDE-ratio update already takes its importance ratio against the behaviour log-probs the
record carries (Flow-GRPO, Liu et al. arXiv 2505.05470, eq. 6, PPO's clipped surrogate, Schulman et al. arXiv
1707.06347): that ratio corrects a stale group. ``objective.recompute_old_log_probs`` rescores those log-probs with
the trainer's current weights before the update, which drops that correction (the clip is then taken around the
current policy, as decoupled PPO's proximal policy, Hilton et al. arXiv 2110.00641, without its behaviour weight);
the metrics say how far apart the two are (``runtime/logprob_gap``).

Reward workers (``runtime.reward_workers`` ≥ 1): actors holding the run's rewards, built once. A rollout worker
then returns its decoded micro-batches as an object ref of their own, and the request's scoring is issued with the
request on that ref, so Ray scores the images as soon as they exist while the trainer updates; the trainer
collects the scores with the record. A dead reward worker is replaced and its scoring issued again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import time

import torch

from flowgrpo.distributed import dist
from flowgrpo.runtime.ray_workers import RewardWorker, RolloutWorker, placed_record

logger = logging.getLogger(__name__)


def check_installed() -> None:
    """``ValueError`` (one line) when Ray cannot be imported: before any model loads."""
    try:
        import ray  # noqa: F401
    except ImportError as err:
        raise ValueError(f"runtime.engine=ray needs Ray ({err}): pip install 'flowgrpo[ray]', or use "
                         "runtime.engine=torchrun") from None


class RayRollouts:
    """The trainer's rollout source under Ray (:attr:`~flowgrpo.training.loop.Trainer.rollouts`): every process
    calls :meth:`rollout` and :meth:`after_update` in step (the weight gather is a collective under FSDP2); only
    rank 0 holds ``workers`` (actor handles) and talks to Ray.

    Args:
        settings: the run's ``runtime`` section; num_epochs: ``train.num_epochs``.
        workers: the rollout workers' actor handles (rank 0), or None (the other ranks).
        make_worker: ``make_worker()`` → a new actor handle (rank 0): a worker found dead is replaced by it.
    """

    def __init__(self, settings, num_epochs: int, workers: list | None, make_worker=None,
                 reward_workers: list | None = None, make_reward_worker=None) -> None:
        self.s = settings
        self.num_epochs = num_epochs
        self.workers = workers
        self.make_worker = make_worker
        self.n = settings.rollout_workers
        self.reward_workers = reward_workers  # rank 0, with runtime.reward_workers ≥ 1; else None
        self.make_reward_worker = make_reward_worker
        self.reward_replaced = 0  # reward workers started in place of dead ones
        self.synced = [-1] * self.n  # the version each worker holds (-1: none yet), the same on every rank
        # epoch -> {"refs": {(epoch, rank): (worker, its handle, ref)}, "requests": {(epoch, rank): request},
        #           with reward workers "calls": {(epoch, rank): the decoded images' ref}, "scores": like "refs"}
        self.issued: dict[int, dict] = {}
        self.pending: dict[str, float] = {}  # this epoch's runtime/… figures
        self.lag = 0
        self.last = None  # (version, object ref) of the last weights sent (rank 0): what a restarted worker loads
        self.replaced = 0  # workers started in place of dead ones
        self.pids: list[int] = []  # the first workers' process ids (rank 0)
        self.reward_pids: list[int] = []  # the first reward workers' process ids (rank 0)

    # ------------------------------------------------------------------ the trainer's two calls
    def rollout(self, trainer, prompt_ids: torch.Tensor, request, on_scores=None):
        """This process's share of epoch ``trainer.epoch``'s rollout: the requests of epochs e … e + S issued
        (syncing weights where needed), epoch e's records collected, this rank's replayed into
        ``request.on_images`` (the reward scorer) as the in-process rollout would, or, with reward workers, their
        scores of each micro-batch handed to ``on_scores(batch size, non-finite values, components or None)``;
        the worker's transformer calls and truncated prompts added to the trainer's counts. Returns the record on
        the trainer's device."""
        e = trainer.epoch
        self.pending = {"runtime/sync_bytes": 0.0, "runtime/sync_seconds": 0.0}
        self.issue_window(trainer, prompt_ids)
        t0 = time.perf_counter()
        results = self._collect(trainer, e) if self.workers is not None else None
        # the versions too: a worker restarted on rank 0 holds another one, and every rank decides the syncs alike
        results, self.synced = dist.broadcast_object((results, self.synced))
        mine = results[dist.data_rank()]
        self.lag = e - mine["version"]
        self.pending.update({"runtime/lag": float(self.lag), "runtime/version": float(e),
                             "runtime/wait_seconds": time.perf_counter() - t0,
                             "runtime/worker_seconds": float(mine["seconds"])})
        if "parts" in mine:  # scored on a reward worker
            self.pending.update({"runtime/reward_seconds": float(mine["reward_seconds"]),
                                 "runtime/reward_wait_seconds": float(mine["reward_wait_seconds"])})
            for part in mine["parts"]:
                on_scores(*part)
        else:
            for call in mine["calls"]:
                request.on_images(*call)
        trainer.forward_count[0] += mine["forward"][0]
        trainer.forward_count[1] += mine["forward"][1]
        truncation = getattr(trainer.adapter, "truncation", None)
        if truncation is not None:
            for k, v in mine["truncated"].items():
                truncation.counts[k] = truncation.counts.get(k, 0) + v
        trainer.metrics.log(self.pending)
        return placed_record(mine["record"], mine["moved"], trainer.adapter.device)

    def after_update(self, upd: dict, work) -> dict[str, float]:
        """The epoch's off-policy figures: ``runtime/ratio_mean`` (the first optimizer step's mean importance
        ratio against the behaviour log-probs) and ``runtime/logprob_gap`` (max |Δ log p| between the trainer's
        policy and the behaviour's: the first step's, or the recompute's rescoring when it ran), each where the
        objective has log-probs."""
        out = {}
        if "policy/ratio_mean" in upd:
            out["runtime/ratio_mean"] = upd["policy/ratio_mean"]
        behaviour = getattr(getattr(work, "traj", None), "log_probs", None)
        if getattr(work, "recompute", False) and behaviour is not None:
            gap = (work.old_log_probs.float() - behaviour.float().to(work.old_log_probs.device)).abs()
            gap = gap * work.traj.stochastic.to(gap.device)  # deterministic steps carry no log-prob
            out["runtime/logprob_gap"] = float(dist.all_reduce_max(gap.max().reshape(1).double())[0])
        elif "policy/logprob_mismatch_max" in upd:
            out["runtime/logprob_gap"] = upd["policy/logprob_mismatch_max"]
        return out

    # ------------------------------------------------------------------ requests, weights, results
    def _worker_of(self, epoch: int, rank: int) -> int:
        """The worker that samples data rank ``rank``'s share of epoch ``epoch``: round robin over the epochs'
        shares, so epochs in flight together go to different workers."""
        return (epoch * dist.data_world_size() + rank) % self.n

    def issue_window(self, trainer, prompt_ids: torch.Tensor) -> None:
        """Issue the requests of epochs e … e + S not yet issued (e = ``trainer.epoch``, whose (P,) prompts are
        ``prompt_ids``; the later epochs' drawn from a copy of the trainer's sampler), in order, stopping at the
        first epoch sampled ahead that would lag more than S versions on its workers' weights (it waits for a later
        sync, at the latest its own epoch)."""
        e = trainer.epoch
        ahead = copy.deepcopy(trainer.sampler)  # positioned after epoch e's draw: the next epochs' prompts
        for t in range(e, min(e + self.s.max_staleness, self.num_epochs - 1) + 1):
            ids = prompt_ids if t == e else ahead.next_prompt_ids()
            if t not in self.issued and not self._issue(trainer, t, ids):
                return

    def _issue(self, trainer, epoch: int, prompt_ids: torch.Tensor) -> bool:
        """Send the requests of epoch ``epoch`` (one per data rank, keyed (epoch, rank)) unless it is sampled
        ahead and would lag more than ``max_staleness`` (returns False). A worker behind the trainer's version is
        synced first when it holds no weights sent yet, when a sync is due (``sync_every`` versions since its
        last), or, for the epoch about to train, when it would lag more than ``max_staleness`` (every rank takes
        part in the sync's gather)."""
        version = trainer.epoch  # the epoch updates applied so far
        ranks = dist.data_world_size()
        per = len(prompt_ids) * trainer.cfg.train.group_size // ranks
        workers = list(dict.fromkeys(self._worker_of(epoch, r) for r in range(ranks)))
        now, limit = epoch == version, self.s.max_staleness
        stale = [w for w in workers if self.synced[w] < version and (self.synced[w] < 0  # none sent yet
                 or version - self.synced[w] >= self.s.sync_every or (now and epoch - self.synced[w] > limit))]
        if stale:
            self._sync(trainer, stale, version)
        if any(epoch - self.synced[w] > limit for w in workers):
            return False
        if self.workers is None:
            self.issued[epoch] = {}
            return True
        requests = {(epoch, r): dataclasses.replace(
            trainer.rollout_request(epoch, prompt_ids, slice(r * per, (r + 1) * per)), progress=False)
            for r in range(ranks)}
        issued = self.issued[epoch] = {"requests": requests, "refs": {}, "calls": {}, "scores": {}}
        for key in requests:
            w = self._worker_of(*key)
            issued["refs"][key] = (w, self.workers[w], self._send(self.workers[w], key, issued))
        return True

    def _send(self, handle, key: tuple[int, int], issued: dict):
        """Send request ``key`` to the rollout worker ``handle``; returns its result's ref. With reward workers
        the decoded images come back as a second ref, handed straight to the request's reward worker (its score
        is issued now: Ray runs it as soon as the images exist, while the trainer does something else)."""
        request = issued["requests"][key]
        if not self.reward_workers:
            return handle.rollout.remote(key, request)
        ref, calls = handle.rollout_parts.options(num_returns=2).remote(key, request)
        r = self._reward_worker_of(*key)
        issued["calls"][key] = calls
        issued["scores"][key] = (r, self.reward_workers[r], self.reward_workers[r].score.remote(key, calls))
        return ref

    def _reward_worker_of(self, epoch: int, rank: int) -> int:
        """The reward worker that scores data rank ``rank``'s share of epoch ``epoch``: round robin, as
        :meth:`_worker_of`."""
        return (epoch * dist.data_world_size() + rank) % len(self.reward_workers)

    def _sync(self, trainer, workers: list[int], version: int) -> None:
        """Send the trained weights as the rollout uses them to ``workers`` as ``version``; adds the bytes and the
        seconds of the gather and the put into the object store to this epoch's figures (the workers load them
        between requests, unwaited). A collective (every rank gathers; rank 0 sends)."""
        t0 = time.perf_counter()
        state = rollout_state(trainer, gather_only=self.workers is None)
        if self.workers is not None:
            import ray

            self.last = (version, ray.put(state))
            for w in workers:  # not waited for: a worker takes it before its next request (a dead one's request
                self.workers[w].set_weights.remote(version, self.last[1])  # fails at _collect, which replaces it)
        for w in workers:
            self.synced[w] = version
        self.pending["runtime/sync_bytes"] += float(sum(t.numel() * t.element_size() for t in state.values()))
        self.pending["runtime/sync_seconds"] += time.perf_counter() - t0

    def _collect(self, trainer, epoch: int) -> list[dict]:
        """Epoch ``epoch``'s results in data-rank order (rank 0), each with its reward worker's scores when there
        are reward workers (``parts``, ``reward_seconds``, and ``reward_wait_seconds``: the wait for the scores
        after the records arrived). A request whose worker died is issued again, to a new worker loaded with the
        last weights sent, and its scoring with it: no group is lost or sampled twice."""
        import ray

        issued = self.issued.pop(epoch)
        out = {}
        for key, (w, handle, ref) in sorted(issued["refs"].items()):
            while key not in out:
                try:
                    out[key] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    logger.warning("rollout worker %d died during request %s; issuing it again", w, key)
                    handle = self._replace(w, handle)
                    ref = self._send(handle, key, issued)
        if self.reward_workers:
            t0 = time.perf_counter()
            scores = {key: self._scores(key, issued) for key in sorted(out)}
            for key, scored in scores.items():
                out[key].update(parts=scored["parts"], reward_seconds=scored["seconds"],
                                reward_wait_seconds=time.perf_counter() - t0)
        return [out[k] for k in sorted(out)]

    def _scores(self, key: tuple[int, int], issued: dict) -> dict:
        """Request ``key``'s scores (:meth:`RewardWorker.score`). A reward worker that died is replaced and the
        scoring issued again on the same images (their ref): no group is lost or scored into the run twice."""
        import ray

        r, handle, ref = issued["scores"][key]
        while True:
            try:
                return ray.get(ref)
            except ray.exceptions.RayActorError:
                logger.warning("reward worker %d died while scoring request %s; scoring it again", r, key)
                if self.reward_workers[r] is handle:
                    self.reward_workers[r] = self.make_reward_worker()
                    self.reward_replaced += 1
                handle = self.reward_workers[r]
                ref = handle.score.remote(key, issued["calls"][key])

    def _replace(self, w: int, dead):
        """Worker ``w``'s handle after ``dead`` died: a new worker loaded with the last weights sent (the dead
        one's version or a newer one; no collective needed), made once however many requests find it dead."""
        if self.workers[w] is dead:
            self.workers[w] = self.make_worker()
            self.replaced += 1
            version, ref = self.last
            self.workers[w].set_weights.remote(version, ref)
            self.synced[w] = version
        return self.workers[w]


def rollout_state(trainer, gather_only: bool = False) -> dict[str, torch.Tensor]:
    """{name: whole host tensor} of the trained parameters as the rollout samples with them (under the
    objective's ``rollout_weights``: DiffusionNFT's old copy), FSDP2 shards gathered (a collective: every rank
    calls it). ``gather_only`` (a rank other than 0): only take part in the gathers; returns {} when nothing is
    sharded."""
    from torch.distributed.tensor import DTensor

    named = [(n, p) for n, p in trainer.optim.unwrapped.named_parameters() if p.requires_grad]
    if gather_only and not any(isinstance(p, DTensor) for _, p in named):
        return {}
    scope = getattr(trainer.objective, "rollout_weights", contextlib.nullcontext)
    with scope(), torch.no_grad():
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
                for n, p in named}


@contextlib.contextmanager
def ray_rollouts(config, trainer):
    """With ``runtime.engine: ray``: Ray started (rank 0: ``ray.init`` on ``runtime.address``, else
    ``RAY_ADDRESS``, else a new local instance with no dashboard and the workers' output kept off the console),
    ``runtime.rollout_workers`` rollout workers and ``runtime.reward_workers`` reward workers made with this
    process's torch thread count, and ``trainer.rollouts`` set, for the block; the workers ended and
    ``ray.shutdown()`` on every way out. Nothing for ``torchrun``."""
    if config.runtime.engine != "ray":
        yield None
        return
    main = dist.rank() == 0
    started = False
    try:
        workers, make, pids, scorers, make_scorer, scorer_pids = None, None, [], None, None, []
        if main:
            make, make_scorer = _start_ray(config)
            started = True
            workers = [make() for _ in range(config.runtime.rollout_workers)]
            scorers = [make_scorer() for _ in range(config.runtime.reward_workers)] or None
            import ray

            # built (a failure to build is raised here, first)
            pids = ray.get([w.pid.remote() for w in workers])
            scorer_pids = ray.get([w.pid.remote() for w in scorers or ()])
        trainer.rollouts = RayRollouts(config.runtime, config.train.num_epochs, workers, make, scorers, make_scorer)
        trainer.rollouts.pids, trainer.rollouts.reward_pids = pids, scorer_pids
        yield trainer.rollouts
    finally:
        trainer.rollouts = None
        if started:
            _stop_ray()


def _start_ray(config):
    """``ray.init`` as :func:`ray_rollouts` says; returns ``(make, make_reward)``: each ``make()`` → a new
    rollout worker's actor handle (one GPU where this machine has CUDA, one CPU otherwise), and ``make_reward()``
    → a new reward worker's (one CPU, no GPU)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    r = config.runtime
    address = r.address or os.environ.get("RAY_ADDRESS") or "local"
    local = address == "local"
    with _stop_signals_kept():
        ray.init(address=address, include_dashboard=False if local else None, log_to_driver=False,
                 logging_level=logging.WARNING, num_cpus=r.rollout_workers + r.reward_workers + 1 if local else None)
    threads = torch.get_num_threads()
    gpus = 1 if torch.cuda.is_available() else 0
    actor = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(RolloutWorker)
    scorer = ray.remote(num_cpus=1, num_gpus=0, max_restarts=0)(RewardWorker)
    logger.info("Ray: %d rollout worker(s) and %d reward worker(s) on %s, max_staleness %d", r.rollout_workers,
                r.reward_workers, "this machine" if local else address, r.max_staleness)
    return lambda: actor.remote(config, threads), lambda: scorer.remote(config, threads)


@contextlib.contextmanager
def _stop_signals_kept():
    """The block (``ray.init``) leaves this process's SIGINT and SIGTERM handlers as they were: ``ray.init`` (2.60,
    ``ray/_private/worker.py``) installs a SIGTERM handler of its own that exits, which replaced the run's
    (:func:`flowgrpo.distributed.launch.stop_on_signals`: a launcher's SIGTERM after Ctrl-C ends the run with its
    resume line) for the rest of the process."""
    import signal

    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:  # None: set outside Python; nothing to put back
                with contextlib.suppress(ValueError):  # not the main thread: Ray installed nothing either
                    signal.signal(sig, handler)


def _stop_ray() -> None:
    """End the rollout workers and this process's Ray (a local instance's processes with it)."""
    import ray

    with contextlib.suppress(Exception):  # already gone: nothing to end
        ray.shutdown()
