"""Row building on crafted traces: prefix-extending chains, a history rewrite, truncation, skipped calls."""

from __future__ import annotations

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


def test_truncation_keeps_the_mask_aligned_and_drops_rows_without_room():
    long = call(0, [1, 2, 3], [10, 11, 12, 13])
    chained = call(1, [1, 2, 3, 10, 11, 12, 13, 4, 4, 4], [14, 15])
    (row,), stats = build_rows([long, chained], max_length=9)
    assert row.tokens == [1, 2, 3, 10, 11, 12, 13, 4, 4]
    assert row.mask == [1, 1, 1, 1, 0, 0] and len(row.logprobs) == 6
    assert (stats.truncated_rows, stats.truncated_tokens) == (1, 3)
    rows, stats = build_rows([call(0, list(range(20)), [1])], max_length=10)
    assert rows == [] and stats.dropped_rows == 1


def test_an_empty_rollout_has_no_rows():
    rows, stats = build_rows([])
    assert rows == [] and stats.calls == 0
    rows, stats = build_rows([call(0, [1], [], status=500)])
    assert rows == [] and stats.skipped_failed == 1


def test_weight_versions_are_collected_per_row():
    (row,), _ = build_rows([call(0, [1], [2], version=3), call(1, [1, 2], [4], version=3)])
    assert row.weight_versions == {3}
