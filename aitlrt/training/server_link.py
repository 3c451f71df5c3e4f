"""The trainer's link to ``aitlrt-serve``: at the first generation check that the server forces the config's
sampling and vLLM adds none of its own (``probe.check_server_sampling``) and learn the weight version and the served
model; push the policy after an update (``weight_sync``) and check with the weight probe that the server now serves
it (``probe``)."""

from __future__ import annotations

import time
from typing import Any

from aitlrt.report import metric_names as m
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.probe import check_server_sampling, make_weight_probe
from aitlrt.training.weight_sync import make_weight_sync, proxy_request


class ServerLink:
    """The weight version the server serves, the served model, and whether the policy changed since the last sync
    (``trainer``: the ``AgentGRPOTrainer`` whose policy is synced; every rank holds one and calls alike)."""

    def __init__(self, trainer: Any, args: AgentGRPOConfig, tokenizer: Any) -> None:
        if not args.proxy_url:
            raise ValueError("AgentGRPOConfig.proxy_url is required (the aitlrt-serve URL)")
        self.trainer = trainer
        self.args = args
        self.proxy_url = args.proxy_url.rstrip("/")
        self.weight_sync = make_weight_sync(args)
        self.weight_probe = make_weight_probe(args, tokenizer)  # None: weight_probe=False
        self.weight_version = -1
        self.served_model = ""  # asked of the proxy at the first generation
        self.synced_step = trainer.state.global_step  # the server starts with the initial weights
        self.weights_changed = False  # an update ran since the last sync
        self.updates = 0  # optimizer steps that changed the policy
        self._served_updates = 0  # ... when the server last got it

    def connect(self) -> None:
        """At the first generation: check that the server forces the config's sampling and, unless a sync comes
        first, serves the policy; learn the weight version and the served model."""
        if self.served_model:
            return
        check_server_sampling(self.args, self.proxy_url)
        self.weight_version = proxy_request(self.proxy_url, "GET", "/weights").json()["weight_version"]
        if self.trainer.state.global_step == self.synced_step:  # else the sync before this generation probes
            self.probe()
        self.served_model = proxy_request(self.proxy_url, "GET", "/v1/models").json()["data"][0]["id"]

    def needs_sync(self) -> bool:
        """An update ran since the last sync, at an earlier step."""
        return self.trainer.state.global_step != self.synced_step and self.weights_changed

    def sync(self) -> float:
        """Push the current policy to the server (every rank calls), learn the new weight version and check that the
        server now serves the policy (the weight probe); the seconds it took."""
        started = time.monotonic()
        version = self.weight_sync.sync(self.trainer)
        if version is not None:
            self.weight_version = version
            self._served_updates = self.updates
            self.probe()
        self.synced_step = self.trainer.state.global_step
        self.weights_changed = False
        return time.monotonic() - started

    @property
    def unsynced_updates(self) -> int:
        """Updates the server's weights lack beyond what its weight version says: all of them under
        ``weight_sync: none``, whose server keeps the initial weights (rows' staleness)."""
        return self.updates - self._served_updates

    def probe(self) -> None:
        """Fail unless the server scores the probe as the policy does (``aitlrt.training.probe``; every rank calls);
        log the gap."""
        if self.weight_probe is None:
            return
        gap = self.weight_probe.check(self.trainer, self.weight_version)
        metrics = self.trainer._metrics[self.trainer.mode]
        metrics[m.WEIGHT_PROBE_MEAN_GAP].append(gap.mean)
        metrics[m.WEIGHT_PROBE_MAX_GAP].append(gap.max)
