"""The routers of ``aitlrt-serve``; their shared dependencies (the Proxy, the API key, rollout ids) are in ``deps``."""
