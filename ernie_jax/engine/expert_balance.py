"""Runtime expert load balancing (EPLB): its configuration (vLLM's `--eplb-config` keys), the window of
measured expert loads, when to re-place, and what the balancedness gauge reports.

With `{"num_redundant_experts": R, "window_size": W, "step_interval": S, "log_balancedness": bool}` every
MoE layer's E experts live in E + R physical slots over the expert-parallel devices (sharding/eplb.py
places them; the programs route each assignment to one replica through a map that is an input array, so a
new placement never recompiles). Each instance step adds its tokens per expert to the window (the last W
steps); every S steps, and on `POST /v1/admin/rebalance_experts`, a placement is computed from the window
and each instance copies its expert weights into the new slots device to device at its next step boundary
(ModelPrograms.place_experts), between two steps: requests keep streaming and nothing is recomputed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

import numpy as np

from ernie_jax.engine.json_config import json_object
from ernie_jax.sharding import eplb

log = logging.getLogger("ernie_jax.engine")


class EPLBConfigError(ValueError):
    """A malformed EPLB config; the message names the field."""


@dataclasses.dataclass(frozen=True)
class EPLBConfig:
    num_redundant_experts: int = 0
    window_size: int = 1000  # steps of measured load a placement is computed from
    step_interval: int = 3000  # steps between re-placements (0: only when asked)
    log_balancedness: bool = False

    @classmethod
    def parse(cls, value: Any) -> "EPLBConfig | None":
        """None, a dict, a JSON string (the CLI flag) or an EPLBConfig -> a config (None: off)."""
        if value is None or isinstance(value, EPLBConfig):
            return value
        value = json_object(value, "eplb_config", [f.name for f in dataclasses.fields(cls)], EPLBConfigError)
        for name in ("num_redundant_experts", "window_size", "step_interval"):
            v = value.get(name, getattr(cls, name))
            low = 1 if name == "window_size" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise EPLBConfigError(f"eplb_config.{name}={v!r}: expected an integer >= {low}")
        if not isinstance(value.get("log_balancedness", False), bool):
            raise EPLBConfigError(f"eplb_config.log_balancedness={value['log_balancedness']!r}: expected true/false")
        return cls(**value)


class ExpertBalancer:
    """One engine's EPLB state: the placement in force, the load window, and pending re-placements."""

    def __init__(self, config: EPLBConfig, num_layers: int, num_experts: int, num_devices: int, num_nodes: int = 1):
        """num_nodes: hosts the expert-parallel devices span (eplb.node_count): replicas stay on their node."""
        self.config, self.num_devices, self.num_nodes = config, num_devices, num_nodes
        # The first placement knows no loads: every expert equally hot, R replicas spread over the devices.
        self.placement = self._plan(np.ones((num_layers, num_experts)))
        self.window: collections.deque[np.ndarray] = collections.deque(maxlen=config.window_size)
        self.steps = 0
        self.rebalances = 0
        self.balancedness_before = self.balancedness_after = np.ones(num_layers)
        self._lock = threading.Lock()
        self._pending: dict[str, eplb.Placement] = {}  # instance name -> placement it has not applied yet

    def observe(self, counts: np.ndarray) -> bool:
        """One instance step's tokens per expert [L, E]; True when step_interval says re-place now."""
        with self._lock:
            self.window.append(np.asarray(counts, np.float64))
            self.steps += 1
            interval = self.config.step_interval
            return bool(interval) and self.steps % interval == 0

    def window_load(self) -> np.ndarray:
        with self._lock:
            return sum(self.window) if self.window else np.zeros_like(self.placement.replicas, np.float64)

    def rebalance(self, instances: list[str]) -> dict[str, Any]:
        """A placement from the window's loads, queued for every instance; returns the balancedness of the
        window's loads under the placement in force and under the new one."""
        load = self.window_load()
        if not load.any():
            return {"rebalanced": False, "reason": "no expert load measured yet"}
        new = self._plan(load)
        before = eplb.balancedness(self.placement.device_load(load))
        after = eplb.balancedness(new.device_load(load))
        with self._lock:
            self.placement, self.rebalances = new, self.rebalances + 1
            self.balancedness_before, self.balancedness_after = before, after
            self._pending = {name: new for name in instances}
        if self.config.log_balancedness:
            log.info("EPLB re-placement %d from %d steps: balancedness %.3f -> %.3f (mean over %d MoE layers)",
                     self.rebalances, len(self.window), before.mean(), after.mean(), len(before))
        return {"rebalanced": True, "window_steps": len(self.window),
                "balancedness_before": [round(float(b), 4) for b in before],
                "balancedness_after": [round(float(b), 4) for b in after]}

    def _plan(self, load: np.ndarray) -> eplb.Placement:
        return eplb.plan(load, self.config.num_redundant_experts, self.num_devices, self.num_nodes)

    def take_pending(self, instance: str) -> eplb.Placement | None:
        with self._lock:
            return self._pending.pop(instance, None)

    def current_balancedness(self) -> np.ndarray:
        """Per MoE layer: the window's load under the placement in force (1.0 before any load)."""
        load = self.window_load()
        return eplb.balancedness(self.placement.device_load(load)) if load.any() else np.ones(len(load))

    def report(self) -> dict[str, Any]:
        return {"num_redundant_experts": self.config.num_redundant_experts, "rebalances": self.rebalances,
                "balancedness": [round(float(b), 4) for b in self.current_balancedness()],
                "balancedness_before_last": [round(float(b), 4) for b in self.balancedness_before],
                "balancedness_after_last": [round(float(b), 4) for b in self.balancedness_after]}
