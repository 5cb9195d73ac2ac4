"""The scripts in ``examples/`` run as a user runs them: a fresh interpreter, the CPU, no extras."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_rl_weight_sync_example_verifies_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rl_weight_sync.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("verified on both TP ranks") == 2, proc.stdout
    assert "all steps verified" in proc.stdout
