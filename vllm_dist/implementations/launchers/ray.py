"""RayLauncher: one Ray actor per rank, in one placement group; the multi-node launcher.

A launch reserves one bundle per rank (``placement_strategy`` decides how they spread over
nodes), starts one actor in each bundle, asks every actor where it landed (node IP, node id, GPU
ids), derives torchrun's variables from that (``MASTER_ADDR`` is rank 0's node, ``MASTER_PORT`` a
port found free *on that node*, local ranks counted per node), then runs the packed task in every
actor and waits on all of them at once. The first failed rank or dead actor ends the launch; every
actor is killed and the placement group removed before ``launch()`` returns or raises. At a
timeout, or when every failure is a reaction to a peer, a small actor on each live rank's node
reads that rank's progress records (its last coordinator operation and data-plane step) and its
stacks, so the rank that never arrived is named first; every failure names its node. Rejected:
asking the actor itself from a second concurrency group, which makes Ray run every method, the
task too, off the main thread.

The task travels as the bytes ``pack_launch`` makes (our cloudpickle, with dynamic modules by
value), so Ray's own pickler only ever sees bytes, ``WorkerInfo`` and ``WorkerOutcome``; the
launch secret in ``WorkerInfo`` reaches the actors that way too, never through their environment.

Without ``address=`` the launcher starts a private Ray for this process (and a ``RayReaper`` that
stops all of it, agents included, when this process dies) instead of joining the cluster that
``RAY_ADDRESS`` or a running ``ray start`` names, which on a shared host can be another user's;
with Ray's token authentication on (Ray's default for a new cluster; only tests turn it off) the
token file it creates is readable by its owner only. What stays Ray's: its GCS
and raylets listen on every interface, so the token is what keeps other users out; the token
travels in clear gRPC metadata unless Ray's TLS is on; any process of the same user can read it.

Ray is imported inside methods only: ``from vllm_dist import RayLauncher`` works without Ray, and a
launcher built without it raises ``BackendUnavailableError`` naming the install command. Rejected
alternatives: Ray Train's ``TorchTrainer`` (owns checkpointing and a training loop we do not
want, and hides the actors); one Ray task per rank instead of an actor (a task cannot report its
node before the work starts, and the rendezvous address must be known first).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import math
import os
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_dist import serialization
from vllm_dist.implementations.launchers.common import (
    WorkerOutcome,
    check_n_tasks,
    check_seconds,
    find_free_port,
    launch_retrying_taken_ports,
    looks_like_consequence,
    mark_causes,
    pack_launch,
    raised_failure,
    run_packed_task,
)
from vllm_dist.implementations.launchers.progress import (
    describe_progress,
    lagging_ranks,
    read_progress,
)
from vllm_dist.implementations.launchers.ray_reaper import RayReaper, ray_node_pids
from vllm_dist.interfaces import (
    BackendUnavailableError,
    DistributedTask,
    Launcher,
    LaunchError,
    LaunchTimeoutError,
    WorkerFailure,
    WorkerInfo,
)
from vllm_dist.interfaces.launcher import PROGRESS_FILE_ENV, new_launch_id, new_secret

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_INLINE_LIMIT = 1 << 20  # packed launches above this go through the object store once
_REPORT_WAIT = 15.0  # seconds to wait for the ranks' progress reports after a timeout


def import_ray() -> Any:
    """The ``ray`` module, or ``BackendUnavailableError`` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailableError(
            f"RayLauncher needs Ray, which cannot be imported here ({exc}); install it with: "
            "pip install 'vllm_dist[ray]'"
        ) from exc
    return ray


