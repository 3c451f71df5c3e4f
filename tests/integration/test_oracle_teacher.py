"""The oracle teacher with the real Aider agent (warm workers) through a real ``aitlrt-serve``: on the generated
cachetools tasks (an ``invert_if`` and a ``shuffle_statements`` among them, whose patch text is not git's diff of the
fix) and four SWE-smith webargs tasks, in the ``whole`` and ``diff`` formats, Aider's final diff is the oracle fix
as git writes it and the task's tests pass (real grading). ``aitlrt trajectories`` writes the kept rollouts' calls as
the proxy recorded them and rejects a teacher that answers garbage (the bundled model on the session's vLLM).
The proxy's mode for teachers that are not vLLM is checked against a server that refuses unknown fields."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from aitlrt.rollout.batch import RolloutSettings
from aitlrt.tasks.loader import load_tasks
from aitlrt.tasks.patches import reverse, similarity
from aitlrt.tasks.task import Task
from aitlrt.training.dataset import generated_tasks
from aitlrt.warmstart.oracle_server import fix_patch, oracle_task, serve_in_thread
from aitlrt.warmstart.trajectories import DEFAULT_REWARDS, Teacher, collect, policy_calls, reward_funcs
from tests.conftest import admin, cachetools_tasks, chat, trace

WEBARGS = [  # single-file fixes in four files (core.py: two hunks; falconparser.py: three, re-adding methods)
    "marshmallow-code__webargs.dbde72fe.pr_974",
    "marshmallow-code__webargs.dbde72fe.func_pm_remove_cond__vz9appx6",
    "marshmallow-code__webargs.dbde72fe.func_pm_ctrl_shuffle__g0amkrmy",
    "marshmallow-code__webargs.dbde72fe.func_pm_class_rm_funcs__kw4zto9r",
]
ROW_KEYS = {"prompt", "completion", "instance_id", "rollout_id", "call_index", "reward", "teacher", "edit_format"}


@pytest.fixture(scope="module")
def cachetools_file() -> Path:
    return cachetools_tasks(4)


def _moved_lines(tasks: list[Task], strategy: str, taken: list[Task]) -> Task:
    """A task of a mutation ``strategy`` not among ``taken``, preferring one whose bug moves lines: its diff
    reversed is not the diff git writes of the fix (the lines it moves are aligned the other way)."""
    ids = {t.instance_id for t in taken}
    of_kind = [t for t in tasks if t.row.get("strategy") == strategy and t.instance_id not in ids]
    return min(of_kind, key=lambda t: similarity(reverse(t.setup_patch), fix_patch(oracle_task(t))) == 1.0)


@pytest.fixture(scope="module")
def tasks(cachetools_file: Path, data_dir: Path):
    cachetools = load_tasks(cachetools_file, limit=4).tasks
    max110 = load_tasks(generated_tasks("pypi:cachetools==8.0.1", 31, 110)).tasks
    cachetools += [_moved_lines(max110, "invert_if", cachetools)]
    cachetools += [_moved_lines(max110, "shuffle_statements", cachetools)]
    webargs = load_tasks(data_dir / "swesmith_webargs" / "tasks.jsonl", ids=set(WEBARGS)).tasks
    assert len({t.instance_id for t in cachetools}) == 6 and all(t.files for t in cachetools)
    assert len(webargs) == 4 and not any(t.files for t in webargs)  # the oracle must ask for them
    return cachetools + webargs


def journal(serve_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The proxy's records by (rollout id, call index)."""
    records = [json.loads(line) for line in (serve_dir / "calls.jsonl").read_text().splitlines()]
    return {(r["rollout_id"], r["call_index"]): r for r in records if "call_index" in r}


@pytest.fixture(scope="module", params=["whole", "diff"])
def collected(request, tasks, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"oracle-{request.param}")
    settings = RolloutSettings(edit_format=request.param, concurrency=3, timeout_s=300)
    funcs = reward_funcs(list(DEFAULT_REWARDS))
    report = collect(
        tasks, Teacher(), settings, funcs, list(DEFAULT_REWARDS.values()), 1.5, out / "t.jsonl", serve_dir=out
    )
    return request.param, report, out


