"""The architecture holds: the layering arrows of DESIGN.md, a light ``import vllm_dist``, sizes.

Arrows (one way): ``cli, examples -> tasks -> registry -> (lazy) implementations -> memory ->
interfaces``. The layering check reads every module of ``vllm_dist`` with ``ast`` instead of
importing it, so it sees every import: inside functions, under ``if TYPE_CHECKING:``, relative
ones, and modules whose optional dependencies this machine lacks. Importing and then reading
``sys.modules`` was rejected: it misses function-level imports, the very ones that hide a broken
arrow. The checker is unit-tested on synthetic sources, so a broken checker cannot pass silently.

``KNOWN_VIOLATIONS`` and ``SIZE_ALLOWLIST`` record today's offenders; they only shrink. A new
offender fails, an allowlisted one that grows fails, and an entry that no longer offends fails
until it is deleted.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_dist"

MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 500
MAX_FUNCTION_LINES = 80

# Layering violations allowed: none. An entry would be a broken arrow to fix, never a waiver.
KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()

# Size offenders allowed: "file" (module lines) or "file::qualname" (class or function lines)
# -> lines. Empty: every module, class and function is within the limits above.
SIZE_ALLOWLIST: dict[str, int] = {}


# --------------------------------------------------------------------------- import collection


@dataclass(frozen=True)
class Import:
    """One imported target (``a.b`` for ``import a.b``, ``a.b.c`` for ``from a.b import c``)."""

    line: int
    target: str


def module_name(rel_path: str) -> str:
    """``vllm_dist/tasks/base.py`` -> ``vllm_dist.tasks.base``; a package's ``__init__.py`` is
    the package itself."""
    parts = list(Path(rel_path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_from(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(base):
        raise ValueError(f"relative import beyond the top package in {module}")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def collect_imports(source: str, rel_path: str) -> list[Import]:
    """Every import in ``source`` (the file ``rel_path``), wherever it sits in the tree.

    ``from a.b import c`` yields ``a.b.c`` (``c`` may be a submodule or a name; both cross the
    same arrow), so ``from vllm_dist import MPLauncher`` reads ``vllm_dist.MPLauncher``."""
    module = module_name(rel_path)
    is_package = Path(rel_path).name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(ast.parse(source, filename=rel_path)):
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node.level, node.module)
            found.extend(Import(node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return sorted(found, key=lambda i: (i.line, i.target))


# --------------------------------------------------------------------------- the arrows


def _under(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


_LAUNCHERS = (
    "vllm_dist.implementations",
    "vllm_dist.cli",
    "vllm_dist.examples",
    "vllm_dist.MPLauncher",
    "vllm_dist.RayLauncher",
)


def broken_arrow(module: str, target: str) -> str | None:
    """Why ``module`` importing ``target`` breaks the layering, or None when it may."""
    if not _under(target, PACKAGE):
        return None
    if _under(module, "vllm_dist.interfaces") and not _under(target, "vllm_dist.interfaces"):
        return "interfaces import nothing of vllm_dist outside interfaces/"
    if _under(module, "vllm_dist.memory") and not any(
        _under(target, p) for p in ("vllm_dist.memory", "vllm_dist.interfaces")
    ):
        return "memory imports only vllm_dist.interfaces"
    if _under(module, "vllm_dist.tasks") and any(_under(target, p) for p in _LAUNCHERS):
        return "tasks never import implementations, a launcher, the CLI or examples"
    if _under(module, "vllm_dist.implementations") and any(
        _under(target, p) for p in ("vllm_dist.tasks", "vllm_dist.examples")
    ):
        return "implementations never import tasks or examples"
    return None


@dataclass(frozen=True)
class Violation:
    """One broken arrow: where, and what was imported."""

    path: str
    line: int
    target: str
    rule: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.path, self.target)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {module_name(self.path)} -> {self.target} ({self.rule})"


def check_layering(source: str, rel_path: str) -> list[Violation]:
    """The broken arrows of one module's source."""
    module = module_name(rel_path)
    out = []
    for imp in collect_imports(source, rel_path):
        rule = broken_arrow(module, imp.target)
        if rule is not None:
            out.append(Violation(rel_path, imp.line, imp.target, rule))
    return out


# --------------------------------------------------------------------------- sizes


