"""Row building on crafted traces: prefix-extending chains, a history rewrite, long rows as windows, skipped calls."""

from __future__ import annotations

import pytest

from aitlrt.training.rows import build_rows


def call(i, prompt, completion, *, tag=None, status=200, version=0):
    return {
        "call_index": i,
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "logprobs": [-0.1 * (k + 1) for k in range(len(completion))],
        "tag": tag,
        "status": status,
        "weight_version": version,
    }


def test_a_prefix_extending_chain_is_one_row_with_context_masked():
    first = call(0, [1, 2, 3], [10, 11])
    second = call(1, [1, 2, 3, 10, 11, 4, 5], [12])  # tool output 4, 5 arrived between the calls
    third = call(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14])
    (row,), stats = build_rows([third, first, second])  # order by call index, not by arrival
    assert row.prompt_ids == [1, 2, 3]
    assert row.completion_ids == [10, 11, 4, 5, 12, 6, 13, 14]
    assert row.mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert row.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.1, 0.0, -0.1, -0.2]
    assert row.calls == 3 and row.sampled == 5 and stats.new_rows == 1


def test_a_history_rewrite_starts_a_new_row():
    first = call(0, [1, 2, 3], [10, 11])
    summary = call(1, [1, 99, 3, 7], [20])  # the history was summarised: no longer a prefix
    after = call(2, [1, 99, 3, 7, 20, 8], [21])
    rows, stats = build_rows([first, summary, after])
    assert [r.prompt_ids for r in rows] == [[1, 2, 3], [1, 99, 3, 7]]
    assert rows[1].completion_ids == [20, 8, 21] and rows[1].mask == [1, 0, 1]
    assert stats.new_rows == 2


def test_a_re_rendered_answer_that_differs_from_the_sampled_tokens_forks():
    first = call(0, [1, 2], [10, 11, 2])
    # The template re-tokenised the answer as [10, 12] instead of the sampled [10, 11, 2].
    second = call(1, [1, 2, 10, 12, 5], [30])
    rows, _ = build_rows([first, second])
    assert len(rows) == 2 and rows[1].prompt_ids == [1, 2, 10, 12, 5]


def test_tagged_and_failed_calls_are_skipped_and_do_not_break_the_chain():
    main0 = call(0, [1, 2], [10])
    weak = call(1, [50, 51], [60], tag="weak")
    failed = call(2, [1, 2, 10, 3], [], status=502)
    main1 = call(3, [1, 2, 10, 3], [11])
    (row,), stats = build_rows([main0, weak, failed, main1])
    assert row.completion_ids == [10, 3, 11] and row.mask == [1, 0, 1]
    assert (stats.skipped_tagged, stats.skipped_failed, stats.used_calls) == (1, 1, 2)
    rows, _ = build_rows([main0, weak, failed, main1], include_tagged=True)
    assert [r.prompt_ids for r in rows] == [[1, 2], [50, 51], [1, 2, 10, 3]]


def long_trace(prompt_len=5, turns=((6, 4), (3, 7), (8, 2), (2, 5), (9, 0)), version=0):
    """One chain of calls over unique token ids: (sampled, then context) per turn; and its full sequence."""
    ids = iter(range(100, 10_000))
    full = [next(ids) for _ in range(prompt_len)]
    calls = []
    for i, (sampled, context) in enumerate(turns):
        completion = [next(ids) for _ in range(sampled)]
        calls.append(call(i, list(full), completion, version=version + i))
        full += completion + [next(ids) for _ in range(context)]
    return calls, full


def check_windows(rows, calls, full, max_length, context):
    """Every sampled token trained exactly once, with its own logprob, after the true preceding tokens."""
    expected = {t: lp for c in calls for t, lp in zip(c["completion_token_ids"], c["logprobs"], strict=True)}
    trained = [(t, lp) for r in rows for t, m, lp in zip(r.completion_ids, r.mask, r.logprobs, strict=True) if m]
    assert [t for t, _ in trained] == [t for c in calls for t in c["completion_token_ids"]]
    assert dict(trained) == expected
    for r in rows:
        assert len(r.tokens) <= max_length and r.prompt_ids and r.mask[0] == r.mask[-1] == 1
        assert len(r.mask) == len(r.logprobs) == len(r.completion_ids)
        assert all(lp == 0.0 for m, lp in zip(r.mask, r.logprobs, strict=True) if not m)
        start = full.index(r.completion_ids[0])
        assert full[start - len(r.prompt_ids) : start + len(r.completion_ids)] == r.tokens  # the true sequence
        assert len(r.prompt_ids) >= min(context, start)
        versions = {c["weight_version"] for c in calls if set(c["completion_token_ids"]) & set(r.completion_ids)}
        assert r.weight_versions == versions and r.calls == len(versions)


def test_a_long_row_becomes_windows_that_train_every_sampled_token_once():
    calls, full = long_trace()
    (whole,), _ = build_rows(calls)
    assert whole.tokens == full[: len(whole.tokens)]
    for max_length, context in ((12, 4), (12, 6), (10, 1), (16, None), (40, 20), (len(whole.tokens), None)):
        rows, stats = build_rows(calls, max_length=max_length, context=context)
        check_windows(rows, calls, full, max_length, context or max_length // 2)
        assert stats.new_rows == 1 and stats.used_calls == len(calls)
        split = len(whole.tokens) > max_length
        assert (stats.split_rows, stats.windows) == ((1, len(rows)) if split else (0, 0)) and (len(rows) > 1) == split
    rows, _ = build_rows(calls, max_length=12, context=4)
    assert rows[0].prompt_ids == full[:5] and len(rows[1].tokens) == 12  # later windows fill up with context


def test_a_prompt_longer_than_the_budget_is_trained_after_its_tail():
    calls, full = long_trace(prompt_len=30, turns=((6, 3), (4, 0)))
    rows, stats = build_rows(calls, max_length=12, context=5)
    check_windows(rows, calls, full, 12, 5)
    assert rows[0].prompt_ids == full[30 - 6 : 30] and stats.split_rows == 1
    assert stats.used_calls == 2 and stats.skipped_failed == 0


def test_windows_skip_failed_calls_and_keep_the_chain():
    calls, full = long_trace()
    failed = call(10, calls[2]["prompt_token_ids"], [], status=502)
    calls[2]["call_index"], calls[3]["call_index"], calls[4]["call_index"] = 11, 12, 13
    rows, stats = build_rows([*calls, failed], max_length=12, context=4)
    check_windows(rows, calls, full, 12, 4)
    assert stats.skipped_failed == 1


def test_a_context_budget_that_leaves_no_room_is_refused():
    calls, _ = long_trace()
    for max_length, context in ((10, 10), (10, 0), (1, None)):
        with pytest.raises(ValueError, match="context"):
            build_rows(calls, max_length=max_length, context=context)


def test_an_empty_rollout_has_no_rows():
    rows, stats = build_rows([])
    assert rows == [] and stats.calls == 0
    rows, stats = build_rows([call(0, [1], [], status=500)])
    assert rows == [] and stats.skipped_failed == 1


def test_weight_versions_are_collected_per_row():
    (row,), _ = build_rows([call(0, [1], [2], version=3), call(1, [1, 2], [4], version=3)])
    assert row.weight_versions == {3}
