"""Trust on the data plane (NIXL_RDT on the CPU, loopback only): a consumer maps a producer's
memory read-only, cannot forge write access, WRITE targets stay writable, and a loopback launch
keeps NIXL/UCX off the external interface. Every attack is tried in a real worker process."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import time
from typing import Any

import pytest
import torch

from tests.utils import distributed_test
from vllm_dist import (
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    MPLauncher,
)
from vllm_dist.memory import shared_empty

pytest.importorskip("nixl", reason="needs the nixl package (pip install 'vllm_dist[nixl]')")

from vllm_dist.implementations.communicators.nixl import (  # noqa: E402
    ExposedBuffer,
    NixlRdtCommunicator,
    ReadOnlyExposureError,
)
from vllm_dist.implementations.communicators.nixl.network import (  # noqa: E402
    NET_DEVICES,
    _address,
    is_loopback,
    listening_sockets,
    nixl_listens_on,
    ucx_env,
)

WEIGHT = "model.embed_tokens.weight"
SHAPES = {WEIGHT: (256, 64), "model.norm.weight": (64,), "lm_head.weight": (128, 64)}
ATTACK = 0x42


def launch(task: type, n: int = 2, **kw: Any) -> list[Any]:
    return MPLauncher(n, timeout=150.0).launch(
        task_type=task,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.NIXL_RDT,
        device="cpu",
        communicator_options={"timeout": 30.0},
        coordinator_options={"timeout": 60.0},
        **kw,
    )


def maps_line(addr: int) -> str:
    """The ``/proc/self/maps`` line of the mapping that holds ``addr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.strip()
    raise AssertionError(f"no mapping holds {addr:#x}")


