"""Expert-parallel load balancing (EPLB) placement: which experts get redundant replicas, and which
expert-parallel device holds each replica, from measured per-expert loads (pure numpy), and the weights laid
out in those slots with the map the programs route by (`expert_leaves`, `slot_map`, `checkpoint_leaves`).

Per MoE layer, E logical experts fill E + R physical slots, (E + R) / D on each of the D expert-parallel
devices (slot s lives on device s // ((E + R) / D)). A token routed to an expert with r replicas goes to one
of them, so each replica carries load / r. The plan starts from DeepSeek's EPLB:
1. `replicate`: each redundant slot goes, one at a time, to the expert with the highest load per replica;
2. `pack`: replicas, heaviest first, go to the least-loaded device that still has a free slot, then
   pairs swap between the heaviest device and another while that lowers it;
then improves on it: while moving one replica from one expert to another lowers the packed maximum device
load, it does so (replicating by load alone ignores that a device has only (E + R) / D slots). When the
expert-parallel devices span hosts, `plan(..., num_nodes)` is DeepSeek's hierarchical form: experts are
balanced over the nodes first, then replicated and packed within each node.

Glossary: L MoE layers, E logical experts, R redundant slots, D expert-parallel devices, S = E + R slots.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Placement:
    slot_expert: np.ndarray  # [L, S] the logical expert in each physical slot
    replicas: np.ndarray  # [L, E] how many slots each expert has (>= 1)
    num_devices: int

    @property
    def slots_per_device(self) -> int:
        return self.slot_expert.shape[1] // self.num_devices

    def device_load(self, load: np.ndarray) -> np.ndarray:
        """[L, D]: each device's share of `load` [L, E], every expert's load split evenly over its replicas."""
        load = np.asarray(load, np.float64)
        per_replica = load / self.replicas  # [L, E]
        slot_load = np.take_along_axis(per_replica, self.slot_expert, axis=1)  # [L, S]
        return slot_load.reshape(slot_load.shape[0], self.num_devices, self.slots_per_device).sum(-1)


def balancedness(device_load: np.ndarray) -> np.ndarray:
    """Mean over max load per device, per layer ([L, D] -> [L]); 1.0 is perfectly even (vLLM's metric)."""
    device_load = np.asarray(device_load, np.float64)
    peak = device_load.max(-1)
    return np.where(peak > 0, device_load.mean(-1) / np.where(peak > 0, peak, 1), 1.0)


def identity_placement(num_layers: int, num_experts: int, num_devices: int) -> Placement:
    """No redundancy: expert e in slot e, on device e // (E / D) (the placement without EPLB)."""
    _check(num_experts, 0, num_devices)
    slots = np.tile(np.arange(num_experts), (num_layers, 1))
    return Placement(slots, np.ones((num_layers, num_experts), np.int64), num_devices)


def replicate(load: np.ndarray, num_slots: int) -> np.ndarray:
    """[E] loads -> [E] replica counts summing to num_slots (each >= 1): every extra slot to the expert with
    the highest load per replica (ties: the lower expert index)."""
    load = np.asarray(load, np.float64)
    counts = np.ones(len(load), np.int64)
    for _ in range(num_slots - len(load)):
        counts[np.argmax(load / counts)] += 1
    return counts


def pack(weights: np.ndarray, num_devices: int) -> np.ndarray:
    """[S] item weights -> [S] device of each item, S / D items per device: heaviest first onto the device
    with the smallest sum that still has room (ties: the lower device index), then improving swaps."""
    weights = np.asarray(weights, np.float64)
    per = len(weights) // num_devices
    sums, room = np.zeros(num_devices), np.full(num_devices, per)
    device = np.empty(len(weights), np.int64)
    for item in np.argsort(-weights, kind="stable"):
        d = int(np.argmin(np.where(room > 0, sums, np.inf)))
        device[item], sums[d], room[d] = d, sums[d] + weights[item], room[d] - 1
    for _ in range(len(weights)):  # then swap pairs while that lowers the heaviest device
        top = int(np.argmax(sums))
        mine, theirs = np.flatnonzero(device == top), np.flatnonzero(device != top)
        if not len(theirs):
            break
        delta = weights[mine][:, None] - weights[theirs][None, :]  # what `top` sheds by the swap
        peak = np.maximum(sums[top] - delta, sums[device[theirs]][None, :] + delta)
        i, j = np.unravel_index(np.argmin(peak), peak.shape)
        if peak[i, j] >= sums[top] - 1e-12 * max(1.0, sums[top]):
            break
        a, b = mine[i], theirs[j]
        sums[top] -= delta[i, j]
        sums[device[b]] += delta[i, j]
        device[a], device[b] = device[b], top
    return device


def plan(load: np.ndarray, num_redundant: int, num_devices: int, num_nodes: int = 1) -> Placement:
    """A placement per layer from measured loads [L, E] (tokens routed to each expert over a window).

    num_nodes > 1 (an expert-parallel group spanning hosts, devices d of node d // (D / nodes)): DeepSeek's
    hierarchical form. Each layer's experts are first packed onto the nodes, E / nodes each, balancing the
    nodes' loads; then each node replicates and packs its own experts over its devices with R / nodes
    redundant slots, so a replica never sits on another node than its expert's other copies (the
    all-to-all traffic of one expert stays within a node's fast links)."""
    load = np.asarray(load, np.float64)
    if load.ndim != 2:
        raise ValueError(f"expert load must be [layers, experts], got shape {load.shape}")
    if (load < 0).any() or not np.isfinite(load).all():
        raise ValueError("expert load must be finite and non-negative")
    L, E = load.shape
    _check(E, num_redundant, num_devices)
    if num_nodes > 1:
        return _hierarchical(load, num_redundant, num_devices, num_nodes)
    S = E + num_redundant
    slot_expert, replicas = np.empty((L, S), np.int64), np.empty((L, E), np.int64)
    for layer in range(L):
        counts, (experts, device) = _improve(load[layer], replicate(load[layer], S), num_devices)
        order = np.lexsort((experts, device))  # by device, then expert: slot s on device s // (S / D)
        slot_expert[layer], replicas[layer] = experts[order], counts
    return Placement(slot_expert, replicas, num_devices)


def _hierarchical(load: np.ndarray, num_redundant: int, num_devices: int, num_nodes: int) -> Placement:
    L, E = load.shape
    if num_devices % num_nodes or E % num_nodes:
        raise ValueError(f"{E} experts over {num_devices} expert-parallel devices on {num_nodes} nodes: the nodes "
                         "must divide both")
    per_node = num_devices // num_nodes
    S = E + num_redundant
    slot_expert, replicas = np.empty((L, S), np.int64), np.empty((L, E), np.int64)
    for layer in range(L):
        node = pack(load[layer], num_nodes)  # E / nodes experts each, heaviest first onto the lightest node
        for n in range(num_nodes):
            mine = np.flatnonzero(node == n)
            sub = plan(load[layer:layer + 1, mine], num_redundant // num_nodes, per_node)
            block = slice(n * S // num_nodes, (n + 1) * S // num_nodes)  # node n's devices' slots
            slot_expert[layer, block] = mine[sub.slot_expert[0]]
            replicas[layer, mine] = sub.replicas[0]
    return Placement(slot_expert, replicas, num_devices)


def node_count(devices: list) -> int:
    """How many hosts an expert-parallel group of `devices` (in slot order) spans, when each host's devices
    are one contiguous run of it (the hierarchical placement's assumption); 1 otherwise."""
    hosts = [getattr(d, "process_index", 0) for d in devices]
    runs = [h for i, h in enumerate(hosts) if i == 0 or h != hosts[i - 1]]
    n = len(set(hosts))
    return n if len(runs) == n and len(devices) % n == 0 else 1


def _packed(load: np.ndarray, counts: np.ndarray, num_devices: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(max device load, expert of each replica, its device) for replica counts `counts`."""
    experts = np.repeat(np.arange(len(load)), counts)
    weights = load[experts] / counts[experts]
    device = pack(weights, num_devices)
    return float(np.bincount(device, weights, num_devices).max()), experts, device


def _improve(load: np.ndarray, counts: np.ndarray, num_devices: int, max_rounds: int = 64):
    """Hill-climb over replica counts: move one replica from an expert that has several to one of the
    (donors + 8) experts with the most load per replica, while that lowers the packed maximum."""
    best, experts, device = _packed(load, counts, num_devices)
    for _ in range(max_rounds):
        donors = np.flatnonzero(counts > 1)
        takers = np.argsort(-(load / counts), kind="stable")[:len(donors) + 8]
        found = None
        for a in donors:
            for b in takers:
                if a == b:
                    continue
                trial = counts.copy()
                trial[a] -= 1
                trial[b] += 1
                peak, e, d = _packed(load, trial, num_devices)
                if peak < best - 1e-12 * max(1.0, best):
                    best, found = peak, (trial, e, d)
        if found is None:
            break
        counts, experts, device = found
    return counts, (experts, device)


def _check(num_experts: int, num_redundant: int, num_devices: int) -> None:
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(f"{num_experts} experts do not split over {num_devices} expert-parallel devices")
    if num_redundant < 0 or num_redundant % num_devices:
        raise ValueError(f"num_redundant_experts must be a non-negative multiple of the expert-parallel size "
                         f"{num_devices}, got {num_redundant}")


# ---- the placement on the devices: physical expert slots and the routing map -------------------------------
def slot_map(placement: Placement) -> tuple[np.ndarray, np.ndarray]:
    """(slots [L, E, M] int32: the physical slots of each expert's replicas, padded by repeating them;
    replicas [L, E] int32), M = 1 + R, the most replicas an expert can have, so every placement of the same
    E and R has the same shapes (a new one never recompiles): what the programs route with
    (ops.routed_experts.to_slots)."""
    L, S = placement.slot_expert.shape
    E = placement.replicas.shape[1]
    M = 1 + S - E
    slots = np.zeros((L, E, M), np.int32)
    for layer in range(L):
        for e in range(E):
            mine = np.flatnonzero(placement.slot_expert[layer] == e)
            slots[layer, e] = np.resize(mine, M)
    return slots, placement.replicas.astype(np.int32)


def expert_leaves(weights: dict, placement: Placement, moe_segments: list[int]) -> dict:
    """The weights pytree with each MoE segment's routed experts [L, E, ...] laid out in physical slots
    [L, E + R, ...] (slot s of layer l holds expert slot_expert[l, s]) and the routing map added as
    `expert_slots` [L, E, M] and `expert_replicas` [L, E]. moe_segments: the indices of the MoE segments,
    whose layers are the placement's rows in order."""
    import jax
    segments, row = list(weights["segments"]), 0
    for s in moe_segments:
        seg = dict(segments[s])
        L = seg["router"].shape[0]
        take = placement.slot_expert[row:row + L]  # [L, S]

        def gather(a):
            a = np.asarray(a)
            return np.take_along_axis(a, take.reshape(L, -1, *([1] * (a.ndim - 2))), axis=1)
        for name in ("experts_up_gate", "experts_down"):
            seg[name] = jax.tree.map(gather, seg[name])
        slots, replicas = slot_map(Placement(take, placement.replicas[row:row + L], placement.num_devices))
        seg["expert_slots"], seg["expert_replicas"] = slots, replicas
        segments[s], row = seg, row + L
    return {**weights, "segments": segments}


def checkpoint_leaves(weights: dict) -> dict:
    """Inverse of expert_leaves: each expert's first replica back in its logical slot, the map dropped."""
    import jax
    import jax.numpy as jnp
    segments = []
    for seg in weights["segments"]:
        if "expert_slots" in seg:
            seg = dict(seg)
            first = jnp.asarray(seg.pop("expert_slots"))[..., 0]  # [L, E]
            seg.pop("expert_replicas")
            for name in ("experts_up_gate", "experts_down"):
                seg[name] = jax.tree.map(
                    lambda a: jnp.take_along_axis(a, first.reshape(*first.shape, *([1] * (a.ndim - 2))), axis=1),
                    seg[name])
        segments.append(seg)
    return {**weights, "segments": segments}
