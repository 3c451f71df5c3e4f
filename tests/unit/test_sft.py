"""``aitlrt sft`` without training: the loss mask of SFTTrainer's own dataset preparation on a real Aider-shaped row
(the bundled tokenizer, a tiny random Llama), long rows dropped instead of losing their completion, the trajectory
file's refusals, and the CPU defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trl import ModelConfig

from aitlrt.cli.sft import main as sft_main
from aitlrt.common.resources import cpu_bf16_is_native
from aitlrt.warmstart.sft import (
    SftDataError,
    SftScriptArguments,
    WarmStartSFTConfig,
    fitting_rows,
    fold_rollout_calls,
    load_sft_rows,
    row_tokens,
    run_sft,
    sft_parser,
    sft_trainer,
)
from tests.helpers.multirank_run import tiny_llama

SYSTEM = "Act as an expert software developer.\nEvery *SEARCH/REPLACE block* must use this format: ..."
ANSWER = (
    "mathy.py\n```python\n<<<<<<< SEARCH\ndef triple(x):\n    return x + 3\n=======\n"
    "def triple(x):\n    return x * 3\n>>>>>>> REPLACE\n```"
)


def line(user: str = "mathy.py\n```\ndef triple(x):\n    return x + 3\n```\nFix triple.", answer: str = ANSWER) -> dict:
    """One row as `aitlrt trajectories` writes it; the prompt holds one of Aider's few-shot assistant turns."""
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Change the greeting to be more casual"},
            {"role": "assistant", "content": "Ok, I will change it."},
            {"role": "user", "content": user},
        ],
        "completion": [{"role": "assistant", "content": answer}],
        "instance_id": "mathy-1",
        "rollout_id": "r-0",
        "call_index": 0,
        "reward": 1.0,
        "teacher": "oracle",
        "edit_format": "diff",
    }


