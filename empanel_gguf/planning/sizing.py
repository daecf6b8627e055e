"""How many expert slots each MoE layer gets: from a count, a share, or a memory budget.

    moe_slots=32        32 slots in every MoE layer
    moe_slots="25%"     a quarter of each layer's experts (rounded up)
    moe_slots="6GiB"    as many slots per layer as fit in 6 GiB of pools in all (also MiB, GB, ...)

With the g-lru policy the same figure sets one budget shared by all layers (slots x bytes of one
expert of every layer), and each layer's pool may hold up to GLRU_HEADROOM times its even share:
layers that need more experts take them from layers that need fewer.

Pure Python: works on an index (index.py), knows nothing of llama.cpp.
"""

import math
import re
from dataclasses import dataclass, field

_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KB": 1000, "KIB": 1 << 10,
    "M": 1 << 20, "MB": 1000**2, "MIB": 1 << 20,
    "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30,
    "T": 1 << 40, "TB": 1000**4, "TIB": 1 << 40,
}


DEFAULT_POLICY = "lfu-decay"  # measured: fewer misses than lru and g-lru (docs/performance.md)

GLRU_HEADROOM = 2  # g-lru: a layer's pool holds up to this many times its even share


class SlotsError(ValueError):
    """moe_slots cannot be satisfied for this model."""


@dataclass
class SlotPlan:
    n_slots: list            # [n_layer] slots per layer; 0 for layers without routed experts
    n_expert: int
    n_expert_used: int
    pool_bytes: int          # bytes of experts the pools hold at most (the memory they take)
    notices: list = field(default_factory=list)  # what was adjusted, for verbose output
    budget_bytes: int = 0    # g-lru: the shared budget (= pool_bytes); 0 for per-layer policies
    capacity_bytes: int = 0  # bytes of all pools' slots (above pool_bytes for g-lru)
    holds_all: bool = False  # every layer's pool (and budget) holds all its experts
    resident_layers: int = 0  # the first MoE layers that keep every expert (no pool)
    resident_bytes: int = 0  # bytes of their experts, held as a stock load holds them

    @property
    def expert_bytes(self):
        """Bytes of experts the load holds at most: the pools and the resident layers."""
        return self.pool_bytes + self.resident_bytes

    @property
    def min_slots(self):
        return min(n for n in self.n_slots if n > 0)


def parse_size(text):
    """'6GiB' -> bytes, or None if text is not a size."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or (m.group(2) == "" and "." in m.group(1)):
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def plan_slots(index, moe_slots, policy="lru", resident_layers=0):
    """Slots per layer for `moe_slots` (int, 'P%', or a size like '6GiB') under `policy`; the first
    `resident_layers` MoE layers keep every expert (llama.cpp's --n-cpu-moe idea), and a size
    covers their experts too. Micro-batches of any size run in waves that fit the pools."""
    if not index.layers:
        raise SlotsError(f"{index.path}: no MoE layer with routed experts; moe_slots does not apply")
    if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or resident_layers < 0:
        raise SlotsError(f"moe_resident_layers={resident_layers!r}: give a number of MoE layers (0 or more)")
    if resident_layers >= len(index.layers):
        raise SlotsError(f"moe_resident_layers={resident_layers}: the model has {len(index.layers)} MoE "
                         "layers; keeping them all resident is moe_slots=None")
    resident, layers = index.layers[:resident_layers], index.layers[resident_layers:]
    resident_bytes = sum(index.n_expert * layer.expert_bytes for layer in resident)
    n_expert, k = index.n_expert, index.n_expert_used
    notices = []
    wanted = _wanted_slots(index, moe_slots, layers, resident_bytes)

    if wanted < k:
        raise SlotsError(
            f"moe_slots={moe_slots!r} gives {wanted} slots per layer, but each token routes to "
            f"{k} experts per layer ({index.architecture}, {n_expert} experts): use at least {k} "
            f"(moe_slots={k}, or a larger share or budget)."
        )
    if wanted > n_expert:
        notices.append(f"moe_slots={moe_slots!r}: {wanted} slots clamped to the {n_expert} experts per layer")
        wanted = n_expert
    if resident:
        notices.append(f"the first {resident_layers} MoE layers keep all {n_expert} experts resident "
                       f"({resident_bytes / 2**20:.1f} MiB)")

    n_slots = [0] * index.n_layer
    pool_bytes = sum(wanted * layer.expert_bytes for layer in layers)
    capacity = pool_slots(policy, wanted, n_expert, k)
    for layer in layers:
        n_slots[layer.layer] = capacity
    return SlotPlan(n_slots=n_slots, n_expert=n_expert, n_expert_used=k, pool_bytes=pool_bytes,
                    notices=notices, budget_bytes=pool_bytes if policy == "g-lru" else 0,
                    capacity_bytes=sum(capacity * layer.expert_bytes for layer in layers),
                    holds_all=wanted >= n_expert, resident_layers=resident_layers,
                    resident_bytes=resident_bytes)


def pool_slots(policy, slots, n_expert, n_expert_used):
    """Slots a layer's pool has for `slots` per layer: `slots`, or under g-lru (one budget of
    `slots` experts per layer) up to GLRU_HEADROOM times that, at least top-k more."""
    if policy == "g-lru":
        return min(n_expert, max(GLRU_HEADROOM * slots, slots + n_expert_used))
    return slots


def sizes_alike(policy, other):
    """Whether plan_slots gives the same plan under both policies: only g-lru sizes its pools
    (pool_slots) and a budget otherwise."""
    return (policy == "g-lru") == (other == "g-lru")


def _wanted_slots(index, moe_slots, layers=None, resident_bytes=0):
    """Slots per paged layer (`layers`, default all MoE layers); a size first pays for the
    resident layers' experts (`resident_bytes`)."""
    if isinstance(moe_slots, bool):
        raise SlotsError(f"moe_slots={moe_slots!r}: give a count, a share ('25%') or a size ('6GiB')")
    if isinstance(moe_slots, int):
        return moe_slots
    if not isinstance(moe_slots, str):
        raise SlotsError(f"moe_slots={moe_slots!r}: give a count, a share ('25%') or a size ('6GiB')")
    text = moe_slots.strip()
    if text.isdigit():
        return int(text)
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100.0
        except ValueError:
            share = -1.0
        if not 0.0 < share <= 1.0:
            raise SlotsError(f"moe_slots={moe_slots!r}: a share must lie in (0%, 100%]")
        return math.ceil(share * index.n_expert - 1e-9)
    budget = parse_size(text)
    if budget is None:
        raise SlotsError(f"moe_slots={moe_slots!r}: not 'auto', 'none', a count, a share ('25%') or a size "
                         "('6GiB')")
    per_slot = sum(layer.expert_bytes for layer in (index.layers if layers is None else layers))
    return max(0, budget - resident_bytes) // per_slot  # one slot in every paged layer
