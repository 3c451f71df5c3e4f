"""Test environments: one cached virtualenv per repository source, base commit and install spec.

The spec (Python version, pip packages, install command, test command) comes from, in order: the task row's
``env`` column, this project's table (``PROJECT_SPECS``), SWE-bench's own table (``swebench==4.1.0``'s
``harness/constants/python.py``, when that package is installed) or the default below. The package is installed
(editable) from a checkout of the source's base commit kept beside the venv; grading runs tests in a private
copy with that copy first on ``PYTHONPATH``, so one environment serves every patch of every task of that repo.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from aitlrt.common.git import git
from aitlrt.common.paths import aitlrt_home, file_lock
from aitlrt.tasks.sources import materialise
from aitlrt.tasks.task import Task

DEFAULT_TEST_CMD = "pytest -rA -p no:cacheprovider"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvSpec:
    python: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    pip_packages: tuple[str, ...] = ("pytest",)
    install: str = "python -m pip install -e ."
    test_cmd: str = DEFAULT_TEST_CMD

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EnvSpec:
        """From a row's ``env`` or a SWE-bench spec (``packages`` that are pip names join ``pip_packages``)."""
        pip = list(d.get("pip_packages") or ())
        packages = d.get("packages") or ""
        if packages and packages not in ("requirements.txt", "environment.yml"):
            pip += packages.split()
        if "pytest" in d.get("test_cmd", "pytest") and not any(p.split("=")[0].split("<")[0] == "pytest" for p in pip):
            pip.append("pytest")
        return cls(
            python=str(d.get("python") or cls.python),
            pip_packages=tuple(pip),
            install=d.get("install") or cls.install,
            test_cmd=d.get("test_cmd") or DEFAULT_TEST_CMD,
        )


# Repos whose offline stand-ins need pins SWE-bench's table does not give (see ../shared/data/README.md).
PROJECT_SPECS: dict[tuple[str, str], dict[str, Any]] = {
    ("marshmallow-code/webargs", "8.6.0"): {
        "python": "3.11",
        "install": "python -m pip install -e '.[tests]' 'marshmallow<4' 'pytest-asyncio==0.21.2' 'pytest<8.4'",
        "pip_packages": [],
        "test_cmd": "pytest -rA -p no:cacheprovider",
    },
    # the recipe's warm_start_from sources (configs/cpu_demo.yaml): test suites that import one more package
    ("funcy", "2.1"): {"pip_packages": ["pytest", "whatever==0.7"]},
    ("itsdangerous", "2.2.0"): {"pip_packages": ["pytest", "freezegun==1.5.5"]},
}


@cache
def swebench_specs() -> dict[str, dict[str, dict[str, Any]]]:
    """SWE-bench's install specs per repo and version, or {} when ``swebench`` is not installed."""
    found = importlib.util.find_spec("swebench")
    if found is None or not found.submodule_search_locations:
        return {}
    path = Path(next(iter(found.submodule_search_locations))) / "harness" / "constants" / "python.py"
    module_spec = importlib.util.spec_from_file_location("_swebench_constants_python", path)
    if module_spec is None or module_spec.loader is None:
        return {}
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # a data-only module: dicts of strings, no imports
    return module.MAP_REPO_VERSION_TO_SPECS_PY


def spec_for(task: Task) -> EnvSpec:
    if task.env:
        return EnvSpec.from_dict(task.env)
    if (task.repo, task.version) in PROJECT_SPECS:
        return EnvSpec.from_dict(PROJECT_SPECS[task.repo, task.version])
    if found := swebench_specs().get(task.repo, {}).get(task.version):
        return EnvSpec.from_dict(found)
    return EnvSpec()


class EnvBuildError(RuntimeError):
    """The environment could not be built; the message names the task and ends with the build log's tail."""


def find_python(version: str) -> str:
    """An interpreter for ``major.minor``: on PATH, or installed by pyenv."""
    candidates = [shutil.which(f"python{version}")]
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"), reverse=True)
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        candidates.append(sys.executable)
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == str(tuple(map(int, version.split(".")))):
            return exe
    raise EnvBuildError(f"no Python {version} interpreter found (install it, e.g. `pyenv install {version}`)")


@dataclass(frozen=True)
class TestEnv:
    root: Path
    spec: EnvSpec

    @property
    def bin(self) -> Path:
        return self.root / "venv" / "bin"

    def environ(self) -> dict[str, str]:
        """Environment variables that activate the venv."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        return {**env, "VIRTUAL_ENV": str(self.root / "venv"), "PATH": f"{self.bin}:{env.get('PATH', '')}"}


def envs_root() -> Path:
    return aitlrt_home() / "envs"


def ensure_env(task: Task) -> TestEnv:
    """The test environment for ``task``, built on first use (a few seconds to minutes; logged) and cached."""
    spec = spec_for(task)
    repo, base = materialise(task.source)
    key = hashlib.sha256(json.dumps([asdict(spec), str(task.source), base]).encode()).hexdigest()[:12]
    name = (task.repo or task.source.location).replace("/", "__").replace("==", "-")[-40:]
    env = TestEnv(envs_root() / f"{name}-{key}", spec)
    ready = env.root / ".ready"
    if ready.exists():
        return env
    with file_lock(env.root):
        if ready.exists():
            return env
        shutil.rmtree(env.root, ignore_errors=True)
        env.root.mkdir(parents=True)
        started = time.monotonic()
        log.info("building the test environment for %s (Python %s) ...", task.repo or task.source, spec.python)
        try:
            _build(env, repo, base)
        except EnvBuildError as exc:
            shutil.rmtree(env.root / "venv", ignore_errors=True)
            raise EnvBuildError(f"task {task.instance_id}: {exc}") from None
        ready.write_text(json.dumps(asdict(spec)))
        log.info("test environment ready in %.0f s: %s", time.monotonic() - started, env.root)
    return env


def _build(env: TestEnv, repo: Path, base: str) -> None:
    python = find_python(env.spec.python)
    src = env.root / "src"
    git("clone", "-q", "--shared", "--no-checkout", repo, src, cwd=env.root)
    git("checkout", "-q", "--detach", base, cwd=src)
    steps = [f"{shlex.quote(python)} -m venv {shlex.quote(str(env.root / 'venv'))}"]
    if env.spec.pip_packages:
        steps.append("python -m pip install -q " + " ".join(shlex.quote(p) for p in env.spec.pip_packages))
    is_project = any((src / name).exists() for name in ("setup.py", "pyproject.toml", "setup.cfg"))
    if env.spec.install != EnvSpec.install or is_project:  # a plain folder of modules needs no install
        steps.append(env.spec.install)
    with open(env.root / "build.log", "w") as logf:
        for step in steps:
            logf.write(f"$ {step}\n")
            logf.flush()
            proc = subprocess.run(
                step, shell=True, cwd=src, env=env.environ(), stdout=logf, stderr=subprocess.STDOUT, timeout=1800
            )
            if proc.returncode != 0:
                tail = (env.root / "build.log").read_text()[-2000:]
                raise EnvBuildError(f"`{step}` failed (exit {proc.returncode}); log {env.root / 'build.log'}:\n{tail}")
