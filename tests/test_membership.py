"""Fleet membership over the authenticated store, with real member processes on loopback.

Each member is a separate Python process driven by JSON commands on its stdin (the fleet secret
arrives there too, never in its environment or arguments); the test process serves the store
and watches the roster. Every wait is bounded; nothing asserts a duration.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_dist import CoordinatorType, MPLauncher, get_communicator_class, get_coordinator_class
from vllm_dist.implementations.coordinators.auth_store import AuthStoreServer, pack_fields
from vllm_dist.implementations.coordinators.membership import (
    FencedError,
    Fleet,
    FleetView,
    MembershipConfig,
    MembershipTimeoutError,
    PeerGoneError,
    message_key,
    seal,
)
from vllm_dist.interfaces import AuthenticationError, DistributedTask

SECRET = bytes(range(32))
CONFIG = MembershipConfig(heartbeat_interval_s=0.25, lease_s=4.0, timeout_s=60.0)
ROOT = Path(__file__).resolve().parents[1]
REPLY_S = 90.0


# -- the member process --------------------------------------------------------------------------
def _member_main() -> None:
    """Join as told on the first stdin line, then run one command per line, answering each."""
    from vllm_dist.implementations.coordinators.membership import Fleet, MembershipConfig

    setup = json.loads(sys.stdin.readline())
    config = MembershipConfig(**setup["config"])
    fleet = Fleet("127.0.0.1", setup["port"], bytes.fromhex(setup["secret"]), config)
    member = fleet.join(setup["role"], setup["slot"])
    _answer({"id": member.id, "pid": os.getpid(), "epoch": member.view().epoch})
    coords: dict[str, Any] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            _answer({"ok": _run(member, cmd, coords)})
        except Exception as exc:  # the test reads the error's type and message
            _answer({"error": type(exc).__name__, "message": str(exc)})
        if cmd["op"] == "leave":
            return


def _run(member: Any, cmd: dict[str, Any], coords: dict[str, Any]) -> Any:
    op = cmd["op"]
    if op.startswith("coord"):
        return _run_coordinator(member, cmd, coords)
    if op == "send":
        return member.send(cmd["to"], cmd["obj"])
    if op == "recv":
        return member.recv(cmd["from"], cmd.get("timeout", 60.0))
    if op == "publish":
        return member.publish(cmd["name"], cmd["obj"])
    if op == "read":
        return member.read(cmd["name"], 30.0)
    if op == "ready":
        return member.set_ready(True)
    if op == "view":
        view = member.view()
        return {"epoch": view.epoch, "ids": view.ids()}
    if op == "wait_epoch":
        return member.fleet.wait_for(lambda v: v.epoch >= cmd["epoch"], 60.0).epoch
    if op == "leave":
        return member.leave()
    raise ValueError(f"unknown op {op}")


def _run_coordinator(member: Any, cmd: dict[str, Any], coords: dict[str, Any]) -> Any:
    """Store-coordinator commands: make one over the live consumers, run its operations."""
    from vllm_dist.implementations.coordinators.store_coordinator import StoreCoordinator

    if cmd["op"] == "coord_make":
        consumers = member.view().role("consumer")
        coords["c"] = StoreCoordinator.from_member(member, consumers, timeout=60.0)
        return [coords["c"].get_rank(), coords["c"].get_world_size()]
    coord = coords["c"]
    if cmd["op"] == "coord_barrier":
        return coord.barrier(timeout=60.0)
    rank, world = coord.get_rank(), coord.get_world_size()
    coord.barrier()
    gathered = coord.all_gather_object(member.id)
    told = coord.broadcast_object({"plan": rank} if rank == 0 else None, 0)
    coord.send_object(rank, (rank + 1) % world)
    ring = coord.recv_object((rank - 1) % world)
    return {"gathered": gathered, "told": told, "ring": ring}


def _answer(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# -- the test side -------------------------------------------------------------------------------
class Proc:
    """One member process: commands in, answers out (bounded), stderr into a file."""

    def __init__(self, port: int, role: str, slot: int, log: Path) -> None:
        self._err = log.open("w")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        code = "from tests.test_membership import _member_main; _member_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.log = log
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        cfg = {
            "heartbeat_interval_s": CONFIG.heartbeat_interval_s,
            "lease_s": CONFIG.lease_s,
            "timeout_s": CONFIG.timeout_s,
        }
        setup = {"port": port, "secret": SECRET.hex(), "role": role, "slot": slot, "config": cfg}
        hello = self._exchange(setup)
        self.id: str = hello["id"]
        self.pid: int = hello["pid"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def _exchange(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.post(msg)
        return self.answer(msg)

    def post(self, msg: dict[str, Any]) -> None:
        """Send one command without waiting for its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def answer(self, msg: Any = "") -> dict[str, Any]:
        """The answer to the command posted last (bounded)."""
        try:
            line = self._lines.get(timeout=REPLY_S)
        except queue.Empty:
            raise AssertionError(
                f"no answer to {msg} in {REPLY_S} s: {self.log.read_text()}"
            ) from None
        result: dict[str, Any] = json.loads(line)
        return result

    def do(self, op: str, **args: Any) -> Any:
        """The command's result; AssertionError when it raised."""
        got = self._exchange({"op": op, **args})
        assert "error" not in got, f"{self.id} {op}: {got}"
        return got["ok"]

    def fails(self, op: str, **args: Any) -> dict[str, Any]:
        """The error the command raised (it must raise)."""
        got = self._exchange({"op": op, **args})
        assert "error" in got, f"{self.id} {op} was expected to fail: {got}"
        return got

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._err.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    """The store, an observer ``Fleet`` and a factory of member processes (all stopped after)."""
    server = AuthStoreServer("127.0.0.1", 0, SECRET)
    observer = Fleet("127.0.0.1", server.port, SECRET, CONFIG)
    procs: list[Proc] = []

    def start(role: str, slot: int) -> Proc:
        proc = Proc(server.port, role, slot, tmp_path / f"{role}{slot}-{len(procs)}.log")
        procs.append(proc)
        return proc

    yield server, observer, start, procs
    for proc in procs:
        proc.stop()
    observer.close()
    server.close()


