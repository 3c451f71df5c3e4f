"""``aitlrt sft`` end to end on CPU: the CLI fine-tunes the bundled model on a few Aider trajectories, the loss is
finite and logged per step, and the output folder loads into the real vLLM behind ``aitlrt-serve`` and answers; a
LoRA run's merged output has exactly the base model's tensors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from aitlrt.warmstart.sft import METRICS_FILE, RESULT_FILE, run_sft
from tests.conftest import admin, chat

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = """Act as an expert software developer.
Always use best practices when coding.
Respect and use existing conventions, libraries, etc that are already present in the code base.
Take requests for changes to the supplied code.
If the request is ambiguous, ask questions.

Once you understand the request you MUST:
1. Decide if you need to propose *SEARCH/REPLACE* edits to any files that haven't been added to the chat.
2. Think step-by-step and explain the needed changes in a few short sentences.
3. Describe each change with a *SEARCH/REPLACE block* per the examples below.

# *SEARCH/REPLACE block* Rules:
Every *SEARCH/REPLACE block* must use this format:
1. The *FULL* file path alone on a line, verbatim. No bold asterisks, no quotes around it, no escaping of characters.
2. The opening fence and code language, eg: ```python
3. The start of search block: <<<<<<< SEARCH
4. A contiguous chunk of lines to search for in the existing source code
5. The dividing line: =======
6. The lines to replace into the source code
7. The end of the replace block: >>>>>>> REPLACE
8. The closing fence: ```

