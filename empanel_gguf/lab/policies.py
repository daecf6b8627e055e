"""Expert-cache policies for replaying routing traces (see replay.py).

One interface: an engine call is one micro-batch of one MoE layer, and

    hits, misses = policy.access(layer, experts)

takes the distinct experts the call routes to, in order of first use. As in the engine
(csrc/remap.c, remap_locked) each distinct expert counts once per call: a hit if it is resident,
else a miss that is loaded; the experts of the current call are never evicted for each other, so
a lab policy's call may need at most `capacity` distinct experts (CapacityError otherwise;
replay.py splits such calls). The engine's policies take a larger call as the engine does, in
waves (`access_batch(layer, rows)` with the call's tokens, as remap.c plans them). Sizes are
slots per layer.

The engine's policies run in the engine's own code: each call is a remap of a sidecar pool that
reads nothing (pools.LabPool over empanel_lab_init), so a replay reproduces the engine's hit and
miss counts on the same calls, victims and tie-breaks included:
    LRU        per layer, least recently used slot; empty slots first, ties by lowest slot.
    LFUDecay   per layer, fewest uses, then least recent; every n_slots calls of the layer all
               counts halve (the layer's own clock: resetting statistics leaves it).
    GLRU       one budget of slots x (bytes of one expert of every layer) shared by all layers,
               each layer's pool as sizing.pool_slots.
Lab policies (expert granularity):
    LFU        LFUDecay without the decay (counts live while the expert is resident), in Python.
    SLRU       segmented LRU: new experts enter a probation segment, a hit promotes to a protected
               segment (80 % of the slots); evictions take probation's LRU first.
    ARC        adaptive replacement cache (Megiddo & Modha 2003) with its ghost lists.
    LRFU       per layer, the lowest use count decayed continuously (LRFU_HALF_LIFE).
    GLRFU      g-lru's one budget across layers, evicting the lowest decayed count of any layer.
    Belady     the offline optimum: evict the resident expert whose next use is furthest in the
               future. It needs the future: prepare(calls) first, then access() in that order.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from ..planning.sizing import pool_slots


class CapacityError(ValueError):
    """A call routes to more distinct experts than a layer's pool holds."""


class Policy:
    """The interface; subclasses keep their state per MoE layer (any hashable layer key)."""

    name = "?"
    offline = False  # True: prepare(calls) must see the whole sequence of calls first

    def __init__(self, slots):
        if slots < 1:
            raise ValueError(f"{self.name}: {slots} slots")
        self.slots = slots

    def capacity(self, layer=None):
        """Experts one layer may hold at once."""
        return self.slots

    def prepare(self, calls):
        """calls: every (layer, experts) that access() will get, in order (offline policies)."""

    def access(self, layer, experts):
        raise NotImplementedError

    def resident(self, layer):
        """The experts the layer holds now."""
        raise NotImplementedError

    @staticmethod
    def _distinct(experts):
        return list(dict.fromkeys(experts))

    def _check(self, layer, experts):
        if len(experts) > self.capacity(layer):
            raise CapacityError(f"{self.name}: a call routes to {len(experts)} distinct experts, "
                                f"layer {layer} holds {self.capacity(layer)}")


# ------------------------------------------------------------------------------------------------
# the engine's policies, run by the sidecar itself


DEFAULT_N_EXPERT = 1024  # expert ids a per-layer engine policy accepts when not told n_expert


