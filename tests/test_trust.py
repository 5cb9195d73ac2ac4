"""Trust between launches: every attack on the control plane, tried on loopback and refused.

Each attack shows the refusal and that the legitimate launch or fleet still finished with
byte-exact results: a bare torch.distributed process at a launch's or a fleet's rendezvous, a
process that binds the fleet's port first and poses as the trainer, a consumer launch with the
wrong token, listeners outside loopback, a forged / unsigned / replayed object message, and a
JoinSpec without a secret. Every wait is bounded; nothing is judged by timing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.utils import distributed_test
from vllm_dist import (
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    LaunchError,
    MPLauncher,
)
from vllm_dist.examples.llama_tp import llama_shapes, tiny_llama_config
from vllm_dist.examples.weight_sync_demo import LlamaTransferTask
from vllm_dist.implementations.coordinators.auth_store import (
    MAGIC,
    NONCE_BYTES,
    AuthStoreClient,
    AuthStoreServer,
)
from vllm_dist.implementations.coordinators.binding import (
    GLOO_IFNAME_ENV,
    gloo_bind_host,
    listening_sockets,
    listening_summary,
)
from vllm_dist.implementations.coordinators.signed_objects import SignedObjects, object_key
from vllm_dist.implementations.launchers.common import find_free_port
from vllm_dist.interfaces import AuthenticationError, WorkerInfo
from vllm_dist.tasks.weight_transfer import JoinSpec, WeightTransferTask
from vllm_dist.tasks.weight_transfer import task as wt_task

WAIT_S = 60.0
SECRET = bytes(range(32))
LOOPBACK = {"127.0.0.1", "::1"}

# A bare torch.distributed process: a TCPStore client that tries to list, read, delete and
# overwrite keys, then init_process_group at the same address to take rank 1. Prints JSON.
ATTACKER = r"""
import datetime, json, sys
import torch.distributed as dist
host, port = sys.argv[1], int(sys.argv[2])
t = datetime.timedelta(seconds=5)
out = {}
try:
    s = dist.TCPStore(host, port, is_master=False, timeout=t)
    out["store"] = {"keys": s.num_keys(), "list": s.list_keys() if hasattr(s, "list_keys") else 0}
    s.set("vllm_dist/x", "evil"); s.delete_key("vllm_dist/x")
except Exception as exc:
    out["store_error"] = type(exc).__name__
try:
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=1, world_size=2,
                            timeout=t)
    out["joined"] = True
except Exception as exc:
    out["join_error"] = type(exc).__name__
