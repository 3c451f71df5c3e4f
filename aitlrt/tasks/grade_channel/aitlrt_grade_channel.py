"""The grader's pytest plugin: every test's outcome, sent to the grader over a pipe the tests cannot find by accident.

Loaded with ``-p aitlrt_grade_channel`` from a folder the grader puts first on ``PYTHONPATH`` (outside the
workspace, read-only in the sandbox), so it imports before any conftest file or the code under test. At import it
reads the run's nonce from the pipe ``AITLRT_GRADE_NONCE_FD`` names and closes it, makes the result pipe
(``AITLRT_GRADE_FD``) non-inheritable (a subprocess of the tests cannot write to it), and notes the identity (and
code) of the parts of pytest and pluggy that decide and carry an outcome. Each record is one JSON line with the
nonce and a sequence number: ``started`` (at import), ``collected`` (node ids), ``report`` (node id, phase,
outcome, xfail), ``tamper`` (what the code under test changed: those parts, ``builtins.AssertionError``, import
hooks or hook implementations of its own), ``done`` (exit status). The grader believes nothing else: not
stdout, not a junit file, not a report that arrives after ``done`` or without the nonce.

It runs under the test environment's Python and pytest (Python 3.8+, pytest 6+): no newer syntax or library.
This module runs in the same process as the code under test: code written against it by name can still forge its
records (see docs/tasks-and-rewards.md, "What the grader trusts").
"""

from __future__ import annotations

import _imp
import inspect
import json
import os
import sys
from typing import Any

import pytest

_OUT = int(os.environ["AITLRT_GRADE_FD"])
os.set_inheritable(_OUT, False)
_nonce_fd = int(os.environ["AITLRT_GRADE_NONCE_FD"])
with os.fdopen(_nonce_fd, "rb") as _f:
    _NONCE = _f.read(64).decode()
_seq = 0

_HOOKS = (
    "pytest_runtest_protocol",
    "pytest_runtest_setup",
    "pytest_runtest_call",
    "pytest_runtest_teardown",
    "pytest_runtest_makereport",
    "pytest_runtest_logreport",
    "pytest_pyfunc_call",
)


_GUARDED = (
    "_pytest.runner.runtestprotocol",
    "_pytest.runner.call_and_report",
    "_pytest.runner.call_runtest_hook",
    "_pytest.runner.pytest_runtest_makereport",
    "_pytest.runner.CallInfo.from_call",
    "_pytest.reports.TestReport.from_item_and_call",
    "_pytest.reports.TestReport.__init__",
    "_pytest.reports.BaseReport.passed",
    "_pytest.python.Function.runtest",
    "_pytest.python.pytest_pyfunc_call",
    "_pytest.skipping.pytest_runtest_makereport",
    "_pytest.skipping.evaluate_xfail_marks",
    "_pytest.outcomes.fail",
    "_pytest.outcomes.skip",
    "_pytest.outcomes.xfail",
    "pluggy._callers._multicall",
    "pluggy._hooks.HookCaller.__call__",
    "builtins.AssertionError",
)
"""What decides and carries an outcome (those this pytest has: the test environment's pytest may be old); pytest
imported them all before it imports its ``-p`` plugins."""


def _holders() -> list[tuple[str, dict[str, Any], str]]:
    """``(name, the namespace that holds it, its key)`` for each of ``_GUARDED`` this pytest has."""
    found = []
    for name in _GUARDED:
        module, _, attrs = name.partition(".")
        while "." in attrs and (module + "." + attrs.split(".")[0]) in sys.modules:
            head, _, attrs = attrs.partition(".")
            module += "." + head
        holder: Any = sys.modules.get(module)
        *path, key = attrs.split(".")
        for attr in path:
            holder = inspect.getattr_static(holder, attr, None) if holder is not None else None
        namespace = getattr(holder, "__dict__", None)
        if namespace is not None and key in namespace:
            found.append((name, namespace, key))
    return found


_HOLDERS = _holders()


def _fingerprint() -> dict[str, tuple[int, int]]:
    """Each guarded object's identity and its code's (a function's code can be swapped in place)."""
    prints = {}
    for name, namespace, key in _HOLDERS:
        obj = namespace.get(key)
        func = getattr(obj.fget if isinstance(obj, property) else obj, "__func__", obj)
        prints[name] = (id(obj), id(getattr(func, "__code__", None)))
    return prints


_AT_IMPORT = _fingerprint()
_META_PATH = list(sys.meta_path)
_WORKSPACE = os.getcwd() + os.sep
_PATCHED = (
    None
    if "AITLRT_GRADE_PATCHED" not in os.environ
    else {os.path.join(_WORKSPACE, p) for p in json.loads(os.environ["AITLRT_GRADE_PATCHED"])}
)
"""The files the graded patch changed (the grader's ``AITLRT_GRADE_PATCHED``); None: any workspace file may be."""
_impls: set[tuple[int, int]] = set()
_config: pytest.Config | None = None
_tampered: set[str] = set()