class _EnginePolicy(Policy):
    """An engine policy replayed by the engine's own code: each call is one remap of a lab pool
    (pools.LabPool, a sidecar pool that reads nothing), so victims, tie-breaks and the decay clock
    are the engine's by construction. Per-layer policies keep one lab pool per layer key."""

    engine = "?"  # the policy's name in the sidecar (enum empanel_policy)

    def __init__(self, slots, n_expert=None):
        super().__init__(slots)
        self.n_expert = n_expert or max(DEFAULT_N_EXPERT, slots)
        self.labs = {}

    def lab(self, layer):
        """(lab pool, its layer index) for a layer key."""
        lab = self.labs.get(layer)
        if lab is None:
            from ..engine.pools import LabPool

            lab = self.labs[layer] = LabPool(self.engine, [self.capacity(layer)], self.n_expert)
        return lab, 0

    def access(self, layer, experts):
        lab, il = self.lab(layer)
        return lab.access(il, self._distinct(experts))

    def access_batch(self, layer, rows):
        """One call over a micro-batch's expert ids, rows [n_tokens][n_used], waves included."""
        lab, il = self.lab(layer)
        return lab.access_batch(il, rows)

    def guess(self, layer, experts):
        """The gate-ahead guess the engine had for the layer's next call: evicted last."""
        lab, il = self.lab(layer)
        lab.guess(il, self._distinct(experts))

    def slot_table(self, layer):
        """[n_slots] the expert each of the layer's slots holds (-1: empty), as the engine keeps it."""
        lab, il = self.lab(layer)
        return lab.slot_table(il)

    def resident(self, layer):
        return {e for e in self.slot_table(layer) if e >= 0}


class LRU(_EnginePolicy):
    """Per-layer LRU: the engine's moe_policy="lru"."""

    name = engine = "lru"


class LFUDecay(_EnginePolicy):
    """Per-layer LFU with decay: the engine's moe_policy="lfu-decay"."""

    name = engine = "lfu-decay"


def _shared_budget(slots, expert_bytes, n_expert, n_expert_used):
    """g-lru's one budget: ({layer: bytes of one expert}, slots x their sum in bytes, the slots
    of each layer's pool as sizing.pool_slots)."""
    expert_bytes = dict(expert_bytes)
    return expert_bytes, slots * sum(expert_bytes.values()), pool_slots("g-lru", slots, n_expert, n_expert_used)


class GLRU(_EnginePolicy):
    """One budget for all layers with a global LRU list: the engine's moe_policy="g-lru".

    slots: the even share per layer (the engine's moe_slots); expert_bytes: layer id -> bytes of
    one expert; budget = slots x the sum of expert_bytes; each layer's pool as sizing.pool_slots."""

    name = engine = "g-lru"

    def __init__(self, slots, expert_bytes, n_expert, n_expert_used):
        super().__init__(slots, n_expert)
        from ..engine.pools import LabPool

        self.expert_bytes, self.budget, self.n_slots = _shared_budget(slots, expert_bytes, n_expert, n_expert_used)
        n_layer = max(self.expert_bytes) + 1
        self.shared = LabPool("g-lru", [self.n_slots if il in self.expert_bytes else 0 for il in range(n_layer)],
                              n_expert, [self.expert_bytes.get(il, 0) for il in range(n_layer)], self.budget)

    def capacity(self, layer=None):
        return self.n_slots

    def resident_bytes(self):
        """Bytes of the experts resident in all layers (what the budget counts)."""
        return self.shared.resident_bytes()

    def lab(self, layer):
        if layer not in self.expert_bytes:
            raise ValueError(f"g-lru: layer {layer!r} has no expert size (expert_bytes)")
        return self.shared, layer


class LFU(Policy):
    """Lab only: per layer, the fewest uses since the expert was loaded, ties to the least recent,
    then the lowest slot (the engine's lfu-decay without the decay)."""

    name = "lfu"

    def __init__(self, slots):
        super().__init__(slots)
        self.layers = {}
        self.call = 0

    def access(self, layer, experts):
        experts = self._distinct(experts)
        self._check(layer, experts)
        st = self.layers.get(layer)
        if st is None:  # expert -> slot; per slot: expert (-1 empty), uses, call of last use
            st = self.layers[layer] = ({}, [-1] * self.slots, [0] * self.slots, [0] * self.slots)
        slot_of, expert_in, uses, last_use = st
        self.call += 1
        used, misses = set(), []
        for e in experts:
            s = slot_of.get(e)
            if s is None:
                misses.append(e)
            else:
                uses[s] += 1
                last_use[s] = self.call
                used.add(s)
        victims = sorted((uses[s], last_use[s], s) for s in range(self.slots) if s not in used)
        for e, (_, _, s) in zip(misses, victims):
            if expert_in[s] >= 0:
                del slot_of[expert_in[s]]
            expert_in[s], slot_of[e] = e, s
            uses[s], last_use[s] = 1, self.call
        return len(experts) - len(misses), len(misses)

    def resident(self, layer):
        st = self.layers.get(layer)
        return set(st[0]) if st is not None else set()


