"""``shared_prefix``: micro-batches of rows in token order forward their common prefix once, with trl's loss,
gradients and logged metrics unchanged (rows of two groups sharing their prompts, a second call's row among them, on
a tiny random model; and the bundled SmolLM2 on a real Aider prompt)."""

from __future__ import annotations

import random

import pytest
import torch

from aitlrt.common.shared_prefix import common_prefix_len, prefix_batches, shared_prefix_forward, use_shared_prefix
from aitlrt.training.rows import Row

ADVANTAGES = [1.0, -0.5, 0.25, -1.5, 0.75]


def grouped_rows() -> tuple[list[Row], list[int]]:
    """Two groups: three rows of a 30-token prompt (one of them a second call, whose prompt goes on after the first
    answer) and two of a 25-token prompt; completions of 3-9 tokens, some untrained."""
    rng = random.Random(1)
    rows, owners = [], []
    for length, count in [(30, 3), (25, 2)]:
        prompt = [rng.randrange(2, 2048) for _ in range(length)]
        for k in range(count):
            completion = [rng.randrange(2, 2048) for _ in range(rng.randint(3, 9))]
            mask = [int(rng.random() > 0.2) for _ in completion]
            extra = [rng.randrange(2, 2048) for _ in range(12)] if k == 2 else []
            rows.append(Row(prompt + extra, completion, mask, [-7.5 + 0.05 * rng.random() for _ in completion]))
            owners.append(len(owners) % len(ADVANTAGES))
    rows = [rows[i] for i in (3, 0, 4, 2, 1)]  # groups interleaved: the token order brings them together
    return rows, owners


def run(trainer, shared: bool, budget: int | None, layer_calls: list[int]) -> tuple[float, list[torch.Tensor], dict]:
    trainer.args.shared_prefix, trainer._shares_prefix = shared, None
    trainer.args.max_tokens_per_forward = budget
    trainer._metrics["train"].clear()
    batch = trainer.builder.build(*grouped_rows(), ADVANTAGES)[0]
    model = trainer.model
    model.zero_grad()
    layer_calls.clear()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return loss.item(), grads, {key: values[-1] for key, values in trainer._metrics["train"].items() if values}


@pytest.fixture
def layer_calls(trainer):
    """One entry per forward call of the first decoder layer, appended as the test runs."""
    calls: list[int] = []
    layer = trainer.model.model.layers[0]
    handle = layer.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[1]))
    yield calls
    handle.remove()


def test_common_prefix_len():
    assert common_prefix_len([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix_len([[1, 2], [3]]) == 0
    assert common_prefix_len([[7, 8]]) == 2
    assert common_prefix_len([]) == 0


def test_prefix_batches_put_rows_of_one_prompt_together_within_the_budget():
    a, b = list(range(100, 130)), list(range(200, 225))
    rows = [[*b, 1, 2, 3], [*a, 4, 5], [*a, 6, 7, 8], [*b, 9], [*a, 4, 9, 9, 9], list(range(300, 400))]
    groups = prefix_batches(rows, 45)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert [5] in groups  # 100 tokens: over the budget, alone
    assert [0, 3] in groups  # b's rows: 25 shared + 3 + 1
    for g in groups:
        shared = common_prefix_len([rows[i] for i in g])
        assert len(g) == 1 or shared + sum(len(rows[i]) - shared for i in g) <= 45
    assert [1, 2, 4] in prefix_batches(rows, 40)  # a's three rows: 30 + 2 + 3 + 4 distinct tokens
    assert prefix_batches(rows, None) == [list(range(6))]


def test_on_cpu_only_rows_of_one_prompt_share_a_micro_batch():
    system = list(range(500, 520))  # 20 tokens every row starts with (a system prompt), then each task's prompt
    a, b = [*system, *range(100, 140)], [*system, *range(200, 240)]
    rows = [[*a, 1, 2], [*a, 3, 4], [*b, 5], [*b, 6, 7]]
    assert prefix_batches(rows, 1000) == [[0, 1, 2, 3]]  # the budget alone: unrelated rows too
    assert sorted(prefix_batches(rows, 1000, 0.5)) == [[0, 1], [2, 3]]  # 60 of 62 tokens shared: one prompt's rows
    assert sorted(prefix_batches([rows[0], rows[2]], 1000, 0.5)) == [[0], [1]]  # 20 of 62: unrelated, alone


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])  # ratio in the loss forward / before
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_shared_prefix_gives_the_plain_loss_gradients_and_metrics(trainer, loss_type, mode, layer_calls, monkeypatch):
    trainer.loss_type = loss_type
    monkeypatch.setattr(trainer.args, "vllm_importance_sampling_mode", mode)
    plain = run(trainer, False, None, layer_calls)
    assert layer_calls[-1] > 30  # one padded pass over all rows
    shared = run(trainer, True, 80, layer_calls)  # one micro-batch per group (~70 and ~40 distinct tokens)
    calls = sorted(layer_calls)
    assert calls[-2:] == [25, 30] and len(calls) == 7  # each group's prompt forwarded once ...
    assert calls[-3] <= 21  # ... and each row's rest (a second call's: 12 + up to 9 tokens)
    assert plain[0] != 0.0
    assert shared[0] == pytest.approx(plain[0], rel=1e-5, abs=1e-7)
    assert len(plain[1]) == len(shared[1]) > 0
    for x, y in zip(plain[1], shared[1], strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)
    for key in ["entropy", "clip_ratio/region_mean", "logprob_gap/mean"]:
        if key in plain[2]:
            assert shared[2][key] == pytest.approx(plain[2][key], rel=1e-4, abs=1e-6), key


