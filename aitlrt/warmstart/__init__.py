"""Warm start: successful trajectories of the real agent (an oracle teacher of ours or any OpenAI-compatible teacher
endpoint, recorded through aitlrt-serve), and supervised fine-tuning on them (trl's ``SFTTrainer``) so that RL
starts where groups have reward variance."""