# ------------------------------------------------------------------------------------------------
# lab policies


class _PerLayer(Policy):
    """A policy whose state is one small object per layer, made by new_layer()."""

    def __init__(self, slots):
        super().__init__(slots)
        self.layers = {}

    def state(self, layer):
        st = self.layers.get(layer)
        if st is None:
            st = self.layers[layer] = self.new_layer()
        return st


class SLRU(_PerLayer):
    """Segmented LRU: probation and protected segments (protected: `protected` share of slots)."""

    name = "slru"

    def __init__(self, slots, protected=0.8):
        super().__init__(slots)
        self.protected_slots = max(1, min(slots - 1, round(protected * slots))) if slots > 1 else 0

    def new_layer(self):
        return OrderedDict(), OrderedDict()  # probation, protected; least recent first

    def resident(self, layer):
        probation, protected = self.state(layer)
        return set(probation) | set(protected)

    def access(self, layer, experts):
        experts = self._distinct(experts)
        self._check(layer, experts)
        probation, protected = self.state(layer)
        now = set(experts)
        hits = [e for e in experts if e in probation or e in protected]
        for e in hits:
            if e in protected:
                protected.move_to_end(e)
            else:
                del probation[e]
                protected[e] = None
                if len(protected) > self.protected_slots:  # the protected LRU drops back
                    old = next(iter(protected))
                    del protected[old]
                    probation[old] = None
        misses = [e for e in experts if e not in probation and e not in protected]
        for e in misses:
            if len(probation) + len(protected) >= self.slots:
                victim = next((x for x in probation if x not in now), None)
                if victim is not None:
                    del probation[victim]
                else:
                    del protected[next(x for x in protected if x not in now)]
            probation[e] = None
        return len(hits), len(misses)


class _Arc:
    __slots__ = ("t1", "t2", "b1", "b2", "p")

    def __init__(self):
        self.t1, self.t2 = OrderedDict(), OrderedDict()  # resident: seen once, seen again
        self.b1, self.b2 = OrderedDict(), OrderedDict()  # ghosts of the experts they evicted
        self.p = 0.0                                     # target size of t1


class ARC(_PerLayer):
    """Adaptive replacement cache (Megiddo & Modha, FAST 2003), per layer: t1/t2 resident, b1/b2
    remember what they evicted and steer the target p. The current call's experts are never
    evicted: REPLACE takes the chosen list's least recent expert outside the call, or the other
    list's."""

    name = "arc"

    def new_layer(self):
        return _Arc()

    def resident(self, layer):
        a = self.state(layer)
        return set(a.t1) | set(a.t2)

    def _replace(self, a, in_b2, now):
        c = self.slots
        take_t1 = len(a.t1) >= 1 and ((in_b2 and len(a.t1) == a.p) or len(a.t1) > a.p)
        order = ((a.t1, a.b1), (a.t2, a.b2)) if take_t1 else ((a.t2, a.b2), (a.t1, a.b1))
        for resident, ghosts in order:
            victim = next((x for x in resident if x not in now), None)
            if victim is not None:
                del resident[victim]
                ghosts[victim] = None
                while len(a.b1) + len(a.b2) > c:  # keep the directory at 2c at most
                    (a.b1 if len(a.b1) > len(a.b2) else a.b2).popitem(last=False)
                return
        raise CapacityError(f"{self.name}: no expert outside the call to evict")

    def access(self, layer, experts):
        experts = self._distinct(experts)
        self._check(layer, experts)
        a = self.state(layer)
        c = self.slots
        now = set(experts)
        hits = [e for e in experts if e in a.t1 or e in a.t2]
        for e in hits:  # case I: to the MRU end of t2
            (a.t1 if e in a.t1 else a.t2).pop(e)
            a.t2[e] = None
        misses = [e for e in experts if e not in a.t1 and e not in a.t2]
        for e in misses:
            full = len(a.t1) + len(a.t2) >= c
            if e in a.b1:    # case II: t1 was too small
                a.p = min(c, a.p + max(len(a.b2) / len(a.b1), 1))
                del a.b1[e]
                if full:
                    self._replace(a, False, now)
                a.t2[e] = None
            elif e in a.b2:  # case III: t2 was too small
                a.p = max(0.0, a.p - max(len(a.b1) / len(a.b2), 1))
                del a.b2[e]
                if full:
                    self._replace(a, True, now)
                a.t2[e] = None
            else:            # case IV: new
                if len(a.t1) + len(a.b1) >= c:
                    if len(a.t1) < c and a.b1:
                        a.b1.popitem(last=False)
                        if full:
                            self._replace(a, False, now)
                    else:
                        victim = next((x for x in a.t1 if x not in now), None)
                        if victim is not None:
                            del a.t1[victim]
                        elif full:
                            self._replace(a, False, now)
                else:
                    total = len(a.t1) + len(a.t2) + len(a.b1) + len(a.b2)
                    if total >= c:
                        if total >= 2 * c and a.b2:
                            a.b2.popitem(last=False)
                        if full:
                            self._replace(a, False, now)
                a.t1[e] = None
        return len(hits), len(misses)