def _wait(observer: Fleet, predicate: Any) -> FleetView:
    return observer.wait_for(predicate, timeout=60.0)


def test_members_join_message_publish_ready_and_leave(fleet: Any) -> None:
    _, observer, start, _ = fleet
    prod, c0, c1 = start("producer", 0), start("consumer", 0), start("consumer", 1)
    view = _wait(observer, lambda v: len(v.members) == 3)
    assert view.ids() == [c0.id, c1.id, prod.id]  # sorted by (role, slot)
    assert {m.pid for m in view.members} == {prod.pid, c0.pid, c1.pid}
    assert all(m.incarnation == 1 and not m.ready and m.host for m in view.members)

    prod.do("send", to=c0.id, obj={"plan": [1, 2]})
    prod.do("send", to=c0.id, obj="second")
    assert c0.do("recv", **{"from": prod.id}) == {"plan": [1, 2]}
    assert c0.do("recv", **{"from": prod.id}) == "second"  # per-pair order
    prod.do("publish", name="meta", obj={"step": 7})
    assert c1.do("read", name="meta") == {"step": 7}
    assert observer.read("meta") == {"step": 7}

    c1.do("ready")
    ready = _wait(observer, lambda v: any(m.ready for m in v.members))
    assert [m.id for m in ready.members if m.ready] == [c1.id]
    assert ready.epoch == view.epoch  # a ready flag is no membership change

    c1.do("leave")
    after = _wait(observer, lambda v: len(v.members) == 2)
    assert after.epoch == view.epoch + 1
    err = prod.fails("send", to=c1.id, obj=1)
    assert err["error"] == "PeerGoneError" and c1.id in err["message"]


