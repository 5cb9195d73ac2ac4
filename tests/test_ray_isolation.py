"""RayLauncher and other people's Ray: private by default, joins only when told, owner-only token.

Each test runs its drivers in a fresh interpreter with its own short ``RAY_TMPDIR`` (Ray's socket
paths have a length limit), so no test here touches the session's Ray or another user's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils import distributed_test

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

WHERE = """
    import json
    import ray
    from vllm_dist import DistributedTask, RayLauncher

    class Where(DistributedTask):
        def run(self):
            return ray.get_runtime_context().get_node_id()

    def where(**options):
        nodes = RayLauncher(1, timeout=90, **options).launch(task_type=Where)
        gcs = ray.get_runtime_context().gcs_address
        ray.shutdown()
        return {"gcs": gcs, "node": nodes[0]}
"""


def _run_python(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ray start exited with {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"ray start did not listen on {port} within {timeout:g} s")


@pytest.fixture
def other_cluster() -> Iterator[str]:
    """Somebody else's Ray: ``ray start --head --block`` on loopback, stopped by its own pid
    (SIGTERM: Ray's handler stops the processes that node started), never with ``ray stop``."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="rayo")
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=1",
        "--include-dashboard=false",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        start_new_session=True,  # its own process group: ours to stop, nobody else's
    )
    try:
        _wait_for_port(port, proc, timeout=120)
        time.sleep(2)  # the raylet registers with the GCS after the GCS listens
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group started above, and only it
            proc.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


@distributed_test(timeout=400)
def test_starts_a_private_cluster_unless_given_an_address(other_cluster: str) -> None:
    """RAY_ADDRESS names another cluster: ``RayLauncher()`` does not join it, while
    ``address=`` (the address, or ``"auto"`` which reads RAY_ADDRESS) does."""
    code = (
        WHERE
        + f"""
    print("RESULT", json.dumps({{
        "private": where(),
        "given": where(address={other_cluster!r}),
        "auto": where(address="auto"),
    }}))
    """
    )
    ray_tmp = tempfile.mkdtemp(prefix="ray")
    try:
        env = {"RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": other_cluster}
        proc = _run_python(code, env, timeout=360)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    seen = json.loads(line[len("RESULT ") :])
    assert seen["private"]["gcs"] != other_cluster, seen
    assert seen["given"]["gcs"] == other_cluster and seen["auto"]["gcs"] == other_cluster, seen
    assert seen["private"]["node"] != seen["given"]["node"] == seen["auto"]["node"], seen


@distributed_test(timeout=300)
def test_private_cluster_token_is_readable_only_by_the_user(tmp_path: Path) -> None:
    """With Ray's authentication on (its default for a new cluster), the token the launch
    creates is mode 0600 and an older world-readable one is made 0600 too."""
    code = """
        from vllm_dist import DistributedTask, RayLauncher

        class Rank(DistributedTask):
            def run(self):
                return self.worker_info.rank

        assert RayLauncher(2, timeout=90, keep_ray=False).launch(task_type=Rank) == [0, 1]
        print("LAUNCHED")
        """
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), RAY_TMPDIR=ray_tmp, RAY_ADDRESS="")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0 and "LAUNCHED" in proc.stdout, proc.stderr[-3000:]
    assert "Token authentication is enabled" in proc.stderr, "auth was expected on"
    token = home / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) & 0o077 == 0


def test_an_older_world_readable_token_is_made_owner_only(tmp_path: Path, monkeypatch) -> None:
    from vllm_dist.implementations.launchers.ray import _restrict_default_token

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    _restrict_default_token()  # no token: nothing to do
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("t" * 32)
    token.chmod(0o644)
    _restrict_default_token()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))  # the user's own file: left alone
    _restrict_default_token()
    assert stat.S_IMODE(token.stat().st_mode) == 0o644


def test_rejects_an_empty_address() -> None:
    from vllm_dist import RayLauncher

    for bad in ("", "  ", 5):
        with pytest.raises(ValueError, match="address must be"):
            RayLauncher(1, address=bad)  # type: ignore[arg-type]
