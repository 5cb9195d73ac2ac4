"""The ``vllm-dist`` command: bad flags refused in the parent, an honest ``info``, clean JSON.

Bad-flag tests call ``main([...])`` with launching made to fail loudly, so a check that let a
worker start shows up as a failure, not as a slow pass. Tests that need a module to be missing
(transformers, Ray) run the CLI in a fresh interpreter whose import system refuses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_dist import cli
from vllm_dist.cli import main, parse_size, summarize_lists
from vllm_dist.implementations.launchers.mp import MPLauncher

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()

# a script that runs the CLI with some top-level modules made unimportable, in the parent and in
# every spawned worker (they re-run this file as their main module)
_BLOCKING_MAIN = textwrap.dedent(
    """
    import os, sys

    BLOCKED = set(os.environ["BLOCKED_MODULES"].split(","))

    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, _Block())
    if __name__ == "__main__":
        from vllm_dist.cli import main
        sys.exit(main(sys.argv[1:]))
    """
)


def run_cli_blocking(
    tmp_path: Path, blocked: str, *argv: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """``vllm-dist argv...`` in a fresh interpreter where ``blocked`` modules cannot import."""
    script = tmp_path / "blocking_main.py"
    script.write_text(_BLOCKING_MAIN)
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RAY_AUTH_MODE": "disabled",
        "BLOCKED_MODULES": blocked,
        **env,
    }
    return subprocess.run(
        [sys.executable, str(script), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=tmp_path,
    )


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any launch fails the test: a refused flag must not start a worker."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a worker was started for a flag that should have been refused")

    monkeypatch.setattr(MPLauncher, "launch", refuse)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["run", "all-reduce", "--communicator", "pynccl"], ["--communicator pynccl", "--device"]),
        (["run", "all-reduce", "--communicator", "nixl_rdt"], ["all_reduce", "torch_distributed"]),
        (["run", "all-reduce", "--world-size", "0"], ["--world-size", "at least 1"]),
        (["run", "all-reduce", "--iters", "-1"], ["--iters", "at least 1"]),
        (["run", "all-reduce", "--size", "1e30G"], ["--size", "64MiB"]),
        (["run", "all-reduce", "--size", "2TiB"], ["--size", "1TiB"]),
        (["run", "all-reduce", "--size", "0"], ["--size"]),
        (["run", "all-reduce", "--timeout", "-5"], ["--timeout", "positive"]),
        (["run", "all-reduce", "--launcher", "rya"], ["--launcher", "did you mean 'ray'"]),
        (["run", "all-reduce", "--address", "auto"], ["--address", "--launcher ray"]),
        (["run", "all-reduce", "--communicator", "carrier_pigeon"], ["unknown communicator"]),
        (["run", "weight-transfer", "--producers", "0"], ["--producers", "at least 1"]),
        (["run", "weight-transfer", "--consumers", "0"], ["--consumers", "at least 1"]),
        (["run", "weight-transfer", "--tp-size", "0"], ["--tp-size", "at least 1"]),
        (["run", "weight-transfer", "--syncs", "0"], ["--syncs", "at least 1"]),
        (["run", "weight-transfer", "--consumers", "3"], ["--consumers 3", "--tp-size 2"]),
        (["run", "weight-transfer", "--communicator", "pynccl"], ["--communicator pynccl"]),
        (["run", "all-reduce", "--world-sise", "2"], ["did you mean '--world-size'"]),
        (["run", "all-redcue"], ["did you mean 'all-reduce'"]),
        (["inof"], ["did you mean 'info'"]),
        (["run", "weight-transfer", "--device", "cuda"], ["an option of 'vllm-dist run all-r"]),
        (["run", "weight-transfer", "--world-sise", "2"], ["'--world-size', an option of"]),
        (["run", "--json", "all-reduce"], ["go after the command: vllm-dist run all-reduce"]),
    ],
)
def test_bad_flag_is_refused_before_any_worker(
    no_launch: None, capsys: pytest.CaptureFixture[str], argv: list[str], names: list[str]
) -> None:
    line = _refused(capsys, argv)
    for name in names:
        assert name in line, line
    assert "Traceback" not in line


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused(
    no_launch: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _refused(capsys, ["run", "all-reduce", "--device", "cuda"])
    assert line.startswith("vllm-dist: --device cuda:") and "--device cpu" in line


def test_weight_transfer_nixl_without_nixl_names_the_install(tmp_path: Path) -> None:
    proc = run_cli_blocking(
        tmp_path, "nixl", "run", "weight-transfer", "--communicator", "nixl_rdt"
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "--communicator nixl_rdt" in proc.stderr and "nixl" in proc.stderr.split(":", 2)[2]
    assert "use --communicator torch_distributed" in proc.stderr


def test_ray_launcher_without_ray_is_refused(tmp_path: Path) -> None:
    proc = run_cli_blocking(tmp_path, "ray", "run", "all-reduce", "--launcher", "ray")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "--launcher ray" in proc.stderr and "pip install 'vllm_dist[ray]'" in proc.stderr


def test_parse_size_is_strict_and_bounded() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("64MiB") == parse_size("64M") == parse_size("64mib") == 64 << 20
    assert parse_size("1.5KiB") == 1536
    assert parse_size("1TiB") == 1 << 40
    for bad in ("1e30G", "2TiB", "0", "-1", "lots", "inf", "nan", "64 MiBs", ""):
        with pytest.raises(Exception, match="size|1TiB"):
            parse_size(bad)


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", "all-reduce"], ["run", "weight-transfer"], ["info"]):
        assert main([*argv, "--help"]) == 0
        text = capsys.readouterr().out
        assert "``" not in text  # no raw RST
    parser = cli.build_parser()
    seen = 0
    for action in _all_actions(parser):
        if action.option_strings and action.dest not in ("help", "version"):
            assert action.help, f"{action.option_strings} has no help"
            seen += 1
    assert seen > 15
    main(["run", "all-reduce", "--help"])
    text = capsys.readouterr().out
    assert "{mp,ray}" in text and "torch_distributed" in text and "pynccl" in text
    assert "(default: 10)" in text and "(default: 300.0)" in text and "bytes per rank" in text


def _all_actions(parser: Any) -> list[Any]:
    found = []
    for action in parser._actions:
        found.append(action)
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            for sub in action.choices.values():
                found += _all_actions(sub)
    return found


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import vllm_dist

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"vllm-dist {vllm_dist.__version__}"


def test_ctrl_c_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(_: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_all_reduce", interrupted)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")  # main() sets it for run commands otherwise
    assert main(["run", "all-reduce"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err


def test_per_sync_lists_are_summarised() -> None:
    summary = {"syncs": 20, "seconds_per_sync": [float(i) for i in range(20)], "ok": True}
    summary["replayed"] = [False] + [True] * 19
    short = summarize_lists({"seconds_per_sync": [1.0, 2.0]}, always=False)
    assert short == {"seconds_per_sync": [1.0, 2.0]}
    out = summarize_lists(summary, always=False)
    assert out["seconds_per_sync"] == {
        "count": 20,
        "first": 0.0,
        "min": 0.0,
        "median": 9.5,
        "max": 19.0,
    }
    assert out["replayed"] == {"count": 20, "true": 19}
    assert out["syncs"] == 20 and out["ok"] is True
    assert summarize_lists({"s": [1.0]}, always=True)["s"]["count"] == 1


# --------------------------------------------------------------------------- info


def _backend(facts: dict[str, Any], axis: str, name: str) -> dict[str, str]:
    return next(b["devices"] for b in facts["backends"] if (b["axis"], b["name"]) == (axis, name))


@pytest.mark.skipif(not NO_CUDA, reason="checks what info claims on a machine without CUDA")
def test_info_claims_no_cuda_backend_without_cuda() -> None:
    facts = cli.collect_info()
    for name in ("nixl_rdt", "pynccl", "torch_distributed"):
        assert _backend(facts, "communicator", name)["cuda"].startswith("no ("), name
    assert _backend(facts, "communicator", "torch_distributed")["cpu"] == "usable"
    assert _backend(facts, "communicator", "pynccl")["cpu"].startswith("no (")
    assert facts["devices"] == ["cpu"] and facts["cuda"].startswith("no (")


@pytest.mark.skipif(not NO_CUDA, reason="checks a backend's own answer without CUDA")
def test_nixl_rdt_itself_says_it_cannot_use_cuda_here() -> None:
    pytest.importorskip("nixl")
    from vllm_dist.implementations.communicators.nixl.communicator import NixlRdtCommunicator

    reason = NixlRdtCommunicator.unavailable_reason("cuda")
    assert reason is not None and "CUDA" in reason
    assert NixlRdtCommunicator.unavailable_reason("cpu") is None


def test_info_json_is_pure_json_and_reports_the_environment(tmp_path: Path) -> None:
    proc = run_cli_blocking(tmp_path, "ray", "info", "--json", NCCL_DEBUG="WARN", UCX_TLS="tcp")
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["environment"]["NCCL_DEBUG"] == "WARN"
    assert facts["environment"]["UCX_TLS"] == "tcp"
    assert set(facts["versions"]) >= {"torch", "CUDA driver", "UCX", "nixl", "ray"}
    ray = _backend(facts, "launcher", "ray")
    assert ray["any"].startswith("unusable") and "blocked" in ray["any"]  # Ray does not import
    assert _backend(facts, "launcher", "mp") == {"any": "usable"}


def test_info_says_what_a_loopback_launch_listens_on() -> None:
    listens = {r["component"]: r for r in cli.collect_info()["listens"]["rows"]}
    assert listens["rendezvous store (rank 0)"]["address"] == "127.0.0.1"
    assert "HMAC" in listens["rendezvous store (rank 0)"]["note"]
    assert listens["gloo control plane (every rank)"]["address"] == "127.0.0.1"
    assert "loopback only" in listens["NIXL agent (nixl_rdt)"]["address"]
    store = cli.collect_info("::1")["listens"]["rows"][0]
    assert store["address"] == "::1"


def test_info_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "communicator torch_distributed" in out and "environment" in out and "UCX" in out


# --------------------------------------------------------------------------- runs


@pytest.mark.timeout(240)
def test_weight_transfer_runs_without_transformers(tmp_path: Path) -> None:
    """The demo needs shapes, not transformers: the base install runs it; stdout is JSON only,
    also with NIXL loaded in every worker (where it is installed)."""
    import importlib.util

    comm = "nixl_rdt" if importlib.util.find_spec("nixl") else "torch_distributed"
    argv = ["run", "weight-transfer", "--producers", "1", "--consumers", "2", "--syncs", "2"]
    argv += ["--communicator", comm]
    proc = run_cli_blocking(tmp_path, "transformers", *argv, "--json", timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["verified"] is True and summary["syncs"] == 2
    assert summary["seconds_per_sync"]["count"] == 2
    assert summary["path"] == ("read" if comm == "nixl_rdt" else "send_recv")


@pytest.mark.timeout(180)
def test_all_reduce_json_is_the_only_stdout(tmp_path: Path) -> None:
    argv = ["run", "all-reduce", "--world-size", "2", "--size", "1MiB", "--iters", "2", "--json"]
    proc = run_cli_blocking(tmp_path, "transformers", *argv, timeout=160)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["verified"] is True and [r["rank"] for r in report["ranks"]] == [0, 1]


@pytest.mark.timeout(120)
def test_ctrl_c_during_a_launch_prints_one_line_and_stops_the_workers(tmp_path: Path) -> None:
    psutil = pytest.importorskip("psutil")
    import signal
    import time

    argv = ["run", "all-reduce", "--size", "4KiB", "--iters", "100000000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_dist.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 60
    while len(parent.children(recursive=True)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # the resource tracker and two workers
    workers = parent.children(recursive=True)
    assert len(workers) >= 3, "the workers did not start"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "vllm-dist: interrupted; workers stopped", err[-2000:]
    assert "Traceback" not in err
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive


@pytest.mark.parametrize("overrides", [{}, {"num_hidden_layers": 3, "num_key_value_heads": 4}])
def test_demo_shapes_without_transformers_match_the_hf_model(overrides: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    from vllm_dist.examples.llama_tp import llama_shapes, tiny_llama_config, tiny_llama_shapes

    want = llama_shapes(tiny_llama_config(**overrides))
    assert list(tiny_llama_shapes(**overrides).items()) == list(want.items())
