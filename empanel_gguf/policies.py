"""Expert-cache policies for replaying routing traces (see replay.py).

One interface: an engine call is one micro-batch of one MoE layer, and

    hits, misses = policy.access(layer, experts)

takes the distinct experts the call routes to, in order of first use. As in the engine
(csrc/remap.c, remap_locked) each distinct expert counts once per call: a hit if it is resident,
else a miss that is loaded; the experts of the current call are never evicted for each other, so
a call may need at most `capacity` distinct experts (CapacityError otherwise; replay.py splits
such calls as the engine's n_ubatch cap would). Sizes are slots per layer.

Engine-exact (slot by slot, victim choice and tie-breaks included, so that a replay reproduces the
engine's hit and miss counts on the same calls):
    LRU        per layer, least recently used slot; empty slots first, ties by lowest slot.
    LFUDecay   per layer, fewest uses, then least recent; a loaded expert starts at one use, a hit
               adds one per call, and every n_slots calls of the layer all counts halve.
    GLRU       one budget of slots x (bytes of one expert of every layer) shared by all layers:
               each layer's pool holds up to min(n_expert, max(2 x slots, slots + top-k)); a miss
               in a full pool evicts that layer's LRU expert, otherwise the least recently used
               experts of any layer (none of the current call) go until the budget fits.
Lab policies (expert granularity):
    LFU        LFUDecay without the decay (counts live while the expert is resident).
    SLRU       segmented LRU: new experts enter a probation segment, a hit promotes to a protected
               segment (80 % of the slots); evictions take probation's LRU first.
    ARC        adaptive replacement cache (Megiddo & Modha 2003) with its ghost lists.
    Belady     the offline optimum: evict the resident expert whose next use is furthest in the
               future. It needs the future: prepare(calls) first, then access() in that order.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from .sizing import POLICIES as ENGINE_POLICY_IDS


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

    @staticmethod
    def _distinct(experts):
        return list(dict.fromkeys(experts))

    def _check(self, layer, experts):
        if len(experts) > self.capacity(layer):
            raise CapacityError(f"{self.name}: a call routes to {len(experts)} distinct experts, "
                                f"layer {layer} holds {self.capacity(layer)}")


# ------------------------------------------------------------------------------------------------
# the engine's policies, slot by slot


class _Pool:
    """One MoE layer's slots as csrc/pool.c keeps them (struct empanel_layer)."""

    __slots__ = ("n_slots", "slot_of", "expert_in", "last_use", "call_mark", "uses", "n_remaps")

    def __init__(self, n_slots):
        self.n_slots = n_slots
        self.slot_of = {}                 # expert -> slot
        self.expert_in = [-1] * n_slots   # slot -> expert, -1 empty
        self.last_use = [0] * n_slots     # call that last used the slot; 0: empty
        self.call_mark = [0] * n_slots    # call that uses the slot now
        self.uses = [0] * n_slots         # LFU counts
        self.n_remaps = 0

    def note_use(self, s, call):
        self.call_mark[s] = call
        self.last_use[s] = call
        self.uses[s] += 1