Every *SEARCH* section must *EXACTLY MATCH* the existing file content, character for character."""

TASKS = [
    (
        "cachetools/keys.py",
        "def hashkey(*args, **kwargs):\n    return tuple(args)\n",
        "return tuple(args)",
        "key = tuple(args)\n    if kwargs:\n        key += tuple(sorted(kwargs.items()))\n    return key",
        "hashkey ignores keyword arguments: hashkey(1, a=2) == hashkey(1, a=3).",
    ),
    (
        "cachetools/_ttl.py",
        "def expired(expires, now):\n    return now > expires\n",
        "return now > expires",
        "return now >= expires",
        "An item is still returned at the exact moment its TTL expires.",
    ),
    (
        "cachetools/lru.py",
        "def touch(order, key):\n    order.remove(key)\n    order.insert(0, key)\n",
        "order.insert(0, key)",
        "order.append(key)",
        "LRUCache evicts the most recently used item instead of the least.",
    ),
    (
        "cachetools/size.py",
        "def getsizeof(value):\n    return 0\n",
        "return 0",
        "return 1",
        "Cache.currsize stays 0 whatever is inserted.",
    ),
]


def trajectory_line(k: int) -> dict:
    path, code, old, new, problem = TASKS[k]
    added = "I have *added these files to the chat* so you can go ahead and edit them."
    user = f"{problem}\n\n{added}\n\n{path}\n```\n{code}```"
    answer = (
        f"Fix it in `{path}`:\n\n{path}\n```python\n<<<<<<< SEARCH\n    {old}\n=======\n    {new}\n>>>>>>> REPLACE\n```"
    )
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Change get_factorial() to use math.factorial"},
            {"role": "assistant", "content": "To make this change we need to modify `mathweb/flask/app.py`."},
            {"role": "user", "content": user},
        ],
        "completion": [{"role": "assistant", "content": answer}],
        "instance_id": f"cachetools-{k}",
        "rollout_id": f"cachetools-{k}.oracle.0",
        "call_index": 0,
        "reward": 1.0,
        "teacher": "oracle",
        "edit_format": "diff",
    }


@pytest.fixture
def trajectories(tmp_path: Path) -> Path:
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(trajectory_line(k)) + "\n" for k in range(len(TASKS))))
    return path


def tensors(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}  # noqa: SIM118


def changed_tensors(folder: Path, base: Path) -> list[str]:
    with safe_open(folder / "model.safetensors", "pt") as new, safe_open(base / "model.safetensors", "pt") as old:
        return [name for name in old.keys() if not new.get_tensor(name).equal(old.get_tensor(name))]  # noqa: SIM118


def reload_and_answer(url: str, folder: Path, rollout: str) -> None:
    resp = httpx.post(f"{url}/weights/reload", headers=admin(url), json={"path": str(folder)}, timeout=300)
    assert resp.status_code == 200, resp.text
    answer = chat(url, rollout, trajectory_line(0)["prompt"][-1]["content"], max_tokens=16)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


def test_cli_full_fine_tuning_writes_a_model_that_vllm_serves(
    trajectories, model_dir, served, restore_weights, tmp_path
):
    out = tmp_path / "sft"
    argv = [sys.executable, "-m", "aitlrt.cli", "sft", "--data", str(trajectories), "--model_name_or_path", "bundled"]
    argv += ["--output_dir", str(out), "--max_steps", "2", "--gradient_accumulation_steps", "2"]
    argv += ["--learning_rate", "5e-4"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[aitlrt] full model: {out}" in proc.stdout

    logged = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    losses = [entry["loss"] for entry in logged if "loss" in entry]
    assert [entry["step"] for entry in logged if "loss" in entry] == [1, 2]
    assert all(math.isfinite(loss) and loss > 0 for loss in losses)
    result = json.loads((out / RESULT_FILE).read_text())
    assert (result["rows"], result["dropped_too_long"], result["steps"], result["lora"]) == (4, 0, 2, False)
    assert result["losses"] == losses and result["tokens"] > 0 and result["tokens_per_s"] > 0

    config = json.loads((out / "config.json").read_text())
    assert (config["dtype"], config["use_cache"]) == ("bfloat16", True)  # as the base model
    assert (out / "tokenizer.json").is_file() and not (out / "adapter_config.json").exists()
    assert tensors(out) == tensors(model_dir)
    assert changed_tensors(out, model_dir)
    model = AutoModelForCausalLM.from_pretrained(out)  # as aitlrt/train.py --model_name_or_path OUT starts
    assert (type(model).__name__, model.config.pad_token_id) == ("LlamaForCausalLM", 2)
    reload_and_answer(served.url, out, "sft-full")


def test_lora_merged_output_has_the_base_model_tensors(trajectories, model_dir, served, restore_weights, tmp_path):
    result = run_sft(
        trajectories,
        "bundled",
        tmp_path / "lora",
        use_peft=True,
        lora_r=4,
        lora_target_modules=["q_proj", "v_proj"],
        max_steps=1,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
    )
    assert result.lora and result.steps == 1 and all(math.isfinite(loss) for loss in result.losses)
    assert tensors(result.output_dir) == tensors(model_dir)
    changed = changed_tensors(result.output_dir, model_dir)
    assert changed and all(name.endswith(("q_proj.weight", "v_proj.weight")) for name in changed)
    assert not (result.output_dir / "adapter_config.json").exists()
    reload_and_answer(served.url, result.output_dir, "sft-lora")


@pytest.mark.timeout(300)  # a child that joined the unreachable rendezvous would wait: fail it well before 600 s
def test_the_warm_start_fine_tunes_in_a_child_that_is_no_rank_of_the_callers_run(trajectories, tmp_path, monkeypatch):
    from aitlrt.warmstart.recipe import sft_from_flags

    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)  # a rank of a run whose rendezvous this process cannot reach
    out = tmp_path / "warm"
    sft_from_flags(trajectories, "bundled", out, ["--max_steps", "1", "--gradient_accumulation_steps", "1"])
    result = json.loads((out / RESULT_FILE).read_text())
    assert (result["steps"], result["rows"]) == (1, 4) and math.isfinite(result["losses"][0])
    with pytest.raises(RuntimeError, match=r"aitlrt sft .* failed with exit code"):
        sft_from_flags(trajectories, "bundled", tmp_path / "bad", ["--max_steps", "1", "--no_such_flag", "1"])


def gone(proc: psutil.Process) -> bool:
    """Ended: reaped, or a zombie nobody reaps."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(300)
def test_the_warm_starts_fine_tuning_dies_with_the_run_that_started_it(trajectories, tmp_path):
    """A run killed while its warm start fine-tunes (SIGKILL: none of its code runs) leaves no ``aitlrt sft`` behind
    on the cores (one did, for 13 min, under a killed bench)."""
    out = tmp_path / "warm"
    flags = ["--max_steps", "100000", "--gradient_accumulation_steps", "1"]  # far longer than the test
    script = (
        "from pathlib import Path; from aitlrt.warmstart.recipe import sft_from_flags; "
        f"sft_from_flags(Path({str(trajectories)!r}), 'bundled', Path({str(out)!r}), {flags!r})"
    )
    run = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    sft: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while not ((out / METRICS_FILE).is_file() and (out / METRICS_FILE).read_text().strip()):  # it is training
            assert run.poll() is None, f"the run ended first ({run.returncode})"
            assert time.monotonic() < deadline, "no fine-tuning step in 240 s"
            time.sleep(0.5)
        sft = psutil.Process(run.pid).children()
        assert len(sft) == 1, sft
        run.send_signal(signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 60  # SIGTERM, then the step's current op and the `finally`s
        while not gone(sft[0]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert gone(sft[0]), "the fine-tuning outlived the run that started it"
    finally:
        run.kill()
        for proc in sft:
            if not gone(proc):
                proc.kill()