class RayLauncher(Launcher):
    """Run a task in ``n_tasks`` Ray actors, one per rank, on a local or remote Ray cluster.

    Args:
        n_tasks: number of ranks.
        num_gpus_per_task: GPUs reserved for each actor (fractions allowed). With exactly one GPU
            per task, every actor sees its node's reserved GPUs ordered by local rank, so
            ``cuda:<local rank>`` is its own GPU and peers on the node are visible (CUDA IPC,
            NCCL P2P). Otherwise each actor keeps Ray's assignment (only its own GPUs).
        num_cpus_per_task: CPUs reserved for each actor.
        placement_strategy: ``PACK`` (default), ``SPREAD``, ``STRICT_PACK`` or ``STRICT_SPREAD``.
        address: the existing cluster to join (``"ray://..."``, ``"host:port"``, or ``"auto"``:
            the one ``RAY_ADDRESS`` or a running ``ray start`` names). None (default) starts a
            private local cluster for this process, whatever ``RAY_ADDRESS`` or ``ray start``
            name: on a shared host those can be someone else's. Either way, a Ray this process
            already initialized (its own ``ray.init``) is used as it is.
        runtime_env: Ray runtime environment of the actors (``{"env_vars": {...}}``, ...).
        timeout: seconds one launch may take in all; None = no limit on the task itself.
        startup_timeout: seconds to reserve the placement group and start the actors; a request
            the cluster could hold but that stays pending longer fails with ``LaunchError``.
        keep_ray: leave a Ray that this launcher connected to or started running after
            ``launch()`` (default): the next launch of this process reuses it, and it is shut
            down when the process exits. False shuts it down after each launch; a fresh Ray per
            launch costs seconds and leaves some of Ray's threads and files behind in the driver
            each time. A Ray that was already initialized is never shut down.
    """

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why Ray cannot be used here (it does not import), with the install command."""
        try:
            import_ray()
        except BackendUnavailableError as exc:
            return str(exc)
        return None

    def __init__(
        self,
        n_tasks: int,
        *,
        num_gpus_per_task: float = 0,
        num_cpus_per_task: float = 1,
        placement_strategy: str = "PACK",
        address: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        startup_timeout: float = 300.0,
        keep_ray: bool = True,
    ) -> None:
        check_n_tasks(n_tasks)
        if num_gpus_per_task < 0 or num_cpus_per_task < 0:
            raise ValueError(
                f"resources per task must be >= 0, got num_gpus_per_task={num_gpus_per_task!r}, "
                f"num_cpus_per_task={num_cpus_per_task!r}"
            )
        if num_gpus_per_task == 0 and num_cpus_per_task == 0:
            raise ValueError("a task must reserve some CPU or GPU: Ray refuses empty bundles")
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy {placement_strategy!r} is not one of {PLACEMENT_STRATEGIES}"
            )
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise ValueError(
                f"address must be 'auto', 'host:port' or 'ray://host:port' to join a cluster, "
                f"or None for a private one; got {address!r}"
            )
        check_seconds("timeout", timeout)
        check_seconds("startup_timeout", startup_timeout, allow_none=False)
        import_ray()
        self._n_tasks = n_tasks
        self._bundle = {"CPU": float(num_cpus_per_task), "GPU": float(num_gpus_per_task)}
        self._bundle = {k: v for k, v in self._bundle.items() if v > 0}
        self._strategy = placement_strategy
        self._address = address
        self._runtime_env = dict(runtime_env) if runtime_env else None
        self._timeout = timeout
        self._startup_timeout = startup_timeout
        self._keep_ray = keep_ray
        self._actor_cls: Any = None

    @property
    def n_tasks(self) -> int:
        return self._n_tasks

    def launch(self, *, task_type: type[DistributedTask], **kwargs: Any) -> list[Any]:
        packed = pack_launch(task_type, kwargs)
        task_type.check_launch_kwargs(self._n_tasks, **kwargs)
        ray = import_ray()
        serialization.prepare()  # now that ray.cloudpickle is loaded, register there too
        owned = self._connect(ray)
        try:
            started = time.monotonic()  # the timeouts count from here, across launches again
            return launch_retrying_taken_ports(lambda: self._launch_once(ray, packed, started))
        finally:
            if owned is not None and not self._keep_ray:
                _shutdown(ray, owned)

    def _launch_once(self, ray: Any, packed: bytes, started: float) -> list[Any]:
        run = _Run(self, ray, started)
        try:
            return run.execute(packed)
        finally:
            run.stop()

    def _connect(self, ray: Any) -> RayReaper | None:
        """Make sure this process is connected to Ray; when this call connected it, the reaper
        of the Ray it started (one that watches nothing after joining a cluster)."""
        if ray.is_initialized():
            return None
        if self._address is not None:
            ray.init(address=self._address, log_to_driver=True)
            reaper = RayReaper([])
        else:
            needed = math.ceil(self._n_tasks * self._bundle.get("CPU", 0))
            start_private_ray(ray, num_cpus=max(os.cpu_count() or 1, needed))
            reaper = RayReaper(ray_node_pids(ray))  # its agents die with this process too
        if self._keep_ray:
            atexit.register(_shutdown, ray, reaper)  # once per Ray started here
        return reaper

    def _remote_class(self, ray: Any) -> Any:
        if self._actor_cls is None:
            self._actor_cls = ray.remote(_RankActor)
        return self._actor_cls

    def _request(self) -> str:
        per_task = ", ".join(f"{k}: {v:g}" for k, v in self._bundle.items())
        return f"{self._n_tasks} task(s) x {{{per_task}}} with placement_strategy={self._strategy}"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Placement:
    """Where one actor landed, as it reports it; ``pid`` and ``files`` (its progress record and
    stack-dump descriptors, -1 where ``/proc`` is missing) let an actor on its node read them."""

    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...]
    free_port: int | None
    pid: int = 0
    files: tuple[int, int] = (-1, -1)


class _RankActor:
    """The actor body: reports its placement, then runs one rank of a packed launch.

    The task runs on the actor's main thread (a concurrency group would move it off it). While it
    runs, its coordinator keeps its last operation in an unlinked file (``PROGRESS_FILE_ENV``)
    and ``faulthandler`` dumps its stacks into another on SIGUSR1: a ``_Peeker`` the parent
    starts on the same node after a timeout reads both through ``/proc/<pid>/fd``.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._files: list[Any] = []
        self._final_record: Any = None

    def __repr__(self) -> str:
        return f"rank{self._rank}"  # Ray prefixes the actor's forwarded output with this

    def placement(self, want_port: bool) -> _Placement:
        import ray

        ip = _node_ip(ray)
        if os.path.isdir("/proc/self/fd"):  # unlinked files: nothing is left behind, even killed
            files = [tempfile.TemporaryFile() for _ in range(2)]  # noqa: SIM115 - run closes them
            self._files = files
        return _Placement(
            node_ip=ip,
            node_id=ray.get_runtime_context().get_node_id(),
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
            free_port=find_free_port(ip) if want_port else None,
            pid=os.getpid(),
            files=(self._files[0].fileno(), self._files[1].fileno()) if self._files else (-1, -1),
        )

    def run(self, packed: bytes, info: WorkerInfo, env: Mapping[str, str]) -> WorkerOutcome:
        os.environ.update(env)
        if not self._files:
            return run_packed_task(packed, info)
        progress, stacks = self._files
        os.environ[PROGRESS_FILE_ENV] = f"/proc/self/fd/{progress.fileno()}"
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            return run_packed_task(packed, info)
        finally:
            faulthandler.unregister(signal.SIGUSR1)
            self._final_record = read_progress(f"/proc/self/fd/{progress.fileno()}")
            for f in self._files:
                f.close()
            self._files = []

    def report(self) -> Any:
        """This rank's last coordinator record, once its task has returned or raised."""
        return self._final_record


