"""The weight probe's comparison (a tiny CPU trainer against made-up server logprobs) and the sampling check."""

from __future__ import annotations

import pytest
import torch

from aitlrt.training import probe
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.probe import (
    SamplingMismatchError,
    WeightProbe,
    WeightProbeError,
    check_sampling,
    policy_logprobs,
    probe_gap,
)
from tests.helpers.multirank_run import tiny_trainer

IDS = [5, 17, 3, 99, 42, 7, 1000, 12]
ONE_RANK = {"per_device_train_batch_size": 4}  # a whole group of num_generations=4 on the one rank


def test_probe_gap_is_the_mean_and_the_largest_absolute_difference():
    gap = probe_gap([-1.0, -2.0, -3.0, -4.0], [-1.1, -2.0, -2.5, -4.2])
    assert gap.mean == pytest.approx(0.2) and gap.max == pytest.approx(0.5) and gap.worst == 2


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return tiny_trainer("http://127.0.0.1:9", ".", str(tmp_path_factory.mktemp("run")), **ONE_RANK)


def served(monkeypatch, logprobs, version=3):
    monkeypatch.setattr(probe, "server_logprobs", lambda url, ids: (version, logprobs))


def test_a_server_within_tolerance_passes_and_one_beyond_fails_naming_both_sides(trainer, monkeypatch):
    mine = policy_logprobs(trainer, IDS)
    assert len(mine) == len(IDS) - 1 and all(lp < 0 for lp in mine)
    check = WeightProbe("http://proxy", IDS, tolerance=0.15)

    served(monkeypatch, [lp + 0.1 * (-1) ** i for i, lp in enumerate(mine)])  # noise of 0.1 nats/token
    gap = check.check(trainer, 3)
    assert gap.mean == pytest.approx(0.1, abs=1e-4) and gap.max == pytest.approx(0.1, abs=1e-4)

    shifted = list(mine)
    shifted[4] -= 2.0  # one token far off: mean 2/7 = 0.29 nats/token
    served(monkeypatch, shifted, version=4)
    with pytest.raises(WeightProbeError) as err:
        check.check(trainer, 3)
    message = str(err.value)
    for part in (
        "does not serve the trainer's policy",
        "server (vLLM via http://proxy, weight version 4",
        "expects weight version 3",
        "differ by 0.286 nats/token on average and 2.000 at most (token 5:",
        "weight_probe_tolerance=0.15 (mean)",
        "another run's weights",
        "weight_probe=False",
    ):
        assert part in message, (part, message)


def test_a_sync_that_did_nothing_fails_though_the_policy_moved_less_than_the_tolerance(trainer, monkeypatch):
    """The server must be closer to the policy now than to the one it was verified to serve before the update."""
    check = WeightProbe("http://proxy", IDS, tolerance=0.5)
    before = policy_logprobs(trainer, IDS)
    served(monkeypatch, [lp + 0.02 for lp in before], version=1)
    check.check(trainer, 1)  # at connect: the server serves the policy

    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    try:
        with torch.no_grad():  # an update that moves the probe's logprobs by ~0.2 nats/token, below the tolerance
            trainer.model.lm_head.weight.mul_(2.5)
        after = policy_logprobs(trainer, IDS)
        shift = probe_gap(after, before).mean
        assert 0.15 < shift < 0.5, shift

        served(monkeypatch, [lp + 0.02 for lp in before], version=2)  # the sync reported version 2, changed nothing
        with pytest.raises(WeightProbeError) as err:
            check.check(trainer, 2)
        message = str(err.value)
        for part in ("the weight sync did not reach the server", "0.020 nats/token from the policy it was verified",
                     f"which moved {shift:.3f} since", "weight_probe_tolerance=0.5"):  # fmt: skip
            assert part in message, (part, message)

        served(monkeypatch, [lp - 0.03 for lp in after], version=2)  # a sync that arrived passes
        assert check.check(trainer, 2).mean == pytest.approx(0.03, abs=1e-4)
    finally:
        trainer.model.load_state_dict(saved)


def test_a_move_within_the_serving_noise_is_not_judged_relative_to_the_old_policy(trainer, monkeypatch):
    check = WeightProbe("http://proxy", IDS, tolerance=0.5)
    mine = policy_logprobs(trainer, IDS)
    served(monkeypatch, [lp + 0.05 for lp in mine])
    check.check(trainer, 1)
    served(monkeypatch, [lp + 0.05 for lp in mine])  # nothing moved: the server is as close to both
    check.check(trainer, 2)


def test_a_probe_the_server_cannot_answer_fails_the_step(trainer, monkeypatch):
    def refused(url, ids):
        raise OSError("connection refused")

    monkeypatch.setattr(probe, "server_logprobs", refused)
    with pytest.raises(WeightProbeError, match="could not score the probe on the server at http://p: connection"):
        WeightProbe("http://p", IDS, 0.15).check(trainer, 0)


def test_the_policy_is_scored_in_eval_mode_and_left_as_it_was(trainer):
    trainer.model.train()
    assert policy_logprobs(trainer, IDS) == policy_logprobs(trainer, IDS)
    assert trainer.model.training


def test_a_probe_text_of_one_token_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match=r"into 1 token\(s\).*weight_probe=False"):
        tiny_trainer("http://127.0.0.1:9", ".", str(tmp_path), weight_probe=True, **ONE_RANK)


def config(tmp_path, **kw) -> AgentGRPOConfig:
    return AgentGRPOConfig(output_dir=str(tmp_path), proxy_url="http://x", report_to=[], **kw)


def test_the_same_sampling_passes_whatever_spelling_top_k_and_max_tokens_take(tmp_path):
    forced = {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "max_tokens": 48}
    check_sampling(config(tmp_path, temperature=0.7, top_p=0.95, top_k=0, max_completion_length=48), forced, "u")
    no_cap = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    check_sampling(config(tmp_path, max_completion_length=None), no_cap, "u")


def test_a_sampling_mismatch_names_both_values_and_both_fixes(tmp_path):
    forced = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    with pytest.raises(SamplingMismatchError) as err:
        check_sampling(config(tmp_path, temperature=0.7, max_completion_length=256), forced, "http://serve")
    message = str(err.value)
    for part in (
        "aitlrt-serve at http://serve does not sample as the trainer's config says",
        "it forces temperature=1.0 where the config has temperature=0.7",
        "it forces top_p=0.95 where the config has top_p=1.0",
        "it forces top_k=20 where the config has top_k=0",
        "it forces no max_tokens (the agent's own) where the config has max_completion_length=256",
        "Restart aitlrt-serve with --temperature 0.7 --top-p 1.0 --top-k -1 --max-tokens 256",
        "or set temperature: 1.0, top_p: 0.95, top_k: 20, max_completion_length: null in the training config",
    ):
        assert part in message, (part, message)
    with pytest.raises(SamplingMismatchError, match=r"forces max_tokens=48 .* \(and no --max-tokens\)"):
        check_sampling(config(tmp_path, max_completion_length=None), {**forced, "top_p": 1.0, "max_tokens": 48}, "u")
