"""What the end-to-end GRPO tests share: the trainer as users run it, recording each step, and a reward that never
ties within a pair."""

from __future__ import annotations

import torch

from aitlrt.training.trainer import AgentGRPOTrainer


def first_of_pair(prompts, completions, completion_ids=None, **kwargs):
    """A reward of our own, composed with the built-ins: 1 for the first rollout of each pair, 0 for the second.

    SmolLM2 rarely edits anything (or writes a well-formed action) within the tests' token caps, so the built-ins
    and anything measured on the completions can tie within a group (no gradient): this one never ties, so every
    step really updates the policy."""
    return [float(i % 2 == 0) for i in range(len(prompts))]


class Recording(AgentGRPOTrainer):
    """The trainer as users run it, keeping each step's rollouts and batch for the tests' checks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes, self.batches = [], []
        plain = self.collector.rollouts

        def rollouts(inputs, step=None):
            outcomes = plain(inputs, step)
            self.outcomes.append(outcomes)
            return outcomes

        self.collector.rollouts = rollouts

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        self.batches.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()})
        return batch
