"""MPLauncher's per-rank logs, error files and restarts, and the ``vllm_dist`` logging convention.

Launches here are real: spawned workers, real files under ``tmp_path``, the parent's real stderr.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from tests.utils import distributed_test
from vllm_dist import DistributedTask, LaunchError, LaunchTimeoutError, MPLauncher, WorkerInfo
from vllm_dist.implementations.launchers.common import guarded_line
from vllm_dist.log import LOG_LEVEL_ENV, get_logger, log_level


class Talks(DistributedTask):
    """Writes a line to stdout and to stderr, logs a warning and a debug record; rank ``bad``
    raises on every try before ``ok_from`` (never, by default)."""

    def run(self, *, bad: int = -1, ok_from: int = 1 << 30, hang: bool = False) -> int:
        rank, tries = self.worker_info.rank, self.worker_info.restart_count
        print(f"out of rank {rank}", flush=True)
        os.write(2, f"err of rank {rank}\n".encode())
        log = get_logger("vllm_dist.tests.talks")
        log.warning("careful from rank %d", rank)
        log.debug("detail from rank %d", rank)
        if rank == bad and tries < ok_from:
            if hang:
                time.sleep(600)
            raise RuntimeError(f"rank {rank} fails on try {tries}")
        return tries


def _run_dir(launcher: MPLauncher) -> str:
    assert launcher.last_run_dir is not None
    return launcher.last_run_dir


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


# -- per-rank logs -------------------------------------------------------------------------------
@distributed_test(timeout=120)
def test_log_dir_holds_each_ranks_streams_and_tee_shows_the_chosen_one(tmp_path, capfd) -> None:
    launcher = MPLauncher(2, timeout=60, log_dir=tmp_path / "logs", tee="stderr")
    assert launcher.launch(task_type=Talks) == [0, 0]
    out, err = capfd.readouterr()
    run = _run_dir(launcher)
    assert os.path.dirname(run) == str(tmp_path / "logs")
    for rank in (0, 1):
        folder = os.path.join(run, "attempt_0", str(rank))
        assert _read(os.path.join(folder, "stdout.log")) == f"out of rank {rank}\n"
        assert f"err of rank {rank}\n" in _read(os.path.join(folder, "stderr.log"))
        assert f"careful from rank {rank}" in _read(os.path.join(folder, "stderr.log"))
        assert not os.path.exists(os.path.join(folder, "error.json"))
        assert f"[rank{rank}]:err of rank {rank}" in err  # teed, with the console's prefix
    assert "out of rank" not in out  # stdout went to the files only


@distributed_test(timeout=120)
def test_console_ranks_filters_the_console_only(tmp_path, capfd) -> None:
    launcher = MPLauncher(2, timeout=60, log_dir=tmp_path, tee=True, console_ranks=[1])
    launcher.launch(task_type=Talks)
    out, err = capfd.readouterr()
    assert "[rank1]:out of rank 1" in out and "rank 0" not in out + err
    assert _read(os.path.join(_run_dir(launcher), "attempt_0", "0", "stdout.log"))


@distributed_test(timeout=120)
def test_a_failed_rank_gets_an_error_file_that_the_error_names(tmp_path) -> None:
    launcher = MPLauncher(2, timeout=60, log_dir=tmp_path)
    with pytest.raises(LaunchError) as err:
        launcher.launch(task_type=Talks, bad=1)
    failure = err.value.first
    assert failure is not None and failure.rank == 1
    folder = os.path.join(_run_dir(launcher), "attempt_0", "1")
    assert failure.log_files == tuple(
        os.path.join(folder, name) for name in ("stdout.log", "stderr.log", "error.json")
    )
    assert f"logs: {os.path.join(folder, 'stdout.log')}" in str(err.value)
    record = json.loads(_read(os.path.join(folder, "error.json")))
    assert record["rank"] == 1 and record["restart_count"] == 0 and record["pid"] > 0
    assert record["host"] and record["time"] > 0 and record["kind"] == "raised"
    assert "RuntimeError: rank 1 fails on try 0" in record["traceback"]


def test_bad_log_options_are_refused_before_workers_start(tmp_path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for path in (a_file, a_file / "below"):
        with pytest.raises(ValueError, match="is a file, not a folder"):
            MPLauncher(2, log_dir=path)
    with pytest.raises(TypeError, match="log_dir"):
        MPLauncher(2, log_dir=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tee must be one of"):
        MPLauncher(2, log_dir=tmp_path, tee="both")
    with pytest.raises(ValueError, match=r"console_ranks: \[2\]"):
        MPLauncher(2, console_ranks=[0, 2])
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]  # nothing was created


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes everywhere")
def test_an_unwritable_log_dir_is_refused(tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot write"):
        MPLauncher(2, log_dir=locked / "logs")


# -- restarts ------------------------------------------------------------------------------------
class Records(DistributedTask):
    """Appends its try and launch id to a file; rank 1 fails on try 0 (raise or exit) once
    rank 0 has written its line."""

    def run(self, *, folder: str, mode: str) -> int:
        info = self.worker_info
        assert WorkerInfo.from_env().restart_count == info.restart_count
        with open(os.path.join(folder, f"rank{info.rank}"), "a") as f:
            f.write(f"{info.restart_count} {info.launch_id} {info.master_port}\n")
        if info.restart_count == 0 and info.rank == 1:
            _wait_for_file(os.path.join(folder, "rank0"))  # rank 0 has run try 0 as well
            if mode == "exit":
                os._exit(3)
            raise RuntimeError("first try fails")
        return info.restart_count


def _wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


@distributed_test(timeout=120)
@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_a_launch_that_fails_once_is_restarted_as_a_whole(tmp_path, mode: str) -> None:
    assert MPLauncher(2, timeout=60, max_restarts=2).launch(
        task_type=Records, folder=str(tmp_path), mode=mode
    ) == [1, 1]
    for rank in (0, 1):
        tries = [line.split() for line in _read(str(tmp_path / f"rank{rank}")).splitlines()]
        assert [t[0] for t in tries] == ["0", "1"]  # rank 0 ran again too: the group restarts
        assert tries[0][1] != tries[1][1]  # a fresh launch id (and secret) for each try


class HangsOnce(DistributedTask):
    def run(self) -> int:
        if self.worker_info.restart_count == 0 and self.worker_info.rank == 0:
            time.sleep(600)
        return self.worker_info.restart_count


@distributed_test(timeout=180)
def test_a_hung_try_is_stopped_at_its_timeout_and_started_again() -> None:
    # each try gets its own timeout: try 1 only has to start and return within it
    assert MPLauncher(2, timeout=12, max_restarts=1).launch(task_type=HangsOnce) == [1, 1]
    with pytest.raises(LaunchTimeoutError, match="all 2 tries"):  # the last try's error type
        MPLauncher(2, timeout=3, max_restarts=1).launch(task_type=Talks, bad=0, hang=True)


@distributed_test(timeout=180)
def test_a_launch_that_always_fails_reports_every_try(tmp_path) -> None:
    launcher = MPLauncher(2, timeout=60, max_restarts=2, log_dir=tmp_path)
    with pytest.raises(LaunchError) as err:
        launcher.launch(task_type=Talks, bad=0)
    text = str(err.value)
    assert text.startswith("launch failed on all 3 tries (max_restarts=2):")
    assert "try 1: rank 0 raised an exception (RuntimeError: rank 0 fails on try 0)" in text
    assert "try 2: rank 0 raised an exception (RuntimeError: rank 0 fails on try 1)" in text
    assert "RuntimeError: rank 0 fails on try 2" in err.value.failures[0].traceback
    assert [len(e.failures) > 0 for e in err.value.earlier_tries] == [True, True]
    for attempt in range(3):
        assert os.path.exists(os.path.join(_run_dir(launcher), f"attempt_{attempt}", "0"))


@pytest.mark.parametrize("value", [-1, 1.0, True, "2", None])
def test_bad_max_restarts_are_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
        MPLauncher(2, max_restarts=value)


# -- the logging convention ----------------------------------------------------------------------
@distributed_test(timeout=120)
def test_a_workers_warning_reaches_the_parents_stderr_with_its_rank(capfd) -> None:
    MPLauncher(2, timeout=60).launch(task_type=Talks)
    _, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank{rank}]:WARNING" in err and f"careful from rank {rank}" in err
    assert "detail from rank" not in err  # WARNING unless asked


@distributed_test(timeout=120)
def test_unprefixed_output_still_names_the_rank_in_log_records(capfd) -> None:
    MPLauncher(2, timeout=60, prefix_output=False).launch(task_type=Talks)
    _, err = capfd.readouterr()
    assert "[rank1]:WARNING" in err and "\nerr of rank 1\n" in "\n" + err


@distributed_test(timeout=120)
def test_debug_level_shows_debug_records(capfd) -> None:
    MPLauncher(2, timeout=60, env={LOG_LEVEL_ENV: "debug"}).launch(task_type=Talks)
    _, err = capfd.readouterr()
    assert "detail from rank 1" in err
    assert "vllm_dist.implementations.launchers.common: rank 1 of 2 (try 0" in err


def test_a_bad_log_level_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="VLLM_DIST_LOG_LEVEL='LOUD' is not a log level"):
        MPLauncher(2, env={LOG_LEVEL_ENV: "LOUD"})
    with pytest.raises(ValueError, match="DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        log_level({LOG_LEVEL_ENV: "verbose"})
    assert log_level({}) is None and log_level({LOG_LEVEL_ENV: " Info "}) == logging.INFO


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (it changes process-wide state: environment, logging)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_bad_log_level_in_the_parents_environment_is_refused() -> None:
    proc = _python("from vllm_dist import MPLauncher; MPLauncher(2)", **{LOG_LEVEL_ENV: "7"})
    assert proc.returncode == 1
    assert f"ValueError: {LOG_LEVEL_ENV}='7' is not a log level" in proc.stderr, proc.stderr


def test_loggers_live_under_one_hierarchy() -> None:
    assert get_logger("vllm_dist.x.y").name == "vllm_dist.x.y"
    assert get_logger("vllm_dist").name == "vllm_dist"
    assert get_logger("mytool").name == "vllm_dist.mytool"
    assert get_logger("vllm_distx").name == "vllm_dist.vllm_distx"


_CONFIGURE = """
    import logging
    from vllm_dist.log import configure, get_logger

    root = logging.getLogger()
    configure(rank=3)
    configure(rank=3)
    assert root.level == logging.WARNING and root.handlers == [], (root.level, root.handlers)
    assert len(logging.getLogger("vllm_dist").handlers) == 1  # once, however often called
    get_logger("vllm_dist.t").info("shown by ours")
    logging.basicConfig(format="app: %(message)s")  # the application configures logging
    get_logger("vllm_dist.t").info("shown by the application")
"""


def test_configure_leaves_the_root_logger_alone_and_yields_to_its_handlers() -> None:
    proc = _python(_CONFIGURE, **{LOG_LEVEL_ENV: "INFO"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("[rank3]:INFO") and lines[0].endswith("t: shown by ours")
    assert lines[1] == "app: shown by the application"  # once, by the application's handler


# -- a script without the main guard -------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "line", "guarded"),
    [
        ("x = 1\nlaunch()\n", 2, False),
        ('if __name__ == "__main__":\n    launch()\n', 2, True),
        ("try:\n    launch()\nexcept Exception:\n    pass\n", 2, False),
        ("with ctx():\n    main()\n", 2, False),
        ("class A:\n    launch()\n", 1, False),
        ("if os.environ.get('RANK') is None:\n    launch()\n", 2, True),
        ("@decorate\ndef main():\n    launch()\n", 1, True),
        ("x = 1\n", 9, True),  # a line no statement holds: the file changed since
    ],
)
def test_guarded_line_reads_where_top_level_code_runs(
    source: str, line: int, guarded: bool
) -> None:
    assert guarded_line(ast.parse(textwrap.dedent(source)), line) is guarded