print(json.dumps(out))
"""


def _attack(port: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", ATTACKER, "127.0.0.1", str(port)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.05)


def _listening_on(port: int) -> bool:
    for family in ("tcp", "tcp6"):
        with open(f"/proc/net/{family}") as table:
            for line in list(table)[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].split(":")[1], 16) == port:
                    return True
    return False


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not _listening_on(port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on port {port} within {WAIT_S} s")
        time.sleep(0.05)


# -- the store, in this process --------------------------------------------------------------------
def _store(port: int, secret: bytes = SECRET, server: Any = None) -> AuthStoreClient:
    return AuthStoreClient(
        "127.0.0.1", port, secret, timeout=datetime.timedelta(seconds=10), server=server
    )


def test_store_commands_and_refusals(caplog: pytest.LogCaptureFixture) -> None:
    server = AuthStoreServer("127.0.0.1", 0, SECRET)
    try:
        a, b = _store(server.port, server=server), _store(server.port)
        a.set("k", b"\x00\xff")
        assert b.get("k") == b"\x00\xff"
        assert b.add("n", 2) == 2 and a.add("n", 3) == 5 and a.get("n") == b"5"
        assert a.compare_set("c", "", "x") == b"x" and a.compare_set("c", "y", "z") == b"x"
        assert a.check(["k", "c"]) and not a.check(["k", "absent"])
        a.multi_set(["m1", "m2"], [b"1", b"2"])
        assert b.multi_get(["m1", "m2"]) == [b"1", b"2"]
        a.append("m1", b"3")
        assert b.get("m1") == b"13" and a.num_keys() == 5
        assert sorted(a.list_keys()) == ["c", "k", "m1", "m2", "n"]
        assert a.delete_key("c") and not a.delete_key("c")
        threading.Timer(0.2, lambda: b.set("late", b"1")).start()
        a.wait(["late"], datetime.timedelta(seconds=10))
        with (
            caplog.at_level(logging.WARNING, logger="vllm_dist"),
            pytest.raises(AuthenticationError, match=r"same JoinSpec\(token=\.\.\.\)"),
        ):
            _store(server.port, secret=b"\x01" * 32)
        assert len(server.refusals) == 1 and server.refusals[0].startswith("127.0.0.1:")
        assert server.refusals[0] in caplog.text
        # rank 0's own wait for peers says how many were refused, and from where
        with pytest.raises(dist.DistStoreError, match="1 connection.* refused for a wrong secret"):
            a.wait(["never"], datetime.timedelta(seconds=0.2))
        assert b.get("k") == b"\x00\xff"  # the members' connections are still served
        a.close()
        b.close()
    finally:
        server.close()


def test_store_refuses_commands_sent_without_the_challenge() -> None:
    """A stranger that speaks the store's framing but skips the challenge writes nothing."""
    from vllm_dist.implementations.coordinators.auth_store import _HEAD, SET, pack_fields

    server = AuthStoreServer("127.0.0.1", 0, SECRET)
    try:
        member = _store(server.port)
        member.set("weights/addr", b"real")
        body = pack_fields([b"weights/addr", b"evil"])
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
            raw.sendall((_HEAD.pack(SET, len(body)) + body) * 4)
            raw.settimeout(10)
            reply = b""
            with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread
                while chunk := raw.recv(4096):
                    reply += chunk
        assert reply.startswith(MAGIC)  # the challenge, then the refusal and the close
        assert member.get("weights/addr") == b"real" and member.num_keys() == 1
        assert len(server.refusals) == 1
        member.close()
    finally:
        server.close()


def test_store_binds_exactly_the_given_address() -> None:
    server = AuthStoreServer("127.0.0.1", 0, SECRET)
    try:
        mine = [s for s in listening_sockets() if s.port == server.port]
        assert [(s.family, s.address) for s in mine] == [("tcp", "127.0.0.1")]
    finally:
        server.close()
    if socket.has_ipv6:
        try:
            server = AuthStoreServer("[::1]", 0, SECRET)
        except OSError:
            return  # no IPv6 loopback here
        try:
            client = AuthStoreClient(
                "[::1]", server.port, SECRET, timeout=datetime.timedelta(seconds=10)
            )
            client.set("k", b"v")
            assert client.get("k") == b"v"
            client.close()
            mine = [s for s in listening_sockets() if s.port == server.port]
            assert [(s.family, s.address) for s in mine] == [("tcp6", "::1")]
        finally:
            server.close()


class _Impostor:
    """Binds a port first and answers the challenge as if it were the store, without the
    secret; records every byte a client sends after the challenge."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handshakes = 0
        self.after: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(WAIT_S)
        with self.sock, self.sock.accept()[0] as conn:
            conn.settimeout(10)
            conn.sendall(MAGIC + os.urandom(NONCE_BYTES))
            got = b""
            while len(got) < 2 * NONCE_BYTES:
                got += conn.recv(64)
            self.handshakes += 1
            conn.sendall(b"\x01" + os.urandom(32))  # "accepted", with a made-up proof
            try:
                while chunk := conn.recv(4096):
                    self.after.append(chunk)
            except OSError:
                pass


def test_store_client_detects_an_impostor_and_sends_it_nothing() -> None:
    impostor = _Impostor()
    with pytest.raises(AuthenticationError, match="the port belongs to another launch"):
        _store(impostor.port)
    impostor.thread.join(WAIT_S)
    assert impostor.handshakes == 1 and impostor.after == []


# -- object messages ---------------------------------------------------------------------------------
class _Creates:
    """Unpickling this creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


