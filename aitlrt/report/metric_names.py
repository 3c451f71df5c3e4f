"""The names of the numbers a run logs, in one place: the trainer logs a step's metrics under them (trl's
``report_to``, ``OUTPUT/metrics.jsonl``), the step table, the run report and the benches read them; an evaluation's
summary (``aitlrt.evaluation.scoring.summarise``) is keyed by the ``SUMMARY_*`` ones."""

from __future__ import annotations

import re

# ---- a training step: rewards ----------------------------------------------------------------------------------
REWARD = "reward"
"""The weighted reward's mean over the step's scorable rollouts."""
REWARD_STD = "reward_std"
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"
"""Share of rollouts whose group had no reward variance."""
ZERO_VARIANCE_GROUPS = "zero_variance_groups"
REWARD_STATS = ("mean", "median", "std")
REWARD_MEAN_PATTERN = re.compile(r"^rewards/(.+)/mean$")
"""Matches ``reward_stat(name, "mean")``; group 1 is the reward's name."""


def reward_stat(name: str, stat: str) -> str:
    """Reward function ``name``'s ``stat`` (``REWARD_STATS``) over the step's rollouts."""
    return f"rewards/{name}/{stat}"


RESOLVE_RATE = reward_stat("tests_pass", "mean")
SIMILARITY = reward_stat("patch_similarity", "mean")


# ---- rollouts ------------------------------------------------------------------------------------------------
def rollout_share(status: str) -> str:
    """Share of the step's rollouts that ended with ``status`` (``aitlrt.rollout.status.Status``)."""
    return f"rollouts/{status}"


ROLLOUTS_OK = rollout_share("ok")
ROLLOUTS_UNSCORABLE = "rollouts/unscorable"
"""How many rollouts could not be scored (a count, not a share)."""
CALLS_MEAN = "rollouts/calls_mean"
COMPLETION_TOKENS_MEAN = "rollouts/completion_tokens_mean"
EDIT_RATE = "rollouts/non_empty_patch_rate"


# ---- rows ----------------------------------------------------------------------------------------------------
def rows(name: str) -> str:
    """A count of the step's rows: ``count``, ``split``, ``windows``, ``skipped_{failed,tagged,unscorable}_calls``."""
    return f"rows/{name}"


ROWS = rows("count")
ROWS_SPLIT = rows("split")
ROWS_PER_ROLLOUT = rows("per_rollout")

# ---- sampling ------------------------------------------------------------------------------------------------
GROUPS = "sampling/groups"
INFORMATIVE_GROUPS = "sampling/informative_groups"
ROUNDS = "sampling/rounds"
SKIPPED_UPDATE = "sampling/skipped_update"
"""1 when no group of the step had reward variance and the update was skipped; logged at every training step."""
IS_RATIO_MIN = "sampling/importance_sampling_ratio/min"
IS_RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
IS_RATIO_MAX = "sampling/importance_sampling_ratio/max"


def staleness(lag: int | str) -> str:
    """Share of the step's rows sampled ``lag`` weight versions ago (``max``: the largest lag)."""
    return f"staleness/{lag}"


STALENESS_MAX = staleness("max")

# ---- the weights ---------------------------------------------------------------------------------------------
WEIGHT_VERSION = "weight_version"
LOGPROB_GAP_MEAN = "logprob_gap/mean"
"""Mean |trainer - sampler logprob| over the trained tokens."""
LOGPROB_GAP_MAX = "logprob_gap/max"
WEIGHT_PROBE_MEAN_GAP = "weight_probe/mean_gap"
WEIGHT_PROBE_MAX_GAP = "weight_probe/max_gap"
LOSS = "loss"
"""trl's."""
GRAD_NORM = "grad_norm"
"""transformers'; 0 for a skipped update."""


# ---- time ----------------------------------------------------------------------------------------------------
def seconds(part: str) -> str:
    """The step's seconds in ``part`` (``rollouts``, ``rewards``, ``rows``, ``update``, ``sync``, ``step``, and
    ``aitlrt.rollout.timing.time_split``'s keys without ``_s``)."""
    return f"time/{part}_s"


TIME_ROLLOUTS = seconds("rollouts")
TIME_REWARDS = seconds("rewards")
TIME_ROWS = seconds("rows")
TIME_UPDATE = seconds("update")
TIME_SYNC = seconds("sync")
TIME_STEP = seconds("step")
TIME_MODEL_BUSY = seconds("model_busy")
TIME_AGENT_OUTSIDE_CALLS = seconds("agent_outside_calls")
STAGES = (TIME_ROLLOUTS, TIME_REWARDS, TIME_ROWS, TIME_UPDATE, TIME_SYNC)
"""The parts of a step's wall time, in order."""

# ---- memory --------------------------------------------------------------------------------------------------
MEMORY_PEAK = "memory/peak_gib"
"""The trainer process's peak memory in the optimizer step, GiB (``aitlrt.common.memory``: the CUDA allocator's
reserved memory on a GPU, the process's resident memory on CPU); its rollouts' agents and the server not counted."""

# ---- the log file --------------------------------------------------------------------------------------------
STEP = "step"
"""The global step of a ``metrics.jsonl`` entry."""
ELAPSED = "elapsed_s"
"""Seconds since the training started when the entry was logged."""
NUM_TOKENS = "num_tokens"
"""trl's running count of the tokens trained through the model."""

# ---- an evaluation's summary (``aitlrt.evaluation.scoring.summarise``) ----------------------------------------------
SUMMARY_RESOLVE_RATE = "resolve_rate"
SUMMARY_RESOLVE_SE = "resolve_se"
SUMMARY_PASS_AT_1 = "pass@1"
SUMMARY_PASS_AT_K = "pass@k"
SUMMARY_K = "k"
SUMMARY_EDIT_RATE = "edit_rate"
SUMMARY_P2P_KEPT_EDITS = "p2p_kept_edits"
SUMMARY_LOCALISATION = "localisation"
SUMMARY_REWARD = "reward"
SUMMARY_REWARD_SE = "reward_se"
SUMMARY_TRAINING_REWARD = "training_reward"
SUMMARY_CALLS = "calls"
SUMMARY_COMPLETION_TOKENS = "completion_tokens"
SUMMARY_STATUS_OK = "status_ok"