class _Peeker:
    """A throwaway actor on one node that reads its live ranks' reports; an actor and not a task
    so that killing it ends its process (a task's worker would stay in Ray's pool)."""

    def peek(self, targets: list[tuple[int, tuple[int, int]]], wait: float) -> list[Any]:
        """``(last coordinator record, stacks)`` of each ``(pid, files)`` of ``targets``."""
        paths = [tuple(f"/proc/{pid}/fd/{fd}" for fd in files) for pid, files in targets]
        records = [read_progress(progress) for progress, _ in paths]
        asked = []
        for (pid, _), (_, stacks) in zip(targets, paths, strict=True):
            try:
                os.truncate(stacks, 0)
                os.kill(pid, signal.SIGUSR1)  # faulthandler in the rank writes its stacks
                asked.append(stacks)
            except OSError:  # gone, or /proc closed to us: the record alone
                asked.append("")
        texts = ["" for _ in targets]
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = [_read_text(path) if path else "" for path in asked]
            done = all(a == b for a, b in zip(now, texts, strict=True))
            texts = now
            if done and all(t or not path for t, path in zip(texts, asked, strict=True)):
                break  # each dump is written in one go: two equal reads, it has ended
        return list(zip(records, texts, strict=True))


def _read_text(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()
    return ""


class _Run:
    """The placement group and actors of one launch, and everything needed to remove them."""

    def __init__(self, launcher: RayLauncher, ray: Any, started: float) -> None:
        self._launcher = launcher
        self._ray = ray
        self._run_limit = launcher._timeout
        self._startup_limit = min(launcher._startup_timeout, launcher._timeout or math.inf)
        self._deadline = None if self._run_limit is None else started + self._run_limit
        self._startup_deadline = started + self._startup_limit
        self._pg: Any = None
        self._actors: list[Any] = []
        self._placements: list[_Placement] = []
        self._nodes: list[str] = []  # per rank, once placed: the node named in its failures

    def execute(self, packed: bytes) -> list[Any]:
        self._reserve()
        infos, envs = self._start_actors()
        ray = self._ray
        arg = ray.put(packed) if len(packed) > _INLINE_LIMIT else packed
        refs = [a.run.remote(arg, i, e) for a, i, e in zip(self._actors, infos, envs, strict=True)]
        outcomes = self._gather(refs, self._deadline, "run", _outcome_failure)
        return [serialization.loads(o.payload) for o in outcomes]

    def _reserve(self) -> None:
        from ray.util.placement_group import placement_group

        launcher = self._launcher
        problem = _infeasibility(
            launcher._bundle, launcher.n_tasks, launcher._strategy, _alive_nodes(self._ray)
        )
        if problem:
            raise LaunchError(
                [], summary=f"RayLauncher cannot place {launcher._request()}: {problem}"
            )
        self._pg = placement_group(
            [dict(launcher._bundle) for _ in range(launcher.n_tasks)],
            strategy=launcher._strategy,
        )
        ready, _ = self._ray.wait([self._pg.ready()], timeout=_left(self._startup_deadline))
        if not ready:
            raise LaunchTimeoutError(
                [],
                summary=f"RayLauncher could not reserve {launcher._request()} within "
                f"{self._startup_limit:g} s: the cluster can hold it but "
                f"other work holds the resources; available now: "
                f"{_fmt(self._ray.available_resources())}",
            )

    def _start_actors(self) -> tuple[list[WorkerInfo], list[dict[str, str]]]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        launcher = self._launcher
        actor_cls = launcher._remote_class(self._ray)
        for rank in range(launcher.n_tasks):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank
            )
            options: dict[str, Any] = {
                "num_cpus": launcher._bundle.get("CPU", 0),
                "num_gpus": launcher._bundle.get("GPU", 0),
                "scheduling_strategy": strategy,
                "max_restarts": 0,
            }
            if launcher._runtime_env:
                options["runtime_env"] = launcher._runtime_env
            self._actors.append(actor_cls.options(**options).remote(rank))
        refs = [a.placement.remote(rank == 0) for rank, a in enumerate(self._actors)]
        placements = self._gather(refs, self._startup_deadline, "start", lambda _r, _v: None)
        infos = worker_infos(placements)
        self._placements = placements
        self._nodes = [
            f"node {i.node_rank} ({p.node_ip}, id {p.node_id[:8]})"
            for i, p in zip(infos, placements, strict=True)
        ]
        return infos, _visible_devices(placements, launcher._bundle)

    def _gather(
        self,
        refs: list[Any],
        deadline: float | None,
        phase: str,
        check: Callable[[int, Any], WorkerFailure | None],
    ) -> list[Any]:
        """Every rank's value in rank order; raises at the first failure or at ``deadline``."""
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        values: dict[int, Any] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_left(deadline))
            if not ready:
                raise self._timeout_error(sorted(pending.values()), phase)
            failures = self._take(ready, pending, values, check)
            if failures:
                time.sleep(0.05)  # ranks failing at about the same time are reported too
                more, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
                failures += self._take(more, pending, values, check)
                if phase == "run" and all(looks_like_consequence(f) for f in failures):
                    failures = self._with_hung(failures, sorted(pending.values()))
                raise LaunchError(mark_causes(failures))
        return [values[r] for r in range(len(refs))]

    def _take(
        self,
        ready: list[Any],
        pending: dict[Any, int],
        values: dict[int, Any],
        check: Callable[[int, Any], WorkerFailure | None],
    ) -> list[WorkerFailure]:
        failures = []
        for ref in ready:
            rank = pending.pop(ref)
            try:
                value = self._ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - Ray's error is the report
                failures.append(_ray_failure(rank, exc))
                continue
            failure = check(rank, value)
            if failure is not None:
                failures.append(failure)
            values[rank] = value
        return [self._on_node(f) for f in failures]

    def _on_node(self, failure: WorkerFailure) -> WorkerFailure:
        """``failure`` with the node its rank ran on, once the actors have reported it."""
        if failure.rank >= len(self._nodes):
            return failure
        return replace(failure, reason=f"{failure.reason} [on {self._nodes[failure.rank]}]")

    def _timeout_error(self, stuck: list[int], phase: str) -> LaunchTimeoutError:
        if phase == "run":
            failures = mark_causes(self._with_hung([], stuck))
            blamed = [f.rank for f in failures if f.cause]
            return LaunchTimeoutError(
                failures,
                summary=f"launch timed out after {self._run_limit:g} s; rank(s) {stuck} had "
                f"not finished and were stopped; rank(s) {blamed} lag behind the others "
                "(listed first, with what they did last and their stacks)",
            )
        limit = f"{self._startup_limit:g} s"
        failures = [
            self._on_node(WorkerFailure(rank=r, reason=f"had not started after {limit}"))
            for r in stuck
        ]
        return LaunchTimeoutError(
            failures,
            summary=f"launch timed out after {limit}; rank(s) {stuck} had not started and "
            "were stopped",
        )

    def _with_hung(self, failures: list[WorkerFailure], live: list[int]) -> list[WorkerFailure]:
        """``failures`` with their last coordinator operation, plus one ``hung`` failure per
        rank of ``live`` (still running) with its last operation and stacks; the ranks that lag
        behind where the others wait are marked as the cause."""
        reports = self._reports([f.rank for f in failures], live)
        records = {r: record for r, (record, _) in reports.items()}
        lagging = set(lagging_ranks(records, live, [f.rank for f in failures])) or set(live)
        now = time.time()
        hung = []
        for r in live:
            stacks = reports.get(r, (None, ""))[1]
            failure = WorkerFailure(
                rank=r,
                reason="still running (stopped by the launcher)",
                traceback=f"stacks of rank {r}:\n{stacks}" if stacks else "",
                kind="hung",
                at=now,
                cause=r in lagging,
                last_op=describe_progress(records.get(r)),
            )
            hung.append(self._on_node(failure))
        done = [replace(f, last_op=describe_progress(records.get(f.rank))) for f in failures]
        return done + hung

    def _reports(self, done: list[int], live: list[int]) -> dict[int, tuple[Any, str]]:
        """``(last coordinator record, stacks)`` per rank: the finished ranks' actors answer
        themselves, a ``_Peeker`` on its node answers for a live one; none for the dead."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs = {self._actors[r].report.remote(): [r] for r in done}
        by_node: dict[str, list[int]] = {}
        for r in live:
            if min(self._placements[r].files) >= 0:
                by_node.setdefault(self._placements[r].node_id, []).append(r)
        peekers = []
        for node, ranks in by_node.items():
            where = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            peeker = self._ray.remote(_Peeker).options(num_cpus=0, scheduling_strategy=where)
            peekers.append(peeker.remote())
            targets = [(self._placements[r].pid, self._placements[r].files) for r in ranks]
            refs[peekers[-1].peek.remote(targets, 2.0)] = ranks
        try:
            ready, _ = self._ray.wait(list(refs), num_returns=len(refs), timeout=_REPORT_WAIT)
        finally:
            for peeker in peekers:
                with contextlib.suppress(Exception):
                    self._ray.kill(peeker, no_restart=True)
        out: dict[int, tuple[Any, str]] = {}
        for ref in ready:
            with contextlib.suppress(Exception):  # a dead actor has nothing to report
                value = self._ray.get(ref, timeout=0)
                if refs[ref][0] in live:
                    out.update(zip(refs[ref], value, strict=True))
                else:
                    out[refs[ref][0]] = (value, "")
        return out

    def stop(self) -> None:
        """Kill every actor and remove the placement group (both are idempotent)."""
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            with contextlib.suppress(Exception):  # already dead
                self._ray.kill(actor, no_restart=True)
        if self._pg is not None:
            with contextlib.suppress(Exception):  # already removed
                remove_placement_group(self._pg)


def _shutdown(ray: Any, reaper: RayReaper) -> None:
    """Shut down the Ray this process started (a no-op if already down), then its leftovers."""
    ray.shutdown()
    reaper.close()


def _node_ip(ray: Any) -> str:
    """The address Ray registered for this node (reachable by its peers); run in the actor."""
    try:
        return str(ray._private.worker.global_worker.node_ip_address)
    except AttributeError:  # private path moved: Ray's public guess from this process
        return str(ray.util.get_node_ip_address())


def worker_infos(placements: Sequence[_Placement]) -> list[WorkerInfo]:
    """torchrun's facts for every rank: local ranks counted per node, nodes numbered in order."""
    master = placements[0]
    assert master.free_port is not None, "rank 0 reports the rendezvous port"
    node_ranks: dict[str, int] = {}
    members: dict[str, list[int]] = {}
    launch_id = new_launch_id()  # one per try: a try again on another port is another launch
    secret = new_secret()  # reaches the actors through Ray's own channel, never the environment
    for rank, p in enumerate(placements):
        node_ranks.setdefault(p.node_id, len(node_ranks))
        members.setdefault(p.node_id, []).append(rank)
    return [
        WorkerInfo(
            rank=rank,
            world_size=len(placements),
            local_rank=members[p.node_id].index(rank),
            local_world_size=len(members[p.node_id]),
            master_addr=master.node_ip,
            master_port=master.free_port,
            node_rank=node_ranks[p.node_id],
            launch_id=launch_id,
            secret=secret,
        )
        for rank, p in enumerate(placements)
    ]