class ForgeryTask(GlobalCoordinatorDistributedTask):
    """Rank 1 sends rank 0 an unsigned (torch's own) object, one signed under another key and a
    replay of a genuine one, each a pickle that would create ``marker``; rank 0 must refuse all
    three without unpickling and then still receive genuine objects byte for byte."""

    def post_init_distributed(self, marker: str = "", **_: Any) -> Any:
        coord: Any = self.coordinator
        group, rank, payload = coord.process_group, coord.get_rank(), bytes(range(256)) * 3
        evil = _Creates(marker)
        refused = []
        if rank == 1:
            dist.send_object_list([evil], group_dst=0, group=group)  # unsigned
            SignedObjects(object_key(b"\x07" * 32), group, [0, 1], 1).send(evil, 0)  # forged
            coord.send_object(payload, 0)
            replay = coord._signed._seal(evil, "p2p", 0, 1)  # tagged as message #1: a replay
            dist.send(torch.tensor([len(replay)], dtype=torch.int64), group_dst=0, group=group)
            dist.send(
                torch.frombuffer(bytearray(replay), dtype=torch.uint8), group_dst=0, group=group
            )
            coord.send_object(payload[::-1], 0)
            got = None
        else:
            got = []
            for _ in range(2):
                with pytest.raises(AuthenticationError, match="not unpickled") as info:
                    coord.recv_object(1)
                refused.append(str(info.value))
            got.append(coord.recv_object(1))
            with pytest.raises(AuthenticationError, match="not unpickled") as info:
                coord.recv_object(1)  # the replay
            refused.append(str(info.value))
            got.append(coord.recv_object(1))
        gathered = coord.all_gather_object(payload[rank:])
        if rank == 1:  # last: torch's own broadcast where rank 0 expects a signed one
            dist.broadcast_object_list([evil], group_src=1, group=group)
        else:
            with pytest.raises(AuthenticationError, match="group rank 1"):
                coord.broadcast_object(None, src=1)
        return {"got": got, "gathered": gathered, "refused": refused}


@distributed_test(timeout=180)
def test_forged_objects_are_refused_before_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    results = MPLauncher(2, timeout=120).launch(
        task_type=ForgeryTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.TORCH_DISTRIBUTED,
        marker=str(marker),
    )
    payload = bytes(range(256)) * 3
    assert not marker.exists()
    assert results[0]["got"] == [payload, payload[::-1]]
    assert len(results[0]["refused"]) == 3
    assert all("launch rank 1" in r for r in results[0]["refused"])
    assert results[0]["gathered"] == results[1]["gathered"] == [payload, payload[1:]]


# -- a launch's rendezvous ---------------------------------------------------------------------------
class ExposedLaunchTask(GlobalCoordinatorDistributedTask):
    """Rank 0 publishes its rendezvous port and waits while a stranger attacks it; then every
    rank reports what it listens on and the launch exchanges bytes as usual."""

    def post_init_distributed(self, port_file: str = "", done_file: str = "", **_: Any) -> Any:
        coord: Any = self.coordinator
        if coord.get_rank() == 0:
            Path(port_file + ".tmp").write_text(str(self.worker_info.master_port))
            os.rename(port_file + ".tmp", port_file)
            _wait_for(Path(done_file))
        coord.barrier(timeout=WAIT_S * 2)
        return {
            "port": self.worker_info.master_port,
            "listeners": [(s.family, s.address, s.port) for s in listening_sockets()],
            "gathered": coord.all_gather_object(bytes([coord.get_rank()]) * 1000),
            "refusals": len(coord.rendezvous_refusals),
        }


