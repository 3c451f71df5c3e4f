"""Imports only go downward: common < tasks < serving < rollout < rewards < report < training, evaluation < cli,
train.py; ``aitlrt_server`` imports only ``aitlrt.common``; ``aitlrt`` never imports ``aitlrt_server``.

Read with ``ast`` (nothing is imported), lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"aitlrt": ROOT / "aitlrt", "aitlrt_server": ROOT / "server"}
LAYERS = ["common", "tasks", "serving", "rollout", "rewards", "report", "training evaluation warmstart", "cli train"]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts.split()}
TOP = len(LAYERS) - 1
SERVER_MAY_IMPORT = "aitlrt.common"


def modules() -> dict[str, Path]:
    """Every module of both packages by dotted name (a package by its name, not ``.__init__``)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree`` of module ``name``, relative ones resolved; ``from M import X``
    counts as ``M.X`` when that is a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*parent, *([base] if base else [])])
            out += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base) for a in node.names]
    return out


def layer(module: str) -> str | None:
    """``aitlrt.<part>`` → part (``aitlrt`` itself: ``common``, as every import runs it); None outside aitlrt."""
    parts = module.split(".")
    if parts[0] != "aitlrt":
        return None
    return parts[1] if len(parts) > 1 else "common"


def violation(importer: str, target: str) -> str | None:
    """Why ``importer`` may not import ``target``, or None."""
    top = target.split(".")[0]
    if importer.startswith("aitlrt_server"):
        if top == "aitlrt" and target != SERVER_MAY_IMPORT and not target.startswith(SERVER_MAY_IMPORT + "."):
            return f"aitlrt_server may import only {SERVER_MAY_IMPORT}"
        return None
    if top == "aitlrt_server":
        return "aitlrt never imports aitlrt_server"
    source, dest = layer(importer), layer(target)
    if dest is None or source == dest:
        return None
    if source not in RANK or dest not in RANK:
        return f"no layer for aitlrt.{source if source not in RANK else dest} (add it to LAYERS)"
    if RANK[dest] >= RANK[source] and not RANK[dest] == RANK[source] == TOP:  # entry points call each other
        return f"{source} (layer {RANK[source]}) may not import {dest} (layer {RANK[dest]})"
    return None


def violations(name: str, source: str, known: set[str], is_package: bool = False) -> list[str]:
    tree = ast.parse(source)
    found = [(line, target, violation(name, target)) for line, target in imported(tree, name, is_package, known)]
    return [f"{name}:{line}: imports {target}: {why}" for line, target, why in found if why]


def test_imports_only_go_down_the_layers():
    found = modules()
    problems = [
        problem
        for name, path in sorted(found.items())
        for problem in violations(name, path.read_text(), set(found), path.name == "__init__.py")
    ]
    assert not problems, "\n".join(problems)


def test_the_check_sees_lazy_relative_and_server_imports():
    known = {"aitlrt.common", "aitlrt.common.git", "aitlrt.training", "aitlrt.tasks.envs", "aitlrt_server.app"}
    lazy = "def f():\n    from aitlrt.training import trainer\n"
    assert violations("aitlrt.common.git", lazy, known) == [
        "aitlrt.common.git:2: imports aitlrt.training: common (layer 0) may not import training (layer 6)"
    ]
    assert violations("aitlrt.tasks.grading", "from . import envs\nfrom ..common import git\n", known) == []
    assert violations("aitlrt.tasks", "from .. import training\n", known, is_package=True)
    assert violations("aitlrt.rollout.runner", "import aitlrt_server.app\n", known)
    assert violations("aitlrt_server.app", "from aitlrt.common import git\nimport aitlrt.tasks.envs\n", known) == [
        "aitlrt_server.app:2: imports aitlrt.tasks.envs: aitlrt_server may import only aitlrt.common"
    ]
    assert violations("aitlrt.cli.eval", "from aitlrt.evaluation import scoring\nimport aitlrt.train\n", known) == []
    assert violations("aitlrt.training.trainer", "import aitlrt.evaluation\n", known)
    assert violations("aitlrt.common.git", "import aitlrt.newthing\n", known) == [
        "aitlrt.common.git:1: imports aitlrt.newthing: no layer for aitlrt.newthing (add it to LAYERS)"
    ]


def test_pyproject_lists_every_package() -> None:
    """A regular (non-editable) install ships exactly the packages pyproject.toml lists: none may be missing."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "aitlrt").rglob("__init__.py")}
    found |= {
        "aitlrt_server." + ".".join(i.parent.relative_to(ROOT / "server").parts)
        for i in (ROOT / "server").rglob("__init__.py")
    }
    found = {name.rstrip(".") for name in found}
    assert set(config["packages"]) == found
