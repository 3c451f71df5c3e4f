"""What a person reads: the console step table of a training run and the static HTML report of rollouts."""