def test_sigkilled_member_is_removed_once_and_the_others_keep_working(fleet: Any) -> None:
    _, observer, start, procs = fleet
    prod, c0, c1 = start("producer", 0), start("consumer", 0), start("consumer", 1)
    before = _wait(observer, lambda v: len(v.members) == 3)
    c1.kill()  # no goodbye
    after = _wait(observer, lambda v: c1.id not in v.ids())
    assert after.ids() == [c0.id, prod.id], [p.log.read_text() for p in procs]
    assert after.epoch == before.epoch + 1
    for survivor in (prod, c0):
        assert survivor.do("wait_epoch", epoch=after.epoch) == after.epoch
    # exactly one process won the compare_set that removed it (its log line follows the win)
    survivors = [p for p in procs if p is not c1]
    mark, deadline = f"member {c1.id} (pid {c1.pid}", time.monotonic() + 60
    while (removals := sum(p.log.read_text().count(mark) for p in survivors)) < 1:
        assert time.monotonic() < deadline, [p.log.read_text() for p in survivors]
        time.sleep(0.05)
    assert removals == 1, [p.log.read_text() for p in survivors]
    # the others keep working; messages to or from the dead member fail fast, naming it
    prod.do("send", to=c0.id, obj=[3])
    assert c0.do("recv", **{"from": prod.id}) == [3]
    for err in (prod.fails("send", to=c1.id, obj=1), c0.fails("recv", **{"from": c1.id})):
        assert err["error"] == "PeerGoneError" and c1.id in err["message"]


def test_replacement_gets_a_higher_incarnation_and_the_old_one_is_fenced(fleet: Any) -> None:
    _, observer, start, _ = fleet
    prod, old = start("producer", 0), start("consumer", 3)
    old.do("publish", name="shard", obj="from the old one")
    os.kill(old.pid, signal.SIGSTOP)  # a stalled process: alive, but misses its lease
    try:
        gone = _wait(observer, lambda v: old.id not in v.ids())
        new = start("consumer", 3)
        view = _wait(observer, lambda v: new.id in v.ids())
        assert view.epoch == gone.epoch + 1
    finally:
        os.kill(old.pid, signal.SIGCONT)
    assert new.id == "consumer/3#2" and old.id == "consumer/3#1"
    for op, args in (("publish", {"name": "shard", "obj": 1}), ("ready", {}), ("send", {})):
        args = {"to": prod.id, "obj": 1} if op == "send" else args
        err = old.fails(op, **args)
        assert err["error"] == "FencedError" and old.id in err["message"], err
    err = prod.fails("read", name="shard")  # the old incarnation's value is refused
    assert err["error"] == "FencedError" and old.id in err["message"]
    new.do("publish", name="shard", obj="from the new one")
    assert prod.do("read", name="shard") == "from the new one"
    new.do("send", to=prod.id, obj="hello")
    assert prod.do("recv", **{"from": new.id}) == "hello"
    assert observer.view().ids() == [new.id, prod.id]


def test_a_stranger_cannot_join_and_the_members_are_unaffected(fleet: Any) -> None:
    server, observer, start, _ = fleet
    prod, c0 = start("producer", 0), start("consumer", 0)
    before = _wait(observer, lambda v: len(v.members) == 2)
    with pytest.raises(AuthenticationError):
        Fleet("127.0.0.1", server.port, b"\x01" * 32, CONFIG)
    assert len(server.refusals) == 1
    prod.do("send", to=c0.id, obj="still here")
    assert c0.do("recv", **{"from": prod.id}) == "still here"
    assert observer.view() == before


