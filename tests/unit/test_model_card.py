"""The saved model card names the base model, the recipe and the held-out result (trl's read "fine-tuned version of
[None]" for any local model, the bundled one included)."""

from __future__ import annotations

from aitlrt.common.model import bundled_model_dir
from aitlrt.training.model_card import recipe_file, write_model_card

TABLE = """held-out                  before          after        trivial
resolve rate               0.056          0.111          0.000
(9 tasks x 2 rollouts each; weighted reward = 1 tests_pass + 0.5 changed_lines_similarity)"""


def test_the_card_of_a_run_on_the_bundled_model_names_it_the_recipe_and_the_heldout_table(tmp_path):
    argv = ["--config", "configs/cpu_demo.yaml", "--output_dir", str(tmp_path / "cpu_demo")]
    path = write_model_card(
        tmp_path / "cpu_demo",
        str(bundled_model_dir()),  # what the model's config says after loading the bundled folder
        recipe=recipe_file(argv),
        command=argv,
        reward_weights={"tests_pass": 1.0, "patch_similarity": 0.0, "changed_lines_similarity": 0.5},
        warm_start="/root/.cache/aitlrt/warmstart/09cb/model",
        heldout=TABLE,
    )
    card = path.read_text()
    assert path.name == "README.md" and "[None]" not in card and "None" not in card
    for part in (
        "base_model: HuggingFaceTB/SmolLM2-135M-Instruct",
        "# cpu_demo",
        "A fine-tuned version of [HuggingFaceTB/SmolLM2-135M-Instruct]",
        "- config: `configs/cpu_demo.yaml`",
        "- command line: `--config configs/cpu_demo.yaml --output_dir",
        "- warm start: GRPO started from `/root/.cache/aitlrt/warmstart/09cb/model`",
        "- reward: 1 tests_pass + 0.5 changed_lines_similarity",
        "## Held-out result\n\n```text\nheld-out ",
        "resolve rate               0.056          0.111",
    ):
        assert part in card, (part, card)


def test_a_hub_model_is_linked_a_local_one_named_and_a_run_without_heldout_says_so(tmp_path):
    hub = write_model_card(tmp_path / "a", "Qwen/Qwen2.5-Coder-0.5B-Instruct").read_text()
    assert "base_model: Qwen/Qwen2.5-Coder-0.5B-Instruct" in hub
    assert "[Qwen/Qwen2.5-Coder-0.5B-Instruct](https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct)" in hub
    assert "- config: none" in hub and "No held-out evaluation ran" in hub
    local = write_model_card(tmp_path / "b", str(tmp_path)).read_text()
    assert "base_model:" not in local and f"the local model `{tmp_path}`" in local
    assert recipe_file(["--config=r.yaml"]) == "r.yaml" and recipe_file(["--max_steps", "3"]) is None
