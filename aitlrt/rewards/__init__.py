"""Rewards: what a rollout earned. ``builtin`` holds the reward functions (trl's signature, each in [0, 1]);
``inputs`` is the one place a rollout's results become the reward functions' keyword arguments."""