def write(path: Path, *rows: dict | str) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_loss_only_on_the_assistant_answer_and_its_end_of_turn(tokenizer, tmp_path):
    rows = load_sft_rows(write(tmp_path / "t.jsonl", line()))
    config = WarmStartSFTConfig(output_dir=str(tmp_path))
    trainer = sft_trainer(rows, tiny_llama(len(tokenizer), 4096), tokenizer, config)
    example = trainer.train_dataset[0]
    ids, labels = example["input_ids"], example["labels"]
    prompt = rows[0]["prompt"]
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    full_ids = tokenizer.apply_chat_template(prompt + rows[0]["completion"], tokenize=True, return_dict=True)
    start = len(prompt_ids["input_ids"])

    assert ids == full_ids["input_ids"]  # the whole row, nothing cut
    assert ids[:start] == prompt_ids["input_ids"]
    assert set(labels[:start]) == {-100}  # no loss on the prompt, the few-shot assistant turn included
    trained = [t for t in labels if t != -100]
    assert labels[start : start + len(trained)] == ids[start : start + len(trained)]
    # the answer and its end-of-turn token, where vLLM stops sampling; not the template's newline after it (D12)
    assert tokenizer.decode(trained) == ANSWER + "<|im_end|>"
    assert tokenizer.decode(ids[start + len(trained) :]) == "\n" and set(labels[start + len(trained) :]) == {-100}
    assert tokenizer.decode(ids[:start]).endswith("Fix triple.<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 5  # 4 prompt turns + the answer's


def test_merging_calls_with_packing_is_refused(tokenizer, tmp_path):
    rows = load_sft_rows(write(tmp_path / "t.jsonl", line()))
    config = WarmStartSFTConfig(output_dir=str(tmp_path), merge_rollout_calls=True, packing=True)
    with pytest.raises(ValueError, match=r"merge_rollout_calls .* packing"):
        sft_trainer(rows, tiny_llama(len(tokenizer), 4096), tokenizer, config)


@pytest.mark.parametrize("setting", [{"assistant_only_loss": True}, {"completion_only_loss": False}])
def test_settings_that_would_train_on_the_prompt_are_refused(tokenizer, tmp_path, setting):
    rows = load_sft_rows(write(tmp_path / "t.jsonl", line()))
    config = WarmStartSFTConfig(output_dir=str(tmp_path), **setting)
    with pytest.raises(ValueError, match="applied answer only"):
        sft_trainer(rows, tiny_llama(len(tokenizer), 4096), tokenizer, config)


def test_longer_rows_are_dropped_and_counted_and_the_rest_keep_their_completion(tokenizer, tmp_path):
    short, long = line(), line(user="mathy.py\n```\n" + "x = 1\n" * 200 + "```\nFix triple.")
    rows = load_sft_rows(write(tmp_path / "t.jsonl", long, short, long))
    limit = row_tokens(rows[1], tokenizer)
    assert row_tokens(rows[0], tokenizer) > limit

    kept, dropped = fitting_rows(rows, tokenizer, limit)
    assert (kept, dropped) == ([rows[1]], 2)
    config = WarmStartSFTConfig(output_dir=str(tmp_path), max_length=limit)
    example = sft_trainer(kept, tiny_llama(len(tokenizer), 4096), tokenizer, config).train_dataset[0]
    assert len(example["input_ids"]) == limit
    assert tokenizer.decode([t for t in example["labels"] if t != -100]) == ANSWER + "<|im_end|>"
    with pytest.raises(SftDataError, match="every one of the 3 rows is longer than max_length"):
        fitting_rows(rows, tokenizer, limit - 1)


def test_rows_keep_role_and_content_only_and_their_rollout_and_call(tmp_path):
    row = line()
    row["prompt"][0]["name"] = "aider"
    (loaded,) = load_sft_rows(write(tmp_path / "t.jsonl", row, "  "))
    assert set(loaded) == {"prompt", "completion", "rollout_id", "call_index"}
    assert (loaded["rollout_id"], loaded["call_index"]) == ("r-0", 0)
    assert loaded["prompt"][0] == {"role": "system", "content": SYSTEM}
    assert loaded["completion"] == [{"role": "assistant", "content": ANSWER}]


def _without_completion() -> dict:
    row = line()
    del row["completion"]
    return row


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ((), "no rows"),
        (("", "   "), "no rows"),
        ((line(), '{"prompt": [}'), "line 2: not JSON"),
        ((line(), line(), "[1, 2]"), r"line 3: the row: Input should be an object"),
        ((_without_completion(),), "line 1: completion: Field required$"),
        (({**line(), "completion": []},), "line 1: completion: must be one non-empty assistant message"),
        (({**line(), "completion": [{"role": "user", "content": "hi"}]},), "line 1: completion: must be one non-empty"),
        (({**line(), "completion": [{"role": "assistant", "content": " \n"}]},), "line 1: completion: must be one"),
        (({**line(), "completion": "the answer"},), "line 1: completion: Input should be a valid (list|array)"),
        (({**line(), "prompt": []},), r"line 1: prompt: List should have at least 1 item"),
        (({**line(), "prompt": [{"role": "user", "content": None}]},), r"line 1: prompt\[0\]\.content: .* string"),
        (({**line(), "prompt": [{"role": "user", "content": 3}]},), r"line 1: prompt\[0\]\.content: .* \(got 3\)"),
        (({**line(), "prompt": [{"role": "tool", "content": "x"}]},), r"line 1: prompt\[0\]\.role: .*got 'tool'"),
        ((line(), {**line(), "prompt": [{"content": "x"}]}), r"line 2: prompt\[0\]\.role: Field required"),
    ],
)
def test_unusable_files_are_refused_naming_the_line(tmp_path, lines, message):
    path = write(tmp_path / "t.jsonl", *lines) if lines else tmp_path / "t.jsonl"
    if not lines:
        path.write_text("")
    with pytest.raises(SftDataError, match=message):
        load_sft_rows(path)