class _Bomb:
    """Unpickling it writes a marker file: proof that a payload was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path(self.path).write_text, ("unpickled",))


def test_forged_messages_and_values_are_refused_before_unpickling(tmp_path: Path) -> None:
    server = AuthStoreServer("127.0.0.1", 0, SECRET)
    marker = tmp_path / "marker"
    try:
        fleet = Fleet("127.0.0.1", server.port, SECRET, CONFIG)
        a = fleet.join("producer", 0, start_heartbeat=False)
        b = Fleet("127.0.0.1", server.port, SECRET, CONFIG).join(
            "consumer", 0, start_heartbeat=False
        )
        bomb = pickle.dumps(_Bomb(str(marker)))
        wrong_key = message_key(b"\x02" * 32)
        forged = [
            bomb + b"\x00" * 32,  # no valid tag
            seal(
                wrong_key, [b"default", b"p2p", a.id.encode(), b.id.encode(), b"", b"1"], 0, 1 << 20
            ),
        ]
        for data in forged:
            fleet.store.set(fleet.k(f"msg/{a.id}/{b.id}//1"), data)
            with pytest.raises(AuthenticationError, match="not unpickled"):
                b.recv(a.id, timeout=10)
        # a replay of a genuine message under the next counter fails too
        a.send(b.info, "one")
        assert b.recv(a.id, timeout=10) == "one"
        a.send(b.info, "two")
        genuine = fleet.peek(f"msg/{a.id}/{b.id}//2")
        assert genuine is not None
        fleet.store.set(fleet.k(f"msg/{a.id}/{b.id}//3"), genuine)
        assert b.recv(a.id, timeout=10) == "two"
        with pytest.raises(AuthenticationError):
            b.recv(a.id, timeout=10)
        fleet.store.set(fleet.k("pub/x"), pack_fields([a.id.encode(), b"1", bomb + b"\x00" * 32]))
        with pytest.raises(AuthenticationError):
            b.read("x", timeout=10)
        assert not marker.exists()
        with pytest.raises(MembershipTimeoutError):
            b.recv(a.id, timeout=0.5)
        b.leave()
        with pytest.raises(PeerGoneError, match=b.id):
            a.send(b.id, 1)
        a.leave()
    finally:
        server.close()


def test_scale_two_to_four_to_one(fleet: Any) -> None:
    _, observer, start, _ = fleet
    epochs = []
    consumers = [start("consumer", s) for s in (0, 1)]
    epochs.append(_wait(observer, lambda v: len(v.members) == 2).epoch)
    consumers += [start("consumer", s) for s in (2, 3)]
    epochs.append(_wait(observer, lambda v: len(v.members) == 4).epoch)
    consumers[1].do("leave")
    consumers[2].do("leave")
    consumers[3].kill()
    final = _wait(observer, lambda v: len(v.members) == 1)
    epochs.append(final.epoch)
    assert epochs == sorted(set(epochs)) and epochs[-1] == epochs[1] + 3
    assert final.ids() == [consumers[0].id]
    assert consumers[0].do("view")["epoch"] == final.epoch
    assert not [k for k in observer.store.list_keys() if "/msg/" in k]


def test_store_coordinator_over_members_names_a_dead_one_and_rebuilds(fleet: Any) -> None:
    _, observer, start, _ = fleet
    procs = [start("consumer", s) for s in (0, 1, 2)]
    _wait(observer, lambda v: len(v.members) == 3)
    for i, proc in enumerate(procs):
        assert proc.do("coord_make") == [i, 3]
    for proc in procs:
        proc.post({"op": "coord_ops"})
    results = [proc.answer() for proc in procs]
    for i, got in enumerate(results):
        assert got["ok"] == {
            "gathered": [p.id for p in procs],
            "told": {"plan": 0},
            "ring": (i - 1) % 3,
        }, got
    procs[2].kill()
    for proc in procs[:2]:
        proc.post({"op": "coord_barrier"})
    for proc in procs[:2]:
        err = proc.answer()
        assert err["error"] == "CoordinatorTimeoutError", err
        assert procs[2].id in err["message"] and "rank 2" in err["message"], err
    _wait(observer, lambda v: len(v.members) == 2)
    for i, proc in enumerate(procs[:2]):
        assert proc.do("coord_make") == [i, 2]
    for proc in procs[:2]:
        proc.post({"op": "coord_ops"})
    for proc in procs[:2]:
        assert proc.answer()["ok"]["gathered"] == [p.id for p in procs[:2]]
    assert not [k for k in observer.store.list_keys() if "/coll/" in k]


class _CoordinatorTask(DistributedTask):
    """Every operation of the store coordinator on a launch, sub-groups included."""

    def run(self, **_: Any) -> Any:
        cls: Any = get_coordinator_class(CoordinatorType.STORE)  # built as the registry builds it
        coord = cls(self.worker_info, timeout=60)
        coord.initialize()
        try:
            rank, world = coord.get_rank(), coord.get_world_size()
            coord.barrier()
            out = {
                "rank": rank,
                "gathered": coord.all_gather_object(rank * 10),
                "told": coord.broadcast_object("from 1" if rank == 1 else None, 1),
            }
            if rank == 0:
                coord.send_object({"to": 2}, 2)
            if rank == 2:
                out["p2p"] = coord.recv_object(0)
            group = coord.new_group([2, 0] if rank in (0, 2) else [1])
            out["group"] = [group.get_rank(), group.get_global_ranks()]
            out["group_gathered"] = group.all_gather_object(rank)
            group.barrier()
            assert world == 3
            return out
        finally:
            coord.close()


def test_store_coordinator_under_the_mp_launcher() -> None:
    results = MPLauncher(n_tasks=3).launch(task_type=_CoordinatorTask)
    assert [r["gathered"] for r in results] == [[0, 10, 20]] * 3
    assert [r["told"] for r in results] == ["from 1"] * 3
    assert results[2]["p2p"] == {"to": 2}
    assert [r["group"] for r in results] == [[1, [2, 0]], [0, [1]], [0, [2, 0]]]
    assert [r["group_gathered"] for r in results] == [[2, 0], [1], [2, 0]]


@pytest.mark.parametrize(
    ("backend", "device"), [("nixl_rdt", "cpu"), ("pynccl", "cuda")], ids=["nixl_cpu", "pynccl"]
)
def test_communicator_conformance_over_the_store_coordinator(backend: str, device: str) -> None:
    """A communicator that needs only object messages from its coordinator runs on this one."""
    from vllm_dist.testing.conformance import ConformanceTask, nccl_env

    reason = get_communicator_class(backend).unavailable_reason(device)
    if reason:
        pytest.skip(f"{backend} on {device}: {reason}")
    env = nccl_env(2) if device == "cuda" else {}
    reports = MPLauncher(2, timeout=240, env=env).launch(
        task_type=ConformanceTask,
        coordinator_type=CoordinatorType.STORE,
        communicator_type=backend,
        device=device,
    )
    failed = {(r, k): v for r, rep in enumerate(reports) for k, v in rep.items() if v != "skipped"}
    assert failed and all(v == "ok" for v in failed.values()), failed


def test_a_live_incarnation_replaced_in_its_slot_fences_itself() -> None:
    server = AuthStoreServer("127.0.0.1", 0, SECRET)
    try:
        old = Fleet("127.0.0.1", server.port, SECRET, CONFIG).join("consumer", 5)
        peer = Fleet("127.0.0.1", server.port, SECRET, CONFIG).join("producer", 0)
        old.send(peer.info, "before")
        new = Fleet("127.0.0.1", server.port, SECRET, CONFIG).join("consumer", 5)
        assert (old.info.incarnation, new.info.incarnation) == (1, 2)
        assert peer.view().ids() == [new.id, peer.id]
        deadline = time.monotonic() + 60
        while not old.fenced and time.monotonic() < deadline:  # its next heartbeat notices
            time.sleep(0.05)
        assert "newer incarnation" in old.fenced
        with pytest.raises(FencedError):
            old.send(peer.info, "after")
        with pytest.raises(PeerGoneError, match=old.id):  # its messages were released
            peer.recv(old.id, timeout=10)
        for member in (new, peer, old):
            member.leave()
    finally:
        server.close()


def test_release_deletes_only_the_departed_members_keys() -> None:
    server = AuthStoreServer("127.0.0.1", 0, SECRET)
    try:
        fleet = Fleet("127.0.0.1", server.port, SECRET, CONFIG)
        a, b, c = "rank/0#1", "rank/1#1", "rank/2#1"
        keys = {
            f"coll/g/{a},{b},{c}/1/barrier/0": True,  # a group with c
            f"coll/g/{c},{a}/sub1-0123/2/all_gather/1": True,  # a sub-group with c
            f"coll/g/{a},{b}/sub1-4567/1/barrier/0": False,  # made from c's group, without c
            f"msg/{a}/{c}/g/{a},{c}/1": True,
            f"msg/{c}/{b}//1": True,
            f"msg/{a}/{b}/g/{a},{b},{c}/1": False,  # a channel naming c, between a and b
            f"coll/g/{a},rank/2#12/1/barrier/0": False,  # another incarnation's id as prefix
        }
        for key in keys:
            fleet.store.set(fleet.k(key), b"1")
        fleet.release(c)
        for key, gone in keys.items():
            assert (fleet.peek(key) is None) == gone, key
        fleet.close()
    finally:
        server.close()


def test_the_store_does_not_grow_as_members_join_message_and_leave() -> None:
    """A slot taken again and again (leaving cleanly, or replaced while live), with messages
    both ways each time: the store's key count stays that of the first round."""
    server = AuthStoreServer("127.0.0.1", 0, SECRET)
    try:
        host = Fleet("127.0.0.1", server.port, SECRET, CONFIG).join("producer", 0)
        counts = []
        for round_ in range(4):
            guest = Fleet("127.0.0.1", server.port, SECRET, CONFIG).join("consumer", 1)
            guest.send(host.info, round_)
            assert host.recv(guest.id, timeout=10) == round_
            host.send(guest.info, round_)
            assert guest.recv(host.id, timeout=10) == round_
            guest.leave()
            guest.fleet.close()
            counts.append(len(host.fleet.store.list_keys()))
        assert counts[1:] == counts[:1] * 3, counts
        host.leave()
    finally:
        server.close()


