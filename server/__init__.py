"""aitlrt-serve: the recording OpenAI-compatible proxy between coding agents and vLLM."""