def test_under_gradient_checkpointing_a_shared_prefix_gives_the_plain_loss_and_gradients(trainer, layer_calls):
    trainer.model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
    try:
        plain = run(trainer, False, None, layer_calls)
        shared = run(trainer, True, 80, layer_calls)
        assert trainer._shares_prefix is True
        assert {25, 30} <= set(layer_calls)  # each group's prompt forwarded on its own (and recomputed)
        assert max(layer_calls) == 30  # no row whole
        assert shared[0] == pytest.approx(plain[0], rel=1e-5, abs=1e-7) and plain[0] != 0.0
        assert len(plain[1]) == len(shared[1]) > 0
        for x, y in zip(plain[1], shared[1], strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)
    finally:
        trainer.model.gradient_checkpointing_disable()
    assert not any("_can_checkpoint_with_cache" in vars(m) for m in trainer.model.modules())  # put back


def test_shared_prefix_is_off_under_reentrant_gradient_checkpointing(trainer, layer_calls, caplog):
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    try:
        with caplog.at_level("INFO", logger="aitlrt.common.shared_prefix"):
            run(trainer, True, 80, layer_calls)
        assert trainer._shares_prefix is False
        said = [r.getMessage() for r in caplog.records if "shared_prefix off" in r.getMessage()]
        assert len(said) == 1 and "reentrant" in said[0]  # once, however many forwards
        rows = grouped_rows()[0]
        assert set(layer_calls) == {len(r.prompt_ids) + len(r.completion_ids) for r in rows}  # no prefix alone:
        # on CPU every row has its own pass without a shared prefix (CPU_MIN_SHARED)
    finally:
        trainer.model.gradient_checkpointing_disable()


def test_the_bundled_model_gives_the_same_hidden_states_on_a_real_prompt(model_dir):
    """SmolLM2 (fp32) on two answers to one Aider-sized prompt, left-padded beside a shorter unrelated row: the same
    last hidden states where trl scores, and the same gradients."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tok("def add(a, b):\n    return a - b\n" * 20)["input_ids"]
    answers = [tok(text)["input_ids"] for text in ("<<<<<<< SEARCH\n    return a - b", "fix: a + b", "x")]
    rows = [prompt + answers[0], prompt + answers[1], prompt[:40] + answers[2]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def hidden_and_grads(batch_ids: torch.Tensor, batch_mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        out = model.model(input_ids=batch_ids, attention_mask=batch_mask, use_cache=False).last_hidden_state
        (out[:, -12:] * batch_mask[:, -12:, None]).square().sum().backward()
        return out[:, -12:].detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = hidden_and_grads(ids[:2], mask[:2])
    with shared_prefix_forward(model):
        shared = hidden_and_grads(ids[:2], mask[:2])
        unrelated = hidden_and_grads(ids, mask)  # a short common prefix (40 tokens) with the third row
    assert model.model.forward.__func__ is type(model.model).forward  # the patch is gone
    torch.testing.assert_close(shared[0], plain[0], rtol=1e-4, atol=1e-4)
    difference = sum((x - y).square().sum() for x, y in zip(plain[1], shared[1], strict=True)) ** 0.5
    assert difference / sum(x.square().sum() for x in plain[1]) ** 0.5 < 1e-5  # fp32 summation order only
    torch.testing.assert_close(unrelated[0][:2], plain[0], rtol=1e-4, atol=1e-4)


def test_use_shared_prefix_says_why_it_is_off_only_when_asked(trainer, caplog):
    model = trainer.accelerator.unwrap_model(trainer.model)
    with caplog.at_level("INFO", logger="aitlrt.common.shared_prefix"):
        assert use_shared_prefix(True, model) is True
        assert use_shared_prefix(False, model, "ZeRO-3/FSDP shard the weights") is False
        assert use_shared_prefix(True, model, "ZeRO-3/FSDP shard the weights") is False
        assert use_shared_prefix(True, torch.nn.Linear(2, 2)) is False
    assert [r.getMessage() for r in caplog.records] == [
        "shared_prefix off: ZeRO-3/FSDP shard the weights",
        "shared_prefix off: the model exposes no separate backbone (base_model)",
    ]