def test_aider_with_the_oracle_reproduces_the_oracle_patch_and_passes_the_tests(collected):
    edit_format, report, serve_dir = collected
    for i, (task, outcome) in enumerate(zip(report.tasks, report.outcomes, strict=True)):
        why = f"{task.instance_id}: {outcome.reason}\n{outcome.log_tail[-2000:]}"
        assert outcome.status == "ok", why
        # the fixed files exactly: the patch git writes of the oracle fix (the task's patch text may align moved
        # lines the other way, ~0.8 similar), which collect() scores patch_similarity against
        assert similarity(outcome.patch, fix_patch(oracle_task(task))) == 1.0, why + outcome.patch
        assert report.rewards["patch_similarity"][i] == 1.0
        assert report.rewards["tests_pass"][i] == 1.0, why  # FAIL_TO_PASS pass, PASS_TO_PASS still pass
        # files given up front: the edit at once; none (webargs): "Please add <file>", Aider adds it, the edit
        # (and Aider's weak-model summary of a long chat, tagged, not a policy call)
        assert len(list(policy_calls(outcome))) == (1 if task.files else 2), why
    assert report.kept == [True] * 10 and report.kept_per_task() == {t.instance_id: (1, 1) for t in report.tasks}
    assert report.multi_turn == [False] * 10  # no test feedback: no multi-turn rollout

    rows = [json.loads(line) for line in report.out.read_text().splitlines()]
    assert len(rows) == report.calls_written == 6 * 1 + 4 * 2
    records = journal(serve_dir)
    for row in rows:
        assert set(row) == ROW_KEYS and row["teacher"] == "oracle" and row["edit_format"] == edit_format
        record = records[(row["rollout_id"], row["call_index"])]
        assert row["prompt"] == record["request"]["messages"] and row["prompt"][0]["role"] == "system"
        assert row["completion"] == [{"role": "assistant", "content": record["text"]}]
        assert record["prompt_token_ids"] and record["completion_token_ids"][-1] == 2  # <|im_end|>
        assert record["logprobs"] == [0.0] * len(record["completion_token_ids"])

    calls = [records[(o.rollout_id, 0)] for o, t in zip(report.outcomes, report.tasks, strict=True) if t.files]
    prompt = [len(c["prompt_token_ids"]) for c in calls]
    completion = [len(c["completion_token_ids"]) for c in calls]
    seconds = [o.timings["agent_s"] for o in report.outcomes]
    print(
        f"\n{edit_format}: cachetools prompt tokens {prompt}, oracle answer tokens {completion}; "
        f"agent seconds per rollout median {statistics.median(seconds):.1f} max {max(seconds):.1f}; "
        f"collect {report.seconds:.0f}s for {len(report.outcomes)} rollouts"
    )


def _trajectories(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "aitlrt.cli", "trajectories", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def test_the_trajectories_command_keeps_good_rollouts_and_rejects_garbage(cachetools_file, served, tmp_path):
    common = ["--tasks", cachetools_file, "--limit", "2", "--concurrency", "2", "--timeout", "300"]
    done = _trajectories(*common, "--teacher", "oracle", "--out", tmp_path / "oracle.jsonl", "--serve-dir", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 rollouts, 2 kept (weighted reward >= 1.5), 2 calls written" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "oracle.jsonl").read_text().splitlines()]
    records = journal(tmp_path)
    assert len(rows) == 2 and len({r["instance_id"] for r in rows}) == 2
    for row in rows:
        assert set(row) == ROW_KEYS and (row["teacher"], row["edit_format"], row["reward"]) == ("oracle", "whole", 1.5)
        assert row["prompt"] == records[(row["rollout_id"], row["call_index"])]["request"]["messages"]

    # The session's vLLM with the bundled model as the teacher: it answers in prose, no rollout is kept.
    garbage = tmp_path / "garbage"
    done = _trajectories(
        *common,
        *("--max-calls", "2", "--teacher", served.url, "--out", garbage / "t.jsonl", "--serve-dir", garbage),
        *("--teacher-api-key-env", "TEACHER_KEY"),  # an aitlrt-serve as the teacher: its admin key
        env={**os.environ, "TEACHER_KEY": admin(served.url)["Authorization"][7:]},
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"teacher {served.url}: 2 rollouts, 0 kept (weighted reward >= 1), 0 calls written" in done.stdout
    assert (garbage / "t.jsonl").read_text() == ""
    answered = [r for r in journal(garbage).values() if r["status"] == 200]
    assert answered and all(r["text"] and not r["completion_token_ids"] for r in answered)  # --no-token-ids
    assert not any("return_token_ids" in r["request"] or "top_k" in r["request"] for r in answered)


def strict_openai(key: str) -> FastAPI:
    """An OpenAI-compatible server that knows only OpenAI's fields and wants its API key."""
    app = FastAPI()
    known = {"model", "messages", "temperature", "top_p", "max_tokens", "stream", "stop", "seed", "n"}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "teacher", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> JSONResponse:
        if request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": {"message": "bad key", "code": 401}}, status_code=401)
        body = await request.json()
        if unknown := sorted(set(body) - known):
            return JSONResponse({"error": {"message": f"Unrecognized arguments: {unknown}"}}, status_code=400)
        message = {"role": "assistant", "content": f"echo: {body['messages'][-1]['content']}"}
        return JSONResponse({"id": "x", "object": "chat.completion", "model": body["model"],
                             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})  # fmt: skip

    return app


def test_a_teacher_that_is_not_vllm_gets_no_vllm_fields_and_its_api_key(start_proxy, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", "sekrit")
    with serve_in_thread(strict_openai("sekrit")) as upstream:
        vllm_shaped = start_proxy(upstream, "--upstream-api-key-env", "TEACHER_KEY", wait_upstream=False)
        refused = chat(vllm_shaped.url, "t-1", "hi")
        assert refused.status_code == 400 and "return_token_ids" in refused.json()["error"]["message"]

        proxy = start_proxy(upstream, "--no-token-ids", "--upstream-api-key-env", "TEACHER_KEY", wait_upstream=False)
        resp = chat(proxy.url, "t-2", "hi")
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "echo: hi"
        (call,) = trace(proxy.url, "t-2")
        assert call["status"] == 200 and call["text"] == "echo: hi" and call["request"]["model"] == "teacher"
        assert call["prompt_token_ids"] == call["completion_token_ids"] == []

        keyless = start_proxy(upstream, "--no-token-ids", wait_upstream=False)
        assert chat(keyless.url, "t-3", "hi").status_code == 401
