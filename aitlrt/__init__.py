"""AITLRT: the Agent-In-The-Loop Reinforcement Trainer."""