def _send(kind: str, **fields: Any) -> None:
    global _seq
    _seq += 1
    line = json.dumps({"nonce": _NONCE, "seq": _seq, "kind": kind, **fields}) + "\n"
    data = line.encode()
    while data:
        data = data[os.write(_OUT, data) :]


def _hook_impls(config: pytest.Config) -> set[tuple[int, int]]:
    found = set()
    for name in _HOOKS:
        for impl in getattr(config.pluginmanager.hook, name).get_hookimpls():
            found.add((id(impl.plugin), id(impl.function)))
    return found


def _from_workspace(filename: str) -> bool:
    """Whether code from ``filename`` may be the patch's: a file in the workspace, or code with no file."""
    return filename.startswith(_WORKSPACE) or not os.path.isfile(filename)


def _foreign_impls(config: pytest.Config) -> list[str]:
    """Hook implementations added since collection began by the code under test: from the workspace but not from a
    conftest file (those are the base's: the grader restored them all and the workspace is read-only)."""
    foreign = []
    for name in _HOOKS:
        for impl in getattr(config.pluginmanager.hook, name).get_hookimpls():
            if (id(impl.plugin), id(impl.function)) in _impls:
                continue
            filename = getattr(getattr(impl.function, "__code__", None), "co_filename", "")
            if _from_workspace(filename) and os.path.basename(filename) != "conftest.py":
                foreign.append(f"{name} by {impl.plugin_name}")
    return foreign


def _unchanged_library(filename: str) -> bool:
    """Whether ``filename`` is a workspace file the graded patch did not change (none is, when the grader named no
    patched files)."""
    return (
        _PATCHED is not None
        and filename.startswith(_WORKSPACE)
        and filename not in _PATCHED
        and os.path.isfile(filename)
    )


def _workspace_class(klass: type) -> bool:
    """Whether ``klass`` comes from the workspace (its module's file is there) or from no file at all (not a
    built-in or frozen module: code the patch ran through ``exec``)."""
    name = klass.__module__
    filename = getattr(sys.modules.get(name), "__file__", None)
    if filename:
        return filename.startswith(_WORKSPACE)
    return name not in sys.builtin_module_names and not _imp.is_frozen(name)


def _patch_finder(finder: Any) -> bool:
    """Whether the patch's code may decide what ``finder`` (an import hook) does: a class of its from the workspace
    whose module is not an unchanged library file, or a method (of such a class, or the instance's own attribute:
    the patch could swap one of a library finder's methods for its own) whose code is not in one."""
    own = [klass for klass in type(finder).__mro__ if _workspace_class(klass)]
    if any(not _unchanged_library(getattr(sys.modules.get(k.__module__), "__file__", None) or "") for k in own):
        return True
    attrs = [value for klass in own for value in vars(klass).values()]
    attrs += list(getattr(finder, "__dict__", {}).values())
    for attr in attrs:
        code = getattr(getattr(attr, "__func__", attr), "__code__", None)  # classmethod, staticmethod, bound
        if code is not None and not _unchanged_library(code.co_filename):
            return True
    return False


def _foreign_finders() -> list[str]:
    """Import hooks added since import whose behaviour the patch's code may decide (a finder could rewrite the test
    modules); a hook of the library's own unchanged code (toolz's ``tlz`` installs one) is the base's behaviour."""
    added = [f for f in sys.meta_path if f not in _META_PATH]
    return [f"sys.meta_path gained {type(f).__name__}" for f in added if _patch_finder(f)]


def _check() -> None:
    now = _fingerprint()
    changed = [name for name, ident in _AT_IMPORT.items() if now.get(name) != ident]
    changed += _foreign_finders()
    if _config is not None:
        changed += _foreign_impls(_config)
    new = set(changed) - _tampered
    if new:
        _tampered.update(new)
        _send("tamper", what=sorted(new))


_send("started")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Before any conftest file (and so the code under test) loads; the entry-point plugins are in."""
    global _config, _impls
    _config = early_config
    _impls = _hook_impls(early_config)


def pytest_collection_finish(session: pytest.Session) -> None:
    _check()
    _send("collected", ids=[item.nodeid for item in session.items])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _check()
    _send(
        "report",
        id=report.nodeid,
        when=report.when,
        outcome=report.outcome,
        xfail=hasattr(report, "wasxfail"),
    )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _check()
    _send("done", exitstatus=int(exitstatus))
    os.close(_OUT)