def write_in_child(addr: int, timeout: float = 20.0) -> int | None:
    """Store ``ATTACK`` at ``addr`` in a forked child; the signal that killed it (None: the
    store went through and the child exited)."""
    pid = os.fork()
    if pid == 0:  # the child: one store, no Python machinery that could take a lock
        try:
            import faulthandler
            import resource

            faulthandler.disable()
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            ctypes.memset(addr, ATTACK, 1)
        finally:
            os._exit(0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the writing child neither died nor exited")


def fill(state: dict[str, torch.Tensor], step: int) -> None:
    for i, t in enumerate(state.values()):
        g = torch.Generator().manual_seed(1000 * step + i)
        t.copy_(torch.randn(t.shape, generator=g))


class MappingAttackTask(GlobalCoordinatorDistributedTask):
    """Rank 0 produces (its CPU weights moved into shared memory), rank 1 consumes over the
    READ path and maps rank 0's weights. After sync 0 the consumer attacks: it writes 0x42 into
    every producer buffer it has mapped, and forges a writable descriptor of one. Sync 1 must
    then land byte for byte, and the producer's weights must be as its trainer wrote them."""

    def post_init_distributed(self, **_: Any) -> Any:
        from vllm_dist.tasks.weight_transfer import (
            Fleet,
            StateDictSource,
            TransferConfig,
            WeightConsumer,
            WeightProducer,
        )

        fleet = Fleet.split(1, 1)
        config = TransferConfig(direct_bytes=4096)
        state = {n: torch.zeros(s) for n, s in SHAPES.items()}
        coord, comm = self.coordinator, self.communicator
        if coord.get_rank() == 0:
            producer = WeightProducer(
                coord, comm, fleet=fleet, source=StateDictSource(state), config=config
            )
            producer.setup()
            out: dict[str, Any] = {"role": "producer"}
            try:
                fill(state, 0)
                producer.sync()
                coord.barrier()  # the consumer attacks now
                coord.barrier()
                want = {n: torch.zeros(s) for n, s in SHAPES.items()}
                fill(want, 0)
                out["unchanged"] = all(torch.equal(state[n], want[n]) for n in state)
                fill(state, 1)
                producer.sync()
            finally:
                producer.close()
            return out
        params = {n: torch.zeros(s) for n, s in SHAPES.items()}

        def load(dest: torch.Tensor, src: torch.Tensor) -> None:
            dest.copy_(src)

        consumer = WeightConsumer(
            coord, comm, fleet=fleet, params=params, route=lambda n: [(n, load)], config=config
        )
        consumer.setup()
        try:
            consumer.sync()
            coord.barrier()
            out = {"role": "consumer", **self.attack(comm)}
            coord.barrier()
            consumer.sync()
            want = {n: torch.zeros(s) for n, s in SHAPES.items()}
            fill(want, 1)
            out["exact"] = all(torch.equal(params[n], want[n]) for n in params)
        finally:
            consumer.close()
        return out

    def attack(self, comm: Any) -> dict[str, Any]:
        """Write into every mapped buffer of rank 0; forge write access to one."""
        mapped = {name: comm._maps.open(0, d) for name, d in comm._peers.exposed[0].items()}
        mapped = {name: m for name, m in mapped.items() if m is not None}
        out: dict[str, Any] = {"mapped": sorted(mapped), "lines": [], "signals": []}
        for m in mapped.values():
            out["lines"].append(maps_line(m.data_ptr()))
            out["signals"].append(write_in_child(m.data_ptr()))
        name = next(iter(mapped))
        desc = comm._peers.exposed[0][name]
        doc = json.loads(desc.to_bytes())
        forged = ExposedBuffer.from_bytes(
            json.dumps({**doc, "name": "forged", "writable": True}).encode()
        )
        comm.import_exposed(forged)
        try:
            comm.write(0, "forged", torch.full((16,), ATTACK, dtype=torch.uint8))
            out["forged"] = "written"
        except ReadOnlyExposureError as exc:
            out["forged"] = str(exc)
        try:
            comm.write(0, name, torch.full((16,), ATTACK, dtype=torch.uint8))
            out["write_read_only"] = "written"
        except ReadOnlyExposureError as exc:
            out["write_read_only"] = str(exc)
        out["backend"] = comm.describe()["last_xfer_backend"]
        return out


@distributed_test(timeout=240)
def test_consumer_maps_producer_weights_read_only_cpu() -> None:
    producer, consumer = launch(MappingAttackTask)
    assert consumer["mapped"], consumer  # the consumer did map the producer's weights
    for line in consumer["lines"]:
        perms = line.split()[1]
        assert "w" not in perms and "s" in perms, line  # shared, read-only
    assert all(sig in (signal.SIGSEGV, signal.SIGBUS) for sig in consumer["signals"]), consumer
    assert "read-only" in consumer["forged"], consumer  # a forged descriptor: refused
    assert "read-only" in consumer["write_read_only"], consumer
    assert producer["unchanged"], producer  # nothing of the trainer's weights changed
    assert consumer["exact"], consumer  # and the next sync over the mapping is byte-exact


class WriteTargetTask(GlobalCoordinatorDistributedTask):
    """Rank 0 exposes a WRITE target (writable) and a read-only buffer; rank 1 writes the
    target through its read-write mapping and is refused on the other."""

    def post_init_distributed(self, **_: Any) -> Any:
        comm: Any = self.communicator
        rank = self.coordinator.get_rank()
        if rank == 0:
            target = shared_empty(4096, "cpu").zero_()
            desc = comm.expose(target, "target", writable=True)
            frozen = shared_empty(4096, "cpu").fill_(7)
            comm.expose(frozen, "frozen")
        comm.exchange_exposed()
        out: dict[str, Any] = {}
        if rank == 1:
            assert comm.maps_exposed(0, "target") and comm.maps_exposed(0, "frozen")
            comm.write(0, "target", torch.full((1000,), 9, dtype=torch.uint8), 100, timeout=30)
            out["backend"] = comm.describe()["last_xfer_backend"]
            m = comm._maps.open(0, comm._peers.buffer(0, "target"))
            out["line"] = maps_line(m.data_ptr())
            with pytest.raises(ReadOnlyExposureError, match="read-only"):
                comm.write(0, "frozen", torch.zeros(8, dtype=torch.uint8))
            comm.notify(0, b"done")
        else:
            assert comm.wait_notification(1, timeout=30) == b"done"
            out["target"] = bool((target[100:1100] == 9).all() and (target[:100] == 0).all())
            out["frozen"] = bool((frozen == 7).all())
            out["writable"] = desc.writable
        self.coordinator.barrier()
        return out


@distributed_test(timeout=180)
def test_write_target_is_mapped_read_write_cpu() -> None:
    owner, writer = launch(WriteTargetTask)
    assert writer["backend"] == "shared_memory", writer
    assert "w" in writer["line"].split()[1], writer
    assert owner == {"target": True, "frozen": True, "writable": True}, owner


class ListenTask(GlobalCoordinatorDistributedTask):
    """Every worker builds a second NIXL agent and reports the TCP sockets it listens on: those
    the agent added, and all of them while both agents exist."""

    def post_init_distributed(self, **_: Any) -> Any:
        before = set(listening_sockets())
        comm = NixlRdtCommunicator(self.coordinator, device="cpu", timeout=30.0)
        try:
            now = listening_sockets()
            facts = comm.describe()
            self.coordinator.barrier()  # every peer has connected to this agent: it may close
        finally:
            comm.close()
        return {
            "added": sorted(set(now) - before),
            "all": now,
            "listens_on": facts["listens_on"],
            "env_left": os.environ.get(NET_DEVICES),
            "master": os.environ["MASTER_ADDR"],
            "store_port": int(os.environ["MASTER_PORT"]),
        }


@distributed_test(timeout=180)
def test_nixl_listens_on_loopback_only_for_a_loopback_launch() -> None:
    if NET_DEVICES in os.environ:
        pytest.skip(f"{NET_DEVICES} is set here: the user's choice wins")
    for facts in launch(ListenTask):
        assert is_loopback(facts["master"]), facts
        assert "loopback only" in facts["listens_on"], facts
        assert all(is_loopback(host) for host, _ in facts["added"]), facts
        # every listener of the worker, both agents' among them, is on loopback; the rendezvous
        # store on MASTER_PORT is the control plane's (rank 0 hosts it)
        others = [(h, p) for h, p in facts["all"] if p != facts["store_port"]]
        assert all(is_loopback(host) for host, _ in others), facts
        assert facts["env_left"] is None, facts  # set only while the agent was made


def test_loopback_rules() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("", "0.0.0.0", "::", "192.0.2.2", "fd00::2", "example.invalid"):
        assert not is_loopback(host), host
    assert ucx_env({"MASTER_ADDR": "127.0.0.1"}).get(NET_DEVICES)
    assert ucx_env({"MASTER_ADDR": "127.0.0.1", NET_DEVICES: "eth0"}) == {}  # the user wins
    assert ucx_env({"MASTER_ADDR": "192.0.2.2"}) == {}
    assert ucx_env({}) == {}
    assert "loopback only" in nixl_listens_on({"MASTER_ADDR": "localhost"})
    assert "eth0" in nixl_listens_on({"MASTER_ADDR": "localhost", NET_DEVICES: "eth0"})
    assert "every network device" in nixl_listens_on({"MASTER_ADDR": "192.0.2.2"})
    assert _address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _address("00000000000000000000000001000000:0016") == ("::1", 22)
