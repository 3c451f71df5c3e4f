"""vLLM's tensor x data parallel layout for the jobscripts (jobs/lib.sh `vllm_layout`), from the model's shape.

    python jobs/vllm_layout.py --model MODEL --gpus 8 [--gpus-per-node 8] [--tp N] [--dp N] [-- SERVE ARGS]

prints "TP DP" on stdout and one line saying why on stderr; a bad request exits 2 with an "error:" line.

The rule, unless --tp / --dp (AITLRT_VLLM_TP / AITLRT_VLLM_DP) say:

* TP is the largest size that divides the attention heads, the KV heads and the GPUs of a node (vLLM splits heads
  evenly across TP ranks and the jobscripts do not run tensor parallelism across nodes); the other serving GPUs
  are data-parallel engines: DP = serving GPUs / TP. A large TP keeps one rollout's tokens fast, which is what
  a batch of long agent rollouts waits on; a DP engine serves whole requests and needs no head split.
* Memory: the bf16 weights (parameters x 2 bytes) must fit in at most half of what vLLM may take on the TP GPUs,
  weights <= 0.5 x --gpu-memory-utilization (0.9) x TP x GPU memory, the other half left for the KV cache,
  activations and CUDA graphs. Checked when the GPU memory is known (AITLRT_GPU_MEMORY_GIB, else nvidia-smi).
* The shape comes from the model's config.json: the model folder, or the Hugging Face cache
  (HF_HUB_CACHE, HF_HOME/hub) for a Hub id; without one (no network, a dry run), from KNOWN below; an unknown
  model keeps the old default, TP = the GPUs of a node.

Standard library only: it runs with the venv's python, or the host's python3 in container mode.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PREFIX = "[aitlrt-job]"
BF16_BYTES = 2
WEIGHT_SHARE = 0.5  # of vLLM's memory on the TP GPUs; the rest is KV cache and activations
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    params: float | None  # parameters; None: unknown (memory not checked)
    source: str  # where the shape came from, for the log line


# A pattern for the model's last path component (lowercased, the whole name): heads, KV heads, parameters.
# Qwen2.5 and Qwen2.5-Coder share their shapes per size (config.json of each Hub repo; -Instruct the same).
KNOWN: list[tuple[str, int, int, float]] = [
    (r"qwen2\.5-(coder-)?0\.5b(-.*)?", 14, 2, 0.49e9),
    (r"qwen2\.5-(coder-)?1\.5b(-.*)?", 12, 2, 1.54e9),
    (r"qwen2\.5-(coder-)?3b(-.*)?", 16, 2, 3.09e9),
    (r"qwen2\.5-(coder-)?7b(-.*)?", 28, 4, 7.61e9),
    (r"qwen2\.5-(coder-)?14b(-.*)?", 40, 8, 14.7e9),
    (r"qwen2\.5-(coder-)?32b(-.*)?", 40, 8, 32.5e9),
    (r"bundled|smollm2|smollm2-135m(-instruct)?", 9, 3, 0.135e9),  # the bundled model, SmolLM2-135M-Instruct
]


class LayoutError(Exception):
    pass


def params_from_config(cfg: dict) -> float | None:
    """Parameters of a dense decoder (Llama, Qwen2, Mistral, ...) from its config; None when it cannot tell."""
    try:
        h, layers, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        inter, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None  # mixture of experts: not this formula
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim  # q, o; k, v
    per_layer = attention + 3 * h * inter + 2 * h  # gate, up, down; two norms
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(layers * per_layer + embeddings + h)


def shape_from_config(path: Path) -> Shape | None:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if "num_attention_heads" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # a multimodal model's language model
    try:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError):
        return None
    return Shape(heads, kv_heads, params_from_config(cfg), str(path))


def hub_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub")
    return dirs


def find_config(model: str) -> Path | None:
    """config.json of a model folder, or of a Hub id's snapshot in the local Hugging Face cache (refs/main first)."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path / "config.json"
    if model.count("/") != 1 or model.startswith((".", "/")):
        return None
    for cache in hub_cache_dirs():
        repo = cache / ("models--" + model.replace("/", "--"))
        ref = repo / "refs" / "main"
        if ref.is_file():
            snapshot = repo / "snapshots" / ref.read_text().strip() / "config.json"
            if snapshot.is_file():
                return snapshot
        found = sorted(repo.glob("snapshots/*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        if found:
            return found[0]
    return None


def known_shape(model: str) -> Shape | None:
    name = Path(model.rstrip("/")).name.lower()
    for pattern, heads, kv_heads, params in KNOWN:
        if re.fullmatch(pattern, name):
            return Shape(heads, kv_heads, params, "known shapes of jobs/vllm_layout.py")
    return None


def model_shape(model: str) -> Shape | None:
    config = find_config(model)
    shape = shape_from_config(config) if config else None
    known = known_shape(model)
    if shape is not None and shape.params is None and known is not None:
        shape = Shape(shape.heads, shape.kv_heads, known.params, shape.source)
    return shape or known


def gpu_memory_gib() -> float | None:
    """Memory of one GPU: AITLRT_GPU_MEMORY_GIB, else the smallest GPU nvidia-smi lists, else None."""
    if os.environ.get("AITLRT_GPU_MEMORY_GIB"):
        try:
            return float(os.environ["AITLRT_GPU_MEMORY_GIB"])
        except ValueError:
            value = os.environ["AITLRT_GPU_MEMORY_GIB"]
            raise LayoutError(f"AITLRT_GPU_MEMORY_GIB must be a number of GiB, got '{value}'") from None
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return min(float(line) for line in out.split()) / 1024
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def memory_utilization(serve_args: list[str]) -> float:
    """The last --gpu-memory-utilization among the server's arguments, else vLLM's default."""
    value = None
    for i, arg in enumerate(serve_args):
        if arg == "--gpu-memory-utilization" and i + 1 < len(serve_args):
            value = serve_args[i + 1]
        elif arg.startswith("--gpu-memory-utilization="):
            value = arg.split("=", 1)[1]
    try:
        return float(value) if value is not None else DEFAULT_GPU_MEMORY_UTILIZATION
    except ValueError:
        return DEFAULT_GPU_MEMORY_UTILIZATION


def positive(value: str | None) -> int | None:
    if value in (None, ""):
        return None
    if not re.fullmatch(r"[1-9][0-9]*", value):
        raise LayoutError(f"AITLRT_VLLM_TP and AITLRT_VLLM_DP must be positive integers, got '{value}'")
    return int(value)


def fits(shape: Shape, tp: int, mem_gib: float | None, util: float) -> bool:
    if shape.params is None or mem_gib is None:
        return True
    return shape.params * BF16_BYTES <= WEIGHT_SHARE * util * tp * mem_gib * 2**30


def plan(
    model: str,
    gpus: int,
    gpus_per_node: int | None = None,
    tp: str | None = None,
    dp: str | None = None,
    serve_args: list[str] | None = None,
    mem_gib: float | None = None,
) -> tuple[int, int, str]:
    """(TP, DP, the reason line) for ``gpus`` serving GPUs, ``gpus_per_node`` of them per node."""
    node = gpus_per_node or gpus
    util = memory_utilization(serve_args or [])
    want_tp, want_dp = positive(tp), positive(dp)
    shape = model_shape(model)
    what = (
        f"{model}: {shape.heads} attention heads, {shape.kv_heads} KV heads"
        + (f", ~{shape.params * BF16_BYTES / 1e9:.1f} GB of bf16 weights" if shape.params else "")
        + f" ({shape.source})"
        if shape
        else f"{model}: shape unknown (no config.json found, not a known model)"
    )
    memory = f"{mem_gib:.0f} GiB" if mem_gib is not None else "unknown GPU memory (AITLRT_GPU_MEMORY_GIB), not checked"

    if want_tp is not None or want_dp is not None:
        if want_tp is not None and want_dp is None:
            if gpus % want_tp:
                raise LayoutError(f"vLLM TP {want_tp} does not divide the {gpus} serving GPU(s)")
            want_dp = gpus // want_tp
        elif want_tp is None:
            assert want_dp is not None
            if gpus % want_dp:
                raise LayoutError(f"vLLM DP {want_dp} does not divide the {gpus} serving GPU(s)")
            want_tp = gpus // want_dp
        assert want_tp is not None and want_dp is not None
        if want_tp * want_dp != gpus:
            raise LayoutError(f"vLLM TP {want_tp} x DP {want_dp} must equal the {gpus} serving GPU(s)")
        if node % want_tp:
            raise LayoutError(
                f"vLLM TP {want_tp} must divide the {node} GPUs of a node (no tensor parallelism across nodes here)"
            )
        reason = "set by AITLRT_VLLM_TP / AITLRT_VLLM_DP"
        if shape and (shape.heads % want_tp or shape.kv_heads % want_tp):
            reason += f"; warning: TP {want_tp} does not divide the heads, vLLM may refuse it"
        if shape and not fits(shape, want_tp, mem_gib, util):
            reason += f"; warning: the weights may not fit TP {want_tp} x {memory}"
        return want_tp, want_dp, f"vLLM layout: {what}; TP {want_tp} x DP {want_dp}: {reason}"

    if gpus % node:
        raise LayoutError(f"the {gpus} serving GPU(s) are not whole nodes of {node}")
    if shape is None:
        return node, gpus // node, f"vLLM layout: {what}; TP {node} x DP {gpus // node}: TP = the GPUs of a node"
    common = math.gcd(shape.heads, shape.kv_heads)
    best = max(t for t in range(1, node + 1) if node % t == 0 and common % t == 0)
    if not fits(shape, best, mem_gib, util):
        assert shape.params is not None and mem_gib is not None  # fits() is True without them
        need = shape.params * BF16_BYTES / (WEIGHT_SHARE * util * mem_gib * 2**30)
        raise LayoutError(
            f"{model}: ~{shape.params * BF16_BYTES / 1e9:.1f} GB of bf16 weights do not fit vLLM on {mem_gib:.0f} GiB"
            f" GPUs: they need TP >= {math.ceil(need)} (weights <= {WEIGHT_SHARE} x {util} of the TP GPUs' memory)"
            f" but TP {best} is the largest that divides the {shape.heads} attention heads, the {shape.kv_heads} KV"
            f" heads and the {node} GPUs of a node; use bigger GPUs, or set AITLRT_VLLM_TP and"
            " --gpu-memory-utilization yourself"
        )
    reason = f"the largest TP dividing the heads ({common} in common) and the {node} GPUs of a node"
    reason += f"; weights fit TP {best} x {memory}" if mem_gib is not None and shape.params else f"; {memory}"
    return best, gpus // best, f"vLLM layout: {what}; TP {best} x DP {gpus // best}: {reason}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gpus", type=int, required=True, help="serving GPUs in all")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: --gpus (one node)")
    p.add_argument("--tp", default=None, help="AITLRT_VLLM_TP (empty: choose)")
    p.add_argument("--dp", default=None, help="AITLRT_VLLM_DP (empty: choose)")
    p.add_argument("serve_args", nargs="*", help="after --: the server's arguments (--gpu-memory-utilization)")
    args = p.parse_args(argv)
    try:
        tp, dp, why = plan(
            args.model, args.gpus, args.gpus_per_node, args.tp, args.dp, args.serve_args, gpu_memory_gib()
        )
    except LayoutError as exc:
        print(f"{PREFIX} error: {exc}", file=sys.stderr)
        return 2
    print(f"{PREFIX} {why}", file=sys.stderr)
    print(tp, dp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