def test_the_cli_refuses_a_malformed_file_before_loading_any_model(tmp_path):
    data = write(tmp_path / "t.jsonl", line(), "not json")
    with pytest.raises(SystemExit, match=r"aitlrt sft: .*t\.jsonl line 2: not JSON"):
        sft_main(["--data", str(data), "--model_name_or_path", str(tmp_path / "no-model")])
    with pytest.raises(SystemExit, match="no such file"):
        sft_main(["--data", str(tmp_path / "missing.jsonl")])


def _parse(*argv: str) -> tuple[SftScriptArguments, WarmStartSFTConfig, ModelConfig]:
    return sft_parser().parse_args_and_config(["--data", "t.jsonl", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults")
def test_cpu_defaults_and_flags_override_them(tmp_path):
    _, config, model_args = _parse()
    native = cpu_bf16_is_native()  # bf16 autocast only where the CPU has native bf16 (AMX, AVX512-BF16)
    assert (config.use_cpu, config.bf16, config.gradient_checkpointing) == (True, native, False)
    assert (config.max_length, config.truncation_mode, config.completion_only_loss) == (4096, "keep_start", None)
    assert (config.save_strategy, config.report_to, config.logging_steps) == ("no", [], 1)
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (1, 8)
    assert config.shared_prefix and config.freeze_layers == 0
    assert (model_args.dtype, model_args.use_peft) == ("float32", False)

    flags = ["--gradient_checkpointing", "true", "--max_length", "8192", "--save_strategy", "steps"]
    yaml = tmp_path / "c.yaml"
    yaml.write_text("use_peft: true\nlora_r: 8\nlogging_steps: 5\nreport_to: wandb\n")
    _, config, model_args = _parse(*flags, "--config", str(yaml), "--lora_r", "4")
    assert (config.gradient_checkpointing, config.max_length, config.save_strategy) == (True, 8192, "steps")
    assert (config.logging_steps, config.report_to) == (5, ["wandb"])
    assert (model_args.use_peft, model_args.lora_r) == (True, 4)


def test_run_sft_refuses_unknown_settings(tmp_path):
    with pytest.raises(TypeError, match="unknown settings \\['lora_rank'\\]"):
        run_sft(tmp_path / "t.jsonl", "bundled", tmp_path / "out", lora_rank=8)


def test_the_lm_head_sees_the_completion_only_and_loss_and_gradients_are_trls(tokenizer, tmp_path, lm_head_positions):
    from trl import SFTTrainer

    rows = load_sft_rows(write(tmp_path / "t.jsonl", line(), line(answer=ANSWER.replace("* 3", "*3"))))
    config = WarmStartSFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to="none")
    trainer = sft_trainer(rows, tiny_llama(len(tokenizer), 4096), tokenizer, config)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))

    def run(compute) -> tuple[torch.Tensor, list[torch.Tensor], list]:
        trainer.model.zero_grad()
        trainer._metrics["train"].clear()
        loss = compute(trainer, trainer.model, dict(batch))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()], dict(trainer._metrics["train"])

    ours = run(type(trainer).compute_loss)
    trls = run(SFTTrainer.compute_loss)
    labels = batch["labels"]
    first = int((labels != -100).any(dim=0).nonzero()[0])
    assert 0 < first < labels.shape[1] - 10  # a real prompt before the answers
    # the positions that predict a token: from the one before the first answer token on; trl: all but the last
    assert lm_head_positions == [2 * (labels.shape[1] - first), 2 * (labels.shape[1] - 1)]
    torch.testing.assert_close(ours[0], trls[0])
    for x, y in zip(ours[1], trls[1], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    assert ours[2]["entropy"] == pytest.approx(trls[2]["entropy"], rel=1e-5)
    assert ours[2]["mean_token_accuracy"] == trls[2]["mean_token_accuracy"]
    assert ours[0] > 0


def test_label_smoothing_keeps_trls_full_logits(tokenizer, tmp_path):
    from trl import SFTTrainer

    rows = load_sft_rows(write(tmp_path / "t.jsonl", line()))
    config = WarmStartSFTConfig(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to="none")
    trainer = sft_trainer(rows, tiny_llama(len(tokenizer), 4096), tokenizer, config)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ours = type(trainer).compute_loss(trainer, trainer.model, dict(batch))
    torch.testing.assert_close(ours, SFTTrainer.compute_loss(trainer, trainer.model, dict(batch)))


def test_freeze_layers_trains_the_upper_layers_only_and_the_backward_stops_above_the_frozen(tokenizer, tmp_path):
    model_path = tmp_path / "tiny"
    tiny_llama(len(tokenizer), 4096).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    before = {name: p.detach().clone() for name, p in tiny_llama(len(tokenizer), 4096).named_parameters()}
    data = write(tmp_path / "t.jsonl", line(), line(answer=ANSWER.replace("* 3", "*3")))
    reached: list[bool] = []  # does autograd need the bottom layer's output?
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained

    def load(*args, **kwargs):
        model = loaded(*args, **kwargs)
        model.model.layers[0].register_forward_hook(lambda _m, _a, out: reached.append(out[0].requires_grad))
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", load)
        result = run_sft(data, str(model_path), tmp_path / "out", freeze_layers=1, max_steps=2, learning_rate=1e-2)
    assert result.steps == 2 and reached and not any(reached)
    after = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    changed = {name for name, p in after.items() if not torch.equal(p.detach(), before[name])}
    assert changed and all(name.startswith(("model.layers.1.", "model.norm.", "lm_head.")) for name in changed)
    assert any(name.startswith("model.layers.1.") for name in changed)
    assert "lm_head.weight" in changed  # not tied in the tiny model: it trains


@pytest.mark.parametrize(("settings", "message"), [
    ({"freeze_layers": 2}, "between 1 and 1 for 2 layers"),
    ({"freeze_layers": 1, "use_peft": True}, "with use_peft only the LoRA adapters train"),
])  # fmt: skip
def test_freeze_layers_refuses_what_it_cannot_do(tokenizer, tmp_path, settings, message):
    model_path = tmp_path / "tiny"
    tiny_llama(len(tokenizer), 4096).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    with pytest.raises(ValueError, match=message):
        run_sft(write(tmp_path / "t.jsonl", line()), str(model_path), tmp_path / "out", max_steps=1, **settings)


def test_shared_prefix_runs_the_common_prompt_once_with_trls_loss_and_gradients(tokenizer, tmp_path):
    """Two rows that share the system prompt and few-shot turns, then differ (and differ in length: padding)."""
    other = line(user="mathy.py\n```\n" + "y = 2\n" * 20 + "def triple(x):\n    return x + 3\n```\nFix it.")
    rows = load_sft_rows(write(tmp_path / "t.jsonl", line(), other))
    seen: list[int] = []

    def run(shared: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        config = WarmStartSFTConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=2, report_to="none", shared_prefix=shared
        )
        trainer = sft_trainer(rows, tiny_llama(len(tokenizer), 4096), tokenizer, config)
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        seen.clear()
        trainer.model.model.layers[0].register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[1]))
        loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=None)
        loss.backward()
        return loss.detach(), [p.grad for p in trainer.model.parameters()], batch["input_ids"].shape[1]

    plain_loss, plain_grads, width = run(False)
    assert seen == [width]
    shared_loss, shared_grads, _ = run(True)
    lengths = [
        len(tokenizer.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True)["input_ids"])
        for r in rows
    ]
    prefix = seen[0]
    assert len(seen) == 3 and sorted(seen[1:]) == sorted(n - prefix for n in lengths)  # the prefix once; no padding
    assert 50 < prefix < min(lengths)
    torch.testing.assert_close(shared_loss, plain_loss)
    for x, y in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_the_model_is_loaded_as_trls_sft_script_does(tokenizer, tmp_path):
    """model_args' revision, attention and dtype, the config's trust_remote_code, then model_init_kwargs over them,
    for the model, its tokenizer and its config alike; a quantised base is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_path = tmp_path / "tiny"
    tiny_llama(len(tokenizer), 4096).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    data = write(tmp_path / "t.jsonl", line())
    seen: dict[str, list[dict]] = {}
    with pytest.MonkeyPatch.context() as patch:
        for cls in (AutoConfig, AutoModelForCausalLM, AutoTokenizer):
            loaded = cls.from_pretrained

            def load(path, *args, _loaded=loaded, _name=cls.__name__, **kwargs):
                if str(path) == str(model_path):
                    seen.setdefault(_name, []).append(kwargs)
                return _loaded(path, *args, **kwargs)

            patch.setattr(cls, "from_pretrained", load)
        result = run_sft(
            data,
            str(model_path),
            tmp_path / "out",
            max_steps=1,
            model_revision="v2",  # a local folder has no revisions: transformers loads it as it is
            attn_implementation="sdpa",
            dtype="bfloat16",
            trust_remote_code=True,
            model_init_kwargs={"attn_implementation": "eager"},
        )
    assert result.steps == 1
    model = {"revision": "v2", "trust_remote_code": True, "attn_implementation": "eager", "dtype": torch.bfloat16}
    assert seen["AutoModelForCausalLM"] == [model]
    for other in ("AutoTokenizer", "AutoConfig"):  # AutoTokenizer reads the config too, as transformers' own
        assert seen[other] and all(kw["revision"] == "v2" and kw["trust_remote_code"] for kw in seen[other])
    with pytest.raises(ValueError, match="load_in_4bit/load_in_8bit"):
        run_sft(data, str(model_path), tmp_path / "out2", load_in_4bit=True)


def test_the_warm_start_loads_the_model_at_the_runs_revision(tmp_path, monkeypatch):
    """``train.py``'s revision and trust_remote_code reach the warm start's ``aitlrt sft`` and its cache key; the
    defaults add no flag, so cached warm starts keep their keys."""
    from aitlrt.rollout.batch import RolloutSettings
    from aitlrt.warmstart import recipe

    monkeypatch.setenv("AITLRT_HOME", str(tmp_path / "home"))
    calls: list[list[str]] = []
    monkeypatch.setattr(recipe, "sft_from_flags", lambda _data, _model, out, flags: calls.append(list(flags)))
    data = write(tmp_path / "t.jsonl", line())
    settings = RolloutSettings()
    plain = recipe.warm_start(str(data), [], str(tmp_path), settings, ["--num_train_epochs", "1"])
    pinned = recipe.warm_start(str(data), [], str(tmp_path), settings, ["--num_train_epochs", "1"], revision="main")
    other = recipe.warm_start(
        str(data), [], str(tmp_path), settings, ["--num_train_epochs", "1"], revision="v2", trust_remote_code=True
    )
    assert calls == [
        ["--num_train_epochs", "1"],
        ["--model_revision", "v2", "--trust_remote_code", "--num_train_epochs", "1"],
    ]  # the second call was the cached first one (main is the default revision)
    assert plain == pinned != other


def test_two_runs_building_the_same_warm_start_build_it_once(tmp_path, monkeypatch):
    """Two processes (here threads, each with its own lock file handle) asking for the same warm start: the second
    waits for the first and reuses its folder; before the lock it removed the folder the first was building."""
    import threading
    import time

    from aitlrt.rollout.batch import RolloutSettings
    from aitlrt.warmstart import recipe

    monkeypatch.setenv("AITLRT_HOME", str(tmp_path / "home"))
    calls: list[Path] = []

    def slow_sft(_data, _model, out: Path, _flags) -> None:
        calls.append(out)
        out.mkdir(parents=True, exist_ok=True)
        time.sleep(0.5)
        (out / "config.json").write_text("{}")  # still there when the build ends

    monkeypatch.setattr(recipe, "sft_from_flags", slow_sft)
    data = write(tmp_path / "t.jsonl", line())
    got: list[Path] = []
    runs = [
        threading.Thread(target=lambda: got.append(recipe.warm_start(str(data), [], str(tmp_path), RolloutSettings())))
        for _ in range(2)
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert len(calls) == 1 and got[0] == got[1] == calls[0]
    assert (got[0] / "config.json").is_file() and (got[0].parent / "done.json").is_file()


def shell_calls(rollout: str, answers: list[str], rewrite_at: int | None = None) -> list[dict]:
    """A shell agent's calls as `aitlrt trajectories` writes them: each prompt is the previous call's prompt, its
    answer and the command's output (``rewrite_at``: that call's history drops the answer before it)."""
    history = [{"role": "system", "content": "You run one shell command per answer."},
               {"role": "user", "content": "Fix triple in mathy.py; its tests fail."}]  # fmt: skip
    rows = []
    for k, answer in enumerate(answers):
        prompt = list(history)
        if k == rewrite_at:
            prompt = prompt[:-2] + prompt[-1:]
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}],
                     "rollout_id": rollout, "call_index": k})  # fmt: skip
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"output {k}: 0 lines"}]
    return rows


def test_folded_calls_keep_their_labels_and_a_rewritten_history_or_a_row_without_a_rollout_stays_apart():
    a0 = {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, -100], "rollout_id": "a", "call_index": 0}
    a1 = {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [-100] * 5 + [6], "rollout_id": "a", "call_index": 1}
    b0 = {"input_ids": [7, 8], "labels": [-100, 8], "rollout_id": "b", "call_index": 0}
    b1 = {"input_ids": [7, 9, 10], "labels": [-100, -100, 10], "rollout_id": "b", "call_index": 1}  # rewritten
    lone = {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, -100, -100], "rollout_id": None, "call_index": None}
    rows, folded = fold_rollout_calls([a1, b0, lone, a0, b1, dict(lone)])
    assert folded == 1
    assert [r["labels"] for r in rows] == [[-100, -100, 3, -100, -100, 6], b0["labels"], b1["labels"],
                                           lone["labels"], lone["labels"]]  # fmt: skip
    assert rows[0]["input_ids"] == a1["input_ids"]


def test_merged_rollout_calls_train_every_answer_in_its_own_context_on_fewer_tokens(tokenizer, tmp_path):
    """The folded row labels exactly the tokens the per-call rows label, and the model predicts each from the same
    tokens before it (same logprobs: same loss and gradient per token), while the rollout's prompt runs once."""
    answers = ["THOUGHT: list.\n```bash\nls\n```", "THOUGHT: fix.\n```bash\nsed -i s/+/*/ mathy.py\n```",
               "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"]  # fmt: skip
    rows = shell_calls("r-0", answers) + shell_calls("r-1", answers[:2], rewrite_at=1)
    path = write(tmp_path / "t.jsonl", *rows)
    model = tiny_llama(len(tokenizer), 4096).eval()
    datasets = {}
    for merge in (False, True):
        config = WarmStartSFTConfig(output_dir=str(tmp_path), merge_rollout_calls=merge, report_to="none")
        datasets[merge] = sft_trainer(load_sft_rows(path), model, tokenizer, config).train_dataset
    separate, merged = datasets[False], datasets[True]
    assert len(separate) == 5 and len(merged) == 3  # r-0's 3 calls fold into one row; r-1's rewrite stays apart
    assert "rollout_id" not in merged.column_names and "rollout_id" not in separate.column_names

    def trained(row) -> dict[int, tuple[int, float]]:
        """Each labelled position's token and the model's logprob of it."""
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        return {p: (t, float(logps[p - 1, t])) for p, t in enumerate(row["labels"]) if t != -100}

    per_call: dict[int, tuple[int, float]] = {}
    for row in list(separate)[:3]:
        per_call.update(trained(row))
    folded = trained(merged[0])
    assert folded.keys() == per_call.keys() and len(folded) > 3 * 10
    for position, (token, logp) in per_call.items():
        assert folded[position][0] == token and folded[position][1] == pytest.approx(logp, abs=1e-4)
    assert [r["input_ids"] for r in list(merged)[1:]] == [r["input_ids"] for r in list(separate)[3:]]
    assert sum(len(r["input_ids"]) for r in list(separate)[:3]) > 2 * len(merged[0]["input_ids"])