class _EnginePolicy(Policy):
    lfu = False    # order victims by uses first
    decay = False  # halve the uses every n_slots calls of a layer
    one_by_one = False  # victims change the others' order while they are picked (g-lru)

    def __init__(self, slots):
        super().__init__(slots)
        self.pools = {}
        self.call = 0  # the engine's call counter (pool->call): one per access, all layers

    def pool(self, layer):
        pool = self.pools.get(layer)
        if pool is None:
            pool = self.pools[layer] = _Pool(self.capacity(layer))
        return pool

    def _pick_victim(self, pool, call):
        """pick_victim: among the slots this call does not use, the fewest uses (LFU only), then
        the least recent use, then the lowest slot; empty slots (0 uses, last use 0) first."""
        victim, fewest, oldest = -1, math.inf, math.inf
        uses, last_use, call_mark = pool.uses, pool.last_use, pool.call_mark
        for s in range(pool.n_slots):
            if call_mark[s] == call:
                continue
            u = uses[s] if self.lfu else 0
            if u < fewest or (u == fewest and last_use[s] < oldest):
                victim, fewest, oldest = s, u, last_use[s]
        return victim

    def _pick_victims(self, pool, call, n):
        """The n victims _pick_victim would pick one after the other, at once: a pick changes only
        the picked slot (it becomes this call's), so they are the n first slots in its order."""
        uses, last_use, call_mark = pool.uses, pool.last_use, pool.call_mark
        if self.lfu:
            order = ((uses[s], last_use[s], s) for s in range(pool.n_slots) if call_mark[s] != call)
        else:
            order = ((last_use[s], s) for s in range(pool.n_slots) if call_mark[s] != call)
        return [key[-1] for key in heapq.nsmallest(n, order)]

    # hooks for g-lru's shared list
    def _on_hit(self, layer, s):
        pass

    def _on_evict_full(self, layer, s):
        pass

    def _on_fill_empty(self, layer, call):
        pass

    def _on_loaded(self, layer, s):
        pass

    def access(self, layer, experts):
        experts = self._distinct(experts)
        pool = self.pool(layer)
        self.call += 1
        call = self.call
        hits = 0
        misses = []
        for e in experts:
            s = pool.slot_of.get(e)
            if s is None:
                misses.append(e)
            elif pool.call_mark[s] != call:
                pool.note_use(s, call)
                hits += 1
                self._on_hit(layer, s)
        victims = []
        picks = None if self.one_by_one else iter(self._pick_victims(pool, call, len(misses)))
        for e in misses:
            s = self._pick_victim(pool, call) if picks is None else next(picks, -1)
            if s < 0:
                raise CapacityError(f"{self.name}: a call routes to {len(experts)} distinct experts, "
                                    f"layer {layer} holds {pool.n_slots}")
            if pool.expert_in[s] >= 0:  # a full pool: its own least recent expert goes
                del pool.slot_of[pool.expert_in[s]]
                self._on_evict_full(layer, s)
            else:
                self._on_fill_empty(layer, call)
            pool.expert_in[s] = -1
            pool.uses[s] = 0
            pool.note_use(s, call)
            victims.append(s)
        for e, s in zip(misses, victims):
            pool.expert_in[s] = e
            pool.slot_of[e] = s
            self._on_loaded(layer, s)
        pool.n_remaps += 1
        if self.decay and pool.n_remaps % pool.n_slots == 0:
            pool.uses = [u // 2 for u in pool.uses]
        return hits, len(misses)


class LRU(_EnginePolicy):
    """Per-layer LRU, exactly the engine's moe_policy="lru"."""

    name = "lru"


class LFUDecay(_EnginePolicy):
    """Per-layer LFU with decay, exactly the engine's moe_policy="lfu-decay"."""

    name = "lfu-decay"
    lfu = True
    decay = True


class LFU(_EnginePolicy):
    """Per-layer LFU (ties: least recent), counts reset when an expert is loaded; no decay."""

    name = "lfu"
    lfu = True


GLRU_HEADROOM = 2  # sizing.GLRU_HEADROOM: a layer's pool holds up to twice its even share


class GLRU(_EnginePolicy):
    """One budget for all layers with a global LRU list, exactly the engine's moe_policy="g-lru".

    slots: the even share per layer (the engine's moe_slots); expert_bytes: layer -> bytes of one
    expert; budget = slots x the sum of expert_bytes."""

    name = "g-lru"
    one_by_one = True  # making room in the budget may empty slots of the same layer

    def __init__(self, slots, expert_bytes, n_expert, n_expert_used):
        super().__init__(slots)
        self.expert_bytes = dict(expert_bytes)
        self.budget = slots * sum(self.expert_bytes.values())
        self.n_slots = min(n_expert, max(GLRU_HEADROOM * slots, slots + n_expert_used))
        self.resident = 0          # bytes of resident experts (the engine's resident_bytes)
        self.lru = OrderedDict()   # (layer, slot) of resident experts, least recent first

    def capacity(self, layer=None):
        return self.n_slots

    def _on_hit(self, layer, s):
        self.lru.move_to_end((layer, s))

    def _on_evict_full(self, layer, s):
        del self.lru[(layer, s)]  # its bytes stay counted for the one that comes

    def _on_loaded(self, layer, s):
        self.lru[(layer, s)] = None

    def _on_fill_empty(self, layer, call):
        """glru_make_room: evict the least recent experts of any layer (none of this call) until
        one more expert of `layer` fits; the budget yields when only this call's are left."""
        need = self.expert_bytes[layer]
        if self.resident + need > self.budget:
            gone, freed = [], 0
            for key in self.lru:
                if self.resident - freed + need <= self.budget:
                    break
                other, s = key
                if self.pools[other].call_mark[s] != call:
                    gone.append(key)
                    freed += self.expert_bytes[other]
            for other, s in gone:
                del self.lru[(other, s)]
                pool = self.pools[other]
                del pool.slot_of[pool.expert_in[s]]
                pool.expert_in[s] = -1
                pool.last_use[s] = 0  # empty: taken first by its layer
                pool.uses[s] = 0
                self.resident -= self.expert_bytes[other]
        self.resident += need


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


POLICIES = ("lru", "g-lru", "lfu", "lfu-decay", "slru", "arc", "belady")
ENGINE_POLICIES = tuple(ENGINE_POLICY_IDS)  # what Llama(moe_policy=...) runs


def make_policy(name, slots, *, expert_bytes=None, n_expert=None, n_expert_used=None):
    """A policy by name at `slots` per layer (g-lru: its budget equivalent; needs the trace's
    expert_bytes, n_expert and n_expert_used)."""
    if name == "g-lru":
        return GLRU(slots, expert_bytes, n_expert, n_expert_used)
    classes = {"lru": LRU, "lfu": LFU, "lfu-decay": LFUDecay, "slru": SLRU, "arc": ARC,
               "belady": Belady}
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
    return classes[name](slots)
