"""Rewards: what a rollout earned. ``terms`` holds the built-in reward terms as pure functions (strings and grades
in, a value in [0, 1] or NaN out); ``runtime`` the I/O they need (grades, the apply check, the files at the start,
the similarity pool), each bounded by a timeout; ``builtin`` the reward functions with trl's signature, by the names
the recipe's ``reward_funcs`` use; ``inputs`` is the one place a rollout's results become their keyword
arguments."""
