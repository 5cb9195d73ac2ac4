"""An elastic fleet of the CPU demo's Llama: producers that keep syncing while consumer
launches (a TP replica each) join, die and come back; every consumer verifies every sync.

``ElasticLlamaTask`` is ``ElasticTransferTask`` with ``LlamaTransferTask``'s hooks (weights
change before every sync, consumers check every parameter byte for byte). ``FleetDriver`` runs
such a fleet on this machine: it serves the store, starts each launch (an ``MPLauncher`` launch in
a thread of its own) and kills, scales and stops them, as a test or a benchmark drives them.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_dist.examples.elastic_task import (
    JOINS_KEY,
    ElasticSpec,
    ElasticTransferTask,
    request_leave,
    request_stop,
)
from vllm_dist.examples.weight_sync_demo import LlamaTransferTask
from vllm_dist.implementations.communicators.common import shared_gpu_nccl_env
from vllm_dist.implementations.coordinators.auth_store import AuthStoreServer
from vllm_dist.implementations.coordinators.membership import Fleet, FleetView, MembershipConfig
from vllm_dist.tasks.weight_transfer.task import ConsumerSpec


class ElasticLlamaTask(ElasticTransferTask, LlamaTransferTask):
    """The demo Llama over an elastic fleet (see ``ElasticTransferTask`` for the keywords).

    Also ``gate_file`` (see ``run``) and ``hold_at`` / ``hold_file`` / ``arm_file`` (fault drills):
    once ``arm_file`` exists (when given), a consumer stops, touches ``hold_file`` and waits
    there for good, so that a kill finds it in a known phase. ``hold_at=k`` stops it before sync
    ``k`` (0-based) or a later one: the producers, already serving that sync, find it gone
    mid-sync. ``hold_at="join"`` stops it in its join, at its first route lookup (its plan):
    it is on the roster and introduced, the producers sent their admit and wait for its plan.
    ``strict``: a consumer whose parameters do not match raises (so ``ready`` implies a
    byte-exact sync).
    """

    def run(self, *, gate_file: str | None = None, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """``ElasticTransferTask.run``, once ``gate_file`` exists when given: a launch started
        ahead (its processes up) joins the fleet only when a drill opens its gate."""
        deadline = time.monotonic() + 600.0
        while gate_file is not None and not Path(gate_file).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gate {gate_file} was not opened within 600 s")
            time.sleep(0.05)
        return super().run(**kwargs)

    def make_consumer(self, consumer_idx: int, num_consumers: int, **kw: Any) -> ConsumerSpec:  # type: ignore[override]
        """``LlamaTransferTask.make_consumer``; with ``hold_at="join"`` its route holds (see the
        class): ``join`` looks routes up only once the producers are admitting it."""
        spec = super().make_consumer(consumer_idx, num_consumers, **kw)
        if kw.get("hold_at") != "join":
            return spec
        route = spec.route

        def held_route(name: str) -> Any:
            _hold_if_armed(kw.get("hold_file"), kw.get("arm_file"))
            return route(name)

        return replace(spec, route=held_route)

    def before_consumer_sync(
        self,
        step: int,
        spec: ConsumerSpec,
        hold_at: int | str | None = None,
        hold_file: str | None = None,
        arm_file: str | None = None,
        **kw: Any,
    ) -> None:
        if isinstance(hold_at, int) and step >= hold_at:
            _hold_if_armed(hold_file, arm_file)

    def after_consumer_sync(
        self,
        step: int,
        spec: ConsumerSpec,
        seed: int = 0,
        verify: bool = True,
        strict: bool = False,
        **kw: Any,
    ) -> dict[str, Any]:
        out = super().after_consumer_sync(step, spec, seed=seed, verify=verify, **kw)
        if strict and out.get("verified") is False:
            raise AssertionError(f"sync {step + 1}: parameters differ: {out}")
        return out


def _hold_if_armed(hold_file: str | None, arm_file: str | None) -> None:
    """Once ``arm_file`` exists (or when none is given): touch ``hold_file`` and wait for good
    (until the drill kills this process)."""
    if arm_file is not None and not Path(arm_file).exists():
        return
    if hold_file:
        Path(hold_file).touch()
    while True:
        time.sleep(60)


class FleetDriver:
    """An elastic fleet on this machine: the store here, each launch in a thread.

    ``launch_kwargs`` reach every launch (``communicator_type``, ``config``, task keywords);
    ``num_producers``/``capacity`` size the fleet; ``membership`` its leases.
    ``share_gpu_nccl``: every launch's ranks pass for hosts of their own to NCCL
    (``shared_gpu_nccl_env``), so NCCL pairs form between processes on one GPU.
    """

    def __init__(
        self,
        *,
        num_producers: int,
        capacity: int,
        membership: MembershipConfig,
        task: type[ElasticTransferTask] = ElasticLlamaTask,
        launch_timeout: float = 300.0,
        share_gpu_nccl: bool = False,
        **launch_kwargs: Any,
    ) -> None:
        self.secret = secrets.token_bytes(32)
        self.server = AuthStoreServer("127.0.0.1", 0, self.secret)
        self.membership = membership
        self.fleet = Fleet("127.0.0.1", self.server.port, self.secret, membership)
        self.num_producers = num_producers
        self.capacity = capacity
        self.task = task
        self.launch_timeout = launch_timeout
        self.share_gpu_nccl = share_gpu_nccl
        self.launch_kwargs = launch_kwargs
        self.threads: dict[str, threading.Thread] = {}
        self.results: dict[str, Any] = {}
        self.started: dict[str, float] = {}

    def spec(self, role: str, slot: int) -> ElasticSpec:
        return ElasticSpec(
            host="127.0.0.1",
            port=self.server.port,
            role=role,
            slot=slot,
            num_producers=self.num_producers,
            capacity=self.capacity,
            token=self.secret,
            membership=self.membership,
        )

    def start(
        self, name: str, role: str, slot: int, n: int, env: dict[str, str] | None = None, **kw: Any
    ) -> None:
        """Start launch ``name``: ``n`` workers of ``role`` from ``slot`` on (``env``: the
        launch's worker environment, e.g. ``shared_gpu_nccl_env(name)``)."""
        from vllm_dist import MPLauncher

        kwargs = {**self.launch_kwargs, **kw, "elastic": self.spec(role, slot)}
        if self.share_gpu_nccl:
            env = {**shared_gpu_nccl_env(name), **(env or {})}

        def run() -> None:
            try:
                launcher = MPLauncher(n, timeout=self.launch_timeout, env=env)
                self.results[name] = launcher.launch(task_type=self.task, **kwargs)
            except Exception as exc:  # a killed launch ends here; the caller reads it
                self.results[name] = exc

        self.started[name] = time.time()
        self.threads[name] = thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()

    def view(self) -> FleetView:
        return self.fleet.view()

    def wait_ready(self, slots: list[int], timeout: float = 120.0) -> FleetView:
        """The roster once every consumer slot of ``slots`` holds a ready member."""
        want = set(slots)

        def ready(view: FleetView) -> bool:
            return want <= {m.slot for m in view.role("consumer") if m.ready}

        return self.fleet.wait_for(ready, timeout)

    def wait_gone(
        self, slots: list[int], timeout: float = 60.0, role: str = "consumer"
    ) -> FleetView:
        """The roster once no member holds any ``role`` slot of ``slots``."""
        want = set(slots)

        def gone(view: FleetView) -> bool:
            self.fleet.reap()  # the driver watches too: the dead may have been the watchers
            return not want & {m.slot for m in view.role(role)}

        return self.fleet.wait_for(gone, timeout)

    def kill(self, slots: list[int], role: str = "consumer") -> list[int]:
        """SIGKILL the processes that hold ``role`` ``slots`` now (pids from the roster)."""
        pids = [m.pid for m in self.view().role(role) if m.slot in slots]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids

    def wait_joins(self, slots: list[int], joins: int, timeout: float = 120.0) -> FleetView:
        """The roster once each consumer slot of ``slots`` joined ``joins`` times and is ready
        (a producer restart makes every consumer join again)."""

        def done(view: FleetView) -> bool:
            ready = {m.slot for m in view.role("consumer") if m.ready}
            return set(slots) <= ready and all(
                self.fleet.peek(f"pub/{JOINS_KEY}/{s}") is not None
                and self.fleet.read(f"{JOINS_KEY}/{s}", 5.0) >= joins
                for s in slots
            )

        return self.fleet.wait_for(done, timeout)

    def leave(self, slots: list[int]) -> None:
        for slot in slots:
            request_leave(self.fleet, slot)

    def stop(self, timeout: float = 120.0) -> dict[str, Any]:
        """Ask the producers to finish; every launch's result (or its error), by name."""
        request_stop(self.fleet)
        for thread in self.threads.values():
            thread.join(timeout)
        return dict(self.results)

    def join(self, name: str, timeout: float = 120.0) -> Any:
        self.threads[name].join(timeout)
        return self.results.get(name)

    def close(self) -> None:
        self.fleet.close()
        self.server.close()