class Belady(_PerLayer):
    """Belady's MIN: on a miss with a full layer, evict the resident expert (outside the current
    call) whose next use is furthest away, never-again first. Offline: prepare(calls) with the
    whole sequence, then access() the same calls in the same order. Optimal in misses over that
    sequence; an upper bound for any policy, predictor-driven or not."""

    name = "belady"
    offline = True

    def __init__(self, slots):
        super().__init__(slots)
        self.future = {}  # layer -> [{expert: index of this layer's next call using it}]
        self.position = {}

    def prepare(self, calls):
        per_layer = {}
        for layer, experts in calls:
            per_layer.setdefault(layer, []).append(self._distinct(experts))
        self.future = {}
        for layer, seq in per_layer.items():
            nxt, seen = [None] * len(seq), {}
            for i in range(len(seq) - 1, -1, -1):
                nxt[i] = {e: seen.get(e, math.inf) for e in seq[i]}
                for e in seq[i]:
                    seen[e] = i
            self.future[layer] = nxt
        self.position = dict.fromkeys(per_layer, 0)
        self.layers = {}

    def new_layer(self):
        return {}  # resident expert -> index of its next use

    def resident(self, layer):
        return set(self.state(layer))

    def access(self, layer, experts):
        experts = self._distinct(experts)
        self._check(layer, experts)
        i = self.position.get(layer, 0)
        future = self.future.get(layer, [])
        if i >= len(future) or set(future[i]) != set(experts):
            raise ValueError("belady: access() does not follow the calls given to prepare()")
        self.position[layer] = i + 1
        nxt = future[i]
        cache = self.state(layer)
        hits = 0
        for e in experts:
            if e in cache:
                hits += 1
                cache[e] = nxt[e]
        misses = [e for e in experts if e not in cache]
        for e in misses:
            if len(cache) >= self.slots:
                victim = max((x for x in cache if x not in nxt), key=lambda x: (cache[x], x))
                del cache[victim]
            cache[e] = nxt[e]
        return hits, len(misses)


class _Decayed:
    """Decayed use counts: score = sum over uses of 2^(-age / half_life), age in clock ticks. Kept
    scaled by 2^(t / half_life) so that scores of different ages compare without decaying each
    one (the common factor 2^(-now / half_life) cancels); rescaled before it overflows."""

    def __init__(self, half_life):
        self.half_life = float(half_life)
        self.t = 0
        self.score = {}  # key -> scaled score
        self.last = {}   # key -> tick of its last use
        self.unit = 1.0  # 2^(t / half_life) / the rescales so far

    def tick(self):
        self.t += 1
        self.unit *= 2.0 ** (1.0 / self.half_life)
        if self.unit > 1e200:
            for key in self.score:
                self.score[key] /= self.unit
            self.unit = 1.0

    def use(self, key):
        self.score[key] = self.score.get(key, 0.0) + self.unit
        self.last[key] = self.t

    def victim(self, keys):
        """The lowest score, ties to the least recent use, then the lowest key."""
        return min(keys, key=lambda k: (self.score.get(k, 0.0), self.last.get(k, -1), k))


