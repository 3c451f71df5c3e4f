"""The trainer side of serving: start ``aitlrt-serve`` + vLLM as a child process (``managed_server``), and the
demo's look at what the proxy records (``demo``)."""