@distributed_test(timeout=180)
def test_bare_torch_process_cannot_enter_a_launch_and_nothing_listens_outside_loopback(
    tmp_path: Path,
) -> None:
    port_file, done_file = tmp_path / "port", tmp_path / "done"
    out: dict[str, Any] = {}

    def launch() -> None:
        try:
            out["results"] = MPLauncher(2, timeout=150).launch(
                task_type=ExposedLaunchTask,
                coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
                communicator_type=CommunicatorType.TORCH_DISTRIBUTED,
                port_file=str(port_file),
                done_file=str(done_file),
            )
        except Exception as exc:  # handed to the test
            out["results"] = exc

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    try:
        _wait_for(port_file)
        attack = _attack(int(port_file.read_text()))
    finally:
        done_file.write_text("done")
    thread.join(WAIT_S * 2)
    results = out["results"]
    assert isinstance(results, list), results
    assert "store" not in attack and "joined" not in attack, attack
    assert results[0]["refusals"] >= 1
    assert results[0]["gathered"] == results[1]["gathered"] == [b"\x00" * 1000, b"\x01" * 1000]
    # (d) the store (rank 0) and gloo (every rank) listen on loopback only
    port = results[0]["port"]
    assert [tuple(e) for e in results[0]["listeners"] if e[2] == port] == [
        ("tcp", "127.0.0.1", port)
    ]
    for r in results:
        assert r["listeners"], r
        assert {address for _, address, _ in r["listeners"]} <= LOOPBACK, r["listeners"]


def test_listening_summary_names_loopback_for_a_loopback_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(GLOO_IFNAME_ENV, raising=False)
    rows = listening_summary("127.0.0.1", authenticated=True)
    assert [row[1] for row in rows] == ["127.0.0.1", "127.0.0.1"]
    assert "HMAC" in rows[0][2]
    assert gloo_bind_host("127.0.0.1") == "127.0.0.1"
    monkeypatch.setenv(GLOO_IFNAME_ENV, "lo")  # the user's choice wins
    assert gloo_bind_host("127.0.0.1") is None
    assert "unauthenticated" in listening_summary("127.0.0.1", authenticated=False)[0][2]


# -- a fleet of two launches -------------------------------------------------------------------------
class CountingTask(LlamaTransferTask):
    """The producer reports the connections its store refused, after its last sync."""

    def after_producer_sync(self, step: int, source: Any, **kw: Any) -> Any:
        return {"refusals": len(self.coordinator.rendezvous_refusals)}  # type: ignore[attr-defined]


def _fleet_launch(role: str, port: int, timeout: float = 150, **spec: Any) -> Any:
    join = JoinSpec(
        host="127.0.0.1", port=port, role=role, num_producers=1, num_consumers=1, **spec
    )
    try:
        return MPLauncher(1, timeout=timeout).launch(
            task_type=CountingTask,
            coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
            communicator_type=CommunicatorType.TORCH_DISTRIBUTED,
            device="cpu",
            coordinator_options={"timeout": 90.0},
            join=join,
            shapes=llama_shapes(tiny_llama_config()),
            tp_size=1,
            syncs=1,
        )
    except Exception as exc:  # handed to the test
        return exc


def _start_producer(port: int, **spec: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: out.update(producer=_fleet_launch("producer", port, **spec)), daemon=True
    )
    thread.start()
    _wait_listening(port)
    return thread, out


def _assert_fleet_finished(producer: Any, consumer: Any) -> int:
    assert isinstance(producer, list) and isinstance(consumer, list), (producer, consumer)
    assert consumer[0]["outputs"][0]["verified"] is True, consumer
    return int(producer[0]["outputs"][0]["refusals"])


@distributed_test(timeout=240)
def test_strangers_and_wrong_tokens_take_no_place_in_a_fleet(tmp_path: Path) -> None:
    """(a) a bare torch process at the fleet's port and (c) a consumer launch with another token
    are refused; the producer counts them and the real consumer still gets every byte. The
    secret comes from a token file the producer side creates."""
    port, token_file = find_free_port("127.0.0.1"), tmp_path / "fleet.token"
    thread, out = _start_producer(port, token_file=str(token_file))
    assert token_file.stat().st_mode & 0o777 == 0o600
    attack = _attack(port)
    assert "store" not in attack and "joined" not in attack, attack
    wrong = _fleet_launch("consumer", port, timeout=90, token=JoinSpec.new_token())
    assert isinstance(wrong, LaunchError), wrong
    assert "AuthenticationError" in str(wrong) and "same JoinSpec(token=...)" in str(wrong)
    token = token_file.read_text().strip()
    assert token not in str(wrong)
    consumer = _fleet_launch("consumer", port, token_file=str(token_file))
    thread.join(WAIT_S * 3)
    assert _assert_fleet_finished(out.get("producer"), consumer) >= 2
    assert token not in str(out["producer"]) + str(consumer)