def _visible_devices(
    placements: Sequence[_Placement], bundle: Mapping[str, float]
) -> list[dict[str, str]]:
    """Per-rank environment that makes ``cuda:<local rank>`` the actor's own GPU.

    Only with one GPU per task: each actor then sees its node's reserved GPUs in local-rank order.
    """
    if bundle.get("GPU", 0) != 1:
        return [{} for _ in placements]
    by_node: dict[str, list[str]] = {}
    for p in placements:
        by_node.setdefault(p.node_id, []).extend(p.gpu_ids)
    return [{"CUDA_VISIBLE_DEVICES": ",".join(by_node[p.node_id])} for p in placements]


def _infeasibility(
    bundle: Mapping[str, float], n: int, strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str:
    """Why ``n`` copies of ``bundle`` can never be placed on ``nodes``; empty when they can."""

    def capacity(node: Mapping[str, float]) -> int:
        return min(int(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items())

    caps = [capacity(node) for node in nodes]
    if strategy == "STRICT_PACK":
        ok = max(caps, default=0) >= n
    elif strategy == "STRICT_SPREAD":
        ok = sum(c >= 1 for c in caps) >= n
    else:
        ok = sum(caps) >= n
    if ok:
        return ""
    totals = {k: sum(node.get(k, 0.0) for node in nodes) for k in bundle}
    largest = max(nodes, key=capacity, default={})
    return (
        f"the cluster has {_fmt(totals)} in all over {len(nodes)} alive node(s) "
        f"(largest node: {_fmt({k: largest.get(k, 0.0) for k in bundle})}), room for "
        f"{sum(caps)} such task(s); ask for less or add nodes"
    )


def _alive_nodes(ray: Any) -> list[dict[str, float]]:
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def start_private_ray(ray: Any, *, num_cpus: int) -> None:
    """Start a Ray cluster for this process alone, on this machine.

    ``address="local"`` makes Ray start one even where ``RAY_ADDRESS`` or a running ``ray start``
    names another cluster (Ray reads those only for ``None`` and ``"auto"``).
    """
    _owner_only_auth_token()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    _restrict_default_token()  # in case Ray's token set-up changed shape and wrote it itself


def _owner_only_auth_token() -> None:
    """Have Ray create its auth token, when the new cluster will use one, readable only by us.

    Ray writes ``~/.ray/auth_token`` with the process umask (0644 under the usual 022), so that
    every user of the host could join the cluster; the umask is 077 only for that one write. A
    token given through ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` is the user's to protect,
    and ``RAY_AUTH_MODE=disabled`` (which only tests should set) is respected.
    """
    try:
        from ray._private.authentication import authentication_token_setup as setup
    except ImportError:  # a Ray without token authentication
        return
    try:
        if not setup.enable_token_auth_by_default():  # what ray.init does first for a new cluster
            return
        _restrict_default_token()  # a token left by an earlier Ray
        old = os.umask(0o077)
        try:
            setup.ensure_token_if_auth_enabled(None, create_token_if_missing=True)
        finally:
            os.umask(old)
    except (AttributeError, TypeError):  # Ray's private set-up moved: chmod after ray.init
        return


def _restrict_default_token() -> None:
    """Make Ray's default token file (``~/.ray/auth_token``) readable by its owner only."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    with contextlib.suppress(FileNotFoundError):
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o600)


def _outcome_failure(rank: int, outcome: WorkerOutcome) -> WorkerFailure | None:
    if outcome.ok:
        return None
    return raised_failure(rank, outcome, time.time())


def _ray_failure(rank: int, exc: Exception) -> WorkerFailure:
    """A failure from Ray itself: a dead actor, a runtime_env that failed to set up, ..."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayActorError):
        detail = " ".join(str(exc).split())
        detail = detail.split(" Some common causes include", 1)[0]  # Ray's generic advice
        return WorkerFailure(
            rank=rank,
            reason=f"actor died before returning a result (Ray does not report a worker's exit "
            f"code or signal; its output and Ray's logs do): {detail}",
            kind="exited",
            at=time.time(),
        )
    if isinstance(exc, RayTaskError):
        return WorkerFailure(
            rank=rank,
            reason="raised an exception in Ray",
            traceback=str(exc),
            kind="raised",
            at=time.time(),
        )
    return WorkerFailure(rank=rank, reason=f"{type(exc).__name__}: {_first_lines(str(exc))}")


def _first_lines(text: str, n: int = 3) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines()[:n])


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