def measure_sizes(source: str, rel_path: str) -> dict[str, tuple[str, int]]:
    """``key -> (kind, lines)`` for the module, every class and every function (nested ones and
    methods too, keyed ``file::Outer.inner``). Lines count from ``def``/``class`` to the end."""
    sizes = {rel_path: ("module", len(source.splitlines()))}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                qualname = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                assert child.end_lineno is not None
                sizes[f"{rel_path}::{qualname}"] = (kind, child.end_lineno - child.lineno + 1)
                visit(child, qualname + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename=rel_path), "")
    return sizes


_LIMITS = {"module": MAX_MODULE_LINES, "class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}


def size_offenders(sizes: dict[str, tuple[str, int]]) -> dict[str, int]:
    """The entries over their limit: key -> lines."""
    return {key: n for key, (kind, n) in sizes.items() if n > _LIMITS[kind]}


def size_problems(offenders: dict[str, int], allowlist: dict[str, int]) -> list[str]:
    """New offenders, and allowlisted ones that grew."""
    problems = []
    for key, n in sorted(offenders.items()):
        if key not in allowlist:
            problems.append(f"{key}: {n} lines, over the limit (split it along its idea)")
        elif n > allowlist[key]:
            problems.append(f"{key}: grew from {allowlist[key]} to {n} lines (allowlisted at most)")
    return problems


# --------------------------------------------------------------------------- the package


def package_sources() -> Iterator[tuple[str, str]]:
    """(path relative to the repository root, source) of every module of vllm_dist."""
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def all_violations() -> list[Violation]:
    return [v for rel, src in package_sources() for v in check_layering(src, rel)]


def all_size_offenders() -> dict[str, int]:
    offenders: dict[str, int] = {}
    for rel, src in package_sources():
        offenders.update(size_offenders(measure_sizes(src, rel)))
    return offenders


def test_package_is_found() -> None:
    paths = [rel for rel, _ in package_sources()]
    assert "vllm_dist/__init__.py" in paths and "vllm_dist/interfaces/__init__.py" in paths


def test_layering_arrows_hold() -> None:
    new = [str(v) for v in all_violations() if v.key not in KNOWN_VIOLATIONS]
    assert not new, "broken arrows (see docs/architecture.md):\n" + "\n".join(new)


def test_known_violations_still_exist() -> None:
    present = {v.key for v in all_violations()}
    fixed = sorted(KNOWN_VIOLATIONS - present)
    assert not fixed, f"fixed: delete these entries from KNOWN_VIOLATIONS: {fixed}"


def test_sizes_stay_within_limits() -> None:
    problems = size_problems(all_size_offenders(), SIZE_ALLOWLIST)
    assert not problems, "\n".join(problems)


def test_size_allowlist_has_no_stale_entries() -> None:
    offenders = all_size_offenders()
    stale = sorted(k for k in SIZE_ALLOWLIST if k not in offenders)
    assert not stale, f"within limits now: delete these entries from SIZE_ALLOWLIST: {stale}"


def test_import_vllm_dist_loads_no_ray_nixl_or_cuda() -> None:
    code = (
        "import json, sys\n"
        "import vllm_dist\n"
        "mods = [m for m in sys.modules if m.split('.')[0] in ('ray', 'nixl') or "
        "m.startswith('nixl_')]\n"
        "import torch\n"
        "print(json.dumps({'modules': mods, 'cuda': torch.cuda.is_initialized()}))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"modules": [], "cuda": False}, seen


# --------------------------------------------------------------------------- the checker itself


def _violations(source: str, rel_path: str) -> list[str]:
    return [v.target for v in check_layering(source, rel_path)]


def test_checker_finds_function_level_import_in_tasks() -> None:
    src = (
        "def f():\n"
        "    from vllm_dist.implementations.launchers.mp import MPLauncher\n"
        "    return MPLauncher\n"
    )
    found = check_layering(src, "vllm_dist/tasks/fake.py")
    assert [(v.line, v.target) for v in found] == [
        (2, "vllm_dist.implementations.launchers.mp.MPLauncher")
    ]
    message = str(found[0])
    assert "vllm_dist/tasks/fake.py:2" in message
    assert "vllm_dist.tasks.fake -> vllm_dist.implementations" in message


def test_checker_finds_type_checking_import_in_interfaces() -> None:
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from vllm_dist.registry import CommunicatorType\n"
    )
    assert _violations(src, "vllm_dist/interfaces/fake.py") == [
        "vllm_dist.registry.CommunicatorType"
    ]


def test_checker_resolves_relative_imports() -> None:
    src = "from ...implementations.communicators import common\nfrom . import ops\n"
    rel = "vllm_dist/tasks/weight_transfer/fake.py"
    assert _violations(src, rel) == ["vllm_dist.implementations.communicators.common"]
    assert [i.target for i in collect_imports(src, rel)][1] == "vllm_dist.tasks.weight_transfer.ops"
    init = "from .launcher import Launcher\n"
    assert collect_imports(init, "vllm_dist/interfaces/__init__.py")[0].target == (
        "vllm_dist.interfaces.launcher.Launcher"
    )
    assert _violations("from .. import registry\n", "vllm_dist/interfaces/x.py") == [
        "vllm_dist.registry"
    ]


def test_checker_tasks_may_not_name_a_launcher_from_the_top_package() -> None:
    rel = "vllm_dist/tasks/fake.py"
    assert _violations("from vllm_dist import MPLauncher, CommunicatorType\n", rel) == [
        "vllm_dist.MPLauncher"
    ]
    assert _violations("import vllm_dist.cli\nimport vllm_dist.examples.llama_tp\n", rel) == [
        "vllm_dist.cli",
        "vllm_dist.examples.llama_tp",
    ]
    ok = "from vllm_dist.registry import get_communicator_class\nfrom vllm_dist.memory import x\n"
    assert _violations(ok, rel) == []


def test_checker_memory_and_implementations_rules() -> None:
    assert _violations("from vllm_dist.interfaces import ReduceOp\n", "vllm_dist/memory/a.py") == []
    assert _violations("from vllm_dist import registry\n", "vllm_dist/memory/a.py") == [
        "vllm_dist.registry"
    ]
    impl = "vllm_dist/implementations/communicators/fake.py"
    src = "import torch\nfrom vllm_dist.memory import arena\nfrom vllm_dist.tasks.base import T\n"
    assert _violations(src, impl) == ["vllm_dist.tasks.base.T"]
    # other layers (cli, examples, registry) may import downward freely
    assert _violations("from vllm_dist import MPLauncher\n", "vllm_dist/examples/demo.py") == []


def test_checker_interfaces_may_import_each_other_and_third_parties() -> None:
    src = "import abc\nimport torch\nfrom vllm_dist.interfaces.launcher import WorkerInfo\n"
    assert _violations(src, "vllm_dist/interfaces/coordinator.py") == []


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def test_size_checker_measures_nested_functions_and_methods() -> None:
    src = "class C:\n" + _function("long", MAX_FUNCTION_LINES, indent="    ")
    src += "def outer():\n" + _function("inner", 1, indent="    ")
    sizes = measure_sizes(src, "vllm_dist/fake.py")
    assert sizes["vllm_dist/fake.py::C"] == ("class", MAX_FUNCTION_LINES + 2)
    assert sizes["vllm_dist/fake.py::C.long"] == ("function", MAX_FUNCTION_LINES + 1)
    assert sizes["vllm_dist/fake.py::outer.inner"] == ("function", 2)
    assert sizes["vllm_dist/fake.py"] == ("module", MAX_FUNCTION_LINES + 5)
    assert size_offenders(sizes) == {"vllm_dist/fake.py::C.long": MAX_FUNCTION_LINES + 1}


def test_size_checker_flags_new_and_grown_offenders() -> None:
    key, n = "vllm_dist/fake.py::f", MAX_FUNCTION_LINES + 1
    offenders = size_offenders(
        measure_sizes(_function("f", MAX_FUNCTION_LINES), "vllm_dist/fake.py")
    )
    assert offenders == {key: n}
    assert ["over the limit" in p for p in size_problems(offenders, {})] == [True]
    assert size_problems(offenders, {key: n}) == []
    assert ["grew" in p for p in size_problems(offenders, {key: n - 1})] == [True]
    big = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert size_offenders(measure_sizes(big, "vllm_dist/m.py")) == {
        "vllm_dist/m.py": len(big.splitlines())
    }
    cls = "class K:\n" + "    x = 1\n" * MAX_CLASS_LINES
    assert size_offenders(measure_sizes(cls, "vllm_dist/k.py")) == {
        "vllm_dist/k.py::K": MAX_CLASS_LINES + 1
    }


@pytest.mark.parametrize(
    ("rel", "module"),
    [
        ("vllm_dist/__init__.py", "vllm_dist"),
        ("vllm_dist/tasks/weight_transfer/__init__.py", "vllm_dist.tasks.weight_transfer"),
        ("vllm_dist/cli.py", "vllm_dist.cli"),
    ],
)
def test_module_name(rel: str, module: str) -> None:
    assert module_name(rel) == module