LRFU_HALF_LIFE = 4    # lrfu: half-life in the layer's calls, times its slots
GLRFU_HALF_LIFE = 2   # g-lrfu: half-life in calls of all layers / n_layers (tokens, at one token per
                      # call: decode, or replay --ubatch 1), times the slots per layer


class LRFU(_PerLayer):
    """Lab only: per layer, the lowest use count decayed continuously (half-life LRFU_HALF_LIFE x
    slots of the layer's calls), where lfu-decay halves every count each n_slots calls. An
    evicted expert keeps its decayed count (lfu-decay's counts start again at load)."""

    name = "lrfu"

    def new_layer(self):
        return set(), _Decayed(LRFU_HALF_LIFE * self.slots)

    def resident(self, layer):
        return set(self.state(layer)[0])

    def access(self, layer, experts):
        experts = self._distinct(experts)
        self._check(layer, experts)
        held, counts = self.state(layer)
        counts.tick()
        misses = [e for e in experts if e not in held]
        for e in experts:
            counts.use(e)
        now = set(experts)
        for e in misses:
            if len(held) >= self.slots:
                held.discard(counts.victim(held - now))
            held.add(e)
        return len(experts) - len(misses), len(misses)


class GLRFU(Policy):
    """Lab only: one budget for all layers (slots x the bytes of one expert of every layer, as
    g-lru) with decayed use counts per (layer, expert) on one clock of every call (half-life
    GLRFU_HALF_LIFE x slots tokens); each layer's pool as sizing.pool_slots under g-lru."""

    name = "g-lrfu"

    def __init__(self, slots, expert_bytes, n_expert, n_expert_used):
        super().__init__(slots)
        self.expert_bytes, self.budget, self.n_slots = _shared_budget(slots, expert_bytes, n_expert, n_expert_used)
        self.counts = _Decayed(GLRFU_HALF_LIFE * slots * len(self.expert_bytes))
        self.held = {layer: set() for layer in self.expert_bytes}
        self.bytes = 0

    def capacity(self, layer=None):
        return self.n_slots

    def resident(self, layer):
        return set(self.held.get(layer, ()))

    def _evict(self, keys):
        layer, e = self.counts.victim(keys)
        self.held[layer].discard(e)
        self.bytes -= self.expert_bytes[layer]

    def access(self, layer, experts):
        experts = self._distinct(experts)
        self._check(layer, experts)
        if layer not in self.held:
            raise ValueError(f"g-lrfu: layer {layer!r} has no expert size (expert_bytes)")
        held, size = self.held[layer], self.expert_bytes[layer]
        self.counts.tick()
        misses = [e for e in experts if e not in held]
        for e in experts:
            self.counts.use((layer, e))
        now = set(experts)
        for e in misses:
            if len(held) >= self.n_slots:  # the layer's pool is full: one of its own goes
                self._evict({(layer, x) for x in held - now})
            while self.bytes + size > self.budget:
                others = {(il, x) for il, xs in self.held.items() for x in xs if il != layer or x not in now}
                if not others:
                    break  # all that is held is this call's: the budget yields, as g-lru's
                self._evict(others)
            held.add(e)
            self.bytes += size
        return len(experts) - len(misses), len(misses)


LAB_POLICIES = ("lru", "g-lru", "lfu", "lfu-decay", "slru", "arc", "lrfu", "g-lrfu", "belady")  # what the lab replays


def make_policy(name, slots, *, expert_bytes=None, n_expert=None, n_expert_used=None):
    """A policy by name at `slots` per layer (g-lru: its budget equivalent; needs the trace's
    expert_bytes, n_expert and n_expert_used)."""
    if name in ("g-lru", "g-lrfu"):
        return {"g-lru": GLRU, "g-lrfu": GLRFU}[name](slots, expert_bytes, n_expert, n_expert_used)
    if name in ("lru", "lfu-decay"):
        return {"lru": LRU, "lfu-decay": LFUDecay}[name](slots, n_expert)
    classes = {"lru": LRU, "lfu": LFU, "lfu-decay": LFUDecay, "slru": SLRU, "arc": ARC, "lrfu": LRFU,
               "belady": Belady}
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}: one of {', '.join(LAB_POLICIES)}")
    return classes[name](slots)