@distributed_test(timeout=120)
def test_a_process_that_binds_the_fleet_port_first_gets_nothing() -> None:
    """(b) the consumer launch finds an impostor at the port: it fails with AuthenticationError
    and sends nothing after the challenge; against a torch TCPStore it sends nothing at all."""
    impostor = _Impostor()
    consumer = _fleet_launch("consumer", impostor.port, timeout=90, token=JoinSpec.new_token())
    impostor.thread.join(WAIT_S)
    assert isinstance(consumer, LaunchError), consumer
    assert "AuthenticationError" in str(consumer)
    assert "the port belongs to another launch" in str(consumer)
    assert impostor.handshakes == 1 and impostor.after == []

    port = find_free_port("127.0.0.1")
    fake = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    before = fake.num_keys()
    consumer = _fleet_launch("consumer", port, timeout=90, token=JoinSpec.new_token())
    assert isinstance(consumer, LaunchError) and "AuthenticationError" in str(consumer)
    assert fake.num_keys() == before


# -- JoinSpec's secret, resolved in the parent -------------------------------------------------------
def _spec(**kw: Any) -> JoinSpec:
    return JoinSpec(
        host="127.0.0.1", port=1, role="consumer", num_producers=1, num_consumers=1, **kw
    )


def test_joinspec_secret_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(wt_task.FLEET_TOKEN_ENV, raising=False)
    with pytest.raises(
        ValueError, match="token=JoinSpec.new_token.*VLLM_DIST_FLEET_TOKEN.*token_file"
    ):
        WeightTransferTask.check_launch_kwargs(1, join=_spec())
    with pytest.raises(ValueError, match="token=JoinSpec.new_token"):
        MPLauncher(1).launch(task_type=LlamaTransferTask, join=_spec())  # refused in the parent
    with pytest.raises(ValueError, match="at least 32 hex digits"):
        _spec(token="abcd" * 4)
    with pytest.raises(ValueError, match="at least 16"):
        _spec(token=b"short")
    token = JoinSpec.new_token()
    spec = _spec(token=token)
    assert token not in repr(spec) and spec.secret() == bytes.fromhex(token)
    info = WorkerInfo(
        rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="h", master_port=1
    )
    fleet = spec.fleet_info(info)
    assert fleet.secret == bytes.fromhex(token) and token not in repr(fleet)

    monkeypatch.setenv(wt_task.FLEET_TOKEN_ENV, token)
    WeightTransferTask.check_launch_kwargs(1, join=_spec())
    assert _spec().secret() == bytes.fromhex(token) and token not in repr(_spec())
    monkeypatch.setenv(wt_task.FLEET_TOKEN_ENV, "not hex")
    with pytest.raises(ValueError, match=wt_task.FLEET_TOKEN_ENV) as bad:
        _spec()
    assert "not hex" not in str(bad.value)
    monkeypatch.delenv(wt_task.FLEET_TOKEN_ENV)

    path = tmp_path / "t"
    producer = JoinSpec(
        host="h", port=1, role="producer", num_producers=1, num_consumers=1, token_file=str(path)
    )
    WeightTransferTask.check_launch_kwargs(1, join=producer)
    secret = producer.secret()
    assert path.stat().st_mode & 0o777 == 0o600 and producer.secret() == secret
    assert _spec(token_file=str(path)).secret() == secret
    monkeypatch.setattr(wt_task, "TOKEN_FILE_WAIT_S", 0.2)
    with pytest.raises(TimeoutError, match="start the producer launch"):
        _spec(token_file=str(tmp_path / "absent")).secret()
