"""What does a user see when one rank of a weight-sync fleet is killed or hangs?

Question: for each fault (role x phase x kill/hang x transport x launcher), the time from the
launch to its error, the rank the error lists first and what it says that rank was doing, the
consumers' state (torn, version) as they reported it, and the worker processes left alive after
a bounded wait. Each case is one launch of a producer and a consumer on the CPU
(``tests/fault_cases.py``); the transfers' stall timeout is 3 s, the collectives' 8 s (15 s under Ray).

Prints the fault table as markdown and writes it to ``--out`` (JSON). ``--launchers mp,ray``
adds the Ray subset (mid-sync and between-sync faults of the send/recv path); ``--only`` keeps
the cases whose id contains a substring.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import write_outputs  # noqa: E402
from tests.fault_cases import FAULTS, PHASES, ROLES, TRANSPORTS, Case, run_case  # noqa: E402

_RAY_PHASES = ("mid_sync", "between_syncs")  # where a Ray actor's death or hang differs


def cases(launchers: list[str]) -> list[Case]:
    """Every valid case of the matrix; Ray: the send/recv path at the phases of a sync."""
    out = []
    for launcher in launchers:
        for transport in TRANSPORTS:
            for role in ROLES:
                for phase in PHASES:
                    for fault in FAULTS:
                        case = Case(role, phase, fault, transport, launcher)
                        if not case.valid():
                            continue
                        if launcher == "ray" and (
                            transport != "torch_distributed" or phase not in _RAY_PHASES
                        ):
                            continue
                        out.append(case)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    cols = ["fault", "seconds_to_error", "error", "names", "consumers", "leftovers"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r[c]).replace("|", "/") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launchers", default="mp", help="comma-separated: mp, ray")
    ap.add_argument("--only", default="", help="keep the cases whose id contains this")
    ap.add_argument("--out", default="benchmarks/results/faults.json")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = []
    started = time.monotonic()
    for case in cases(args.launchers.split(",")):
        if args.only and args.only not in case.id:
            continue
        outcome = run_case(case)
        row = outcome.row()
        print(f"{row}", file=sys.stderr, flush=True)
        rows.append(row)
    print(markdown(rows))
    print(f"\n{len(rows)} cases in {time.monotonic() - started:.0f} s")
    write_outputs(args.out, {"stall_timeout_s": 3.0, "rows": rows}, None)


if __name__ == "__main__":
    main()