def test_store_coordinator_refuses_no_secret_and_names_a_taken_port() -> None:
    from vllm_dist.implementations.coordinators.store_coordinator import StoreCoordinator
    from vllm_dist.interfaces import RendezvousPortTakenError, WorkerInfo

    holder = AuthStoreServer("127.0.0.1", 0, SECRET)

    def worker(port: int, secret: bytes) -> WorkerInfo:
        return WorkerInfo(
            rank=0,
            world_size=1,
            local_rank=0,
            local_world_size=1,
            master_addr="127.0.0.1",
            master_port=port,
            secret=secret,
        )

    try:
        with pytest.raises(ValueError, match="VLLM_DIST_SECRET"):
            StoreCoordinator(worker(holder.port, b""), timeout=10).initialize()
        with pytest.raises(RendezvousPortTakenError):
            StoreCoordinator(worker(holder.port, SECRET), timeout=10).initialize()
        coord = StoreCoordinator(worker(_free_port(), SECRET), timeout=10)
        coord.initialize()
        assert (coord.get_rank(), coord.get_world_size(), coord.broadcast_object(7, 0)) == (0, 1, 7)
        coord.barrier()
        assert coord.all_gather_object("x") == ["x"]
        coord.close()
    finally:
        holder.close()


def _free_port() -> int:
    from vllm_dist.implementations.launchers.common import find_free_port

    return int(find_free_port("127.0.0.1"))
