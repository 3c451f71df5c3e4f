"""Training: the config, the trainer's generation step, rows from traces, advantages, and weight sync."""
