"""Cache policies (empanel_gguf.lab.policies) and the replay driver on small hand-computed traces.

Pure Python, no model: every expected count below is worked out by hand in the comments. A call
is one micro-batch of one layer; its distinct experts count once each (hit if resident, else a
miss that is loaded); the experts of the current call are never evicted.
"""

import math
import random

import numpy as np
import pytest

from empanel_gguf.lab.policies import (ARC, GLRFU, GLRU, LFU, LRFU, LRU, SLRU, Belady, CapacityError, LFUDecay,
                                   make_policy)
from empanel_gguf.lab.replay import build_calls, replay
from empanel_gguf.lab.trace import Trace


def run(policy, calls, layer=0):
    """calls: expert lists of one layer (or (layer, experts) pairs); returns (hits, misses)."""
    calls = [c if isinstance(c, tuple) else (layer, c) for c in calls]
    if policy.offline:
        policy.prepare(calls)
    hits = misses = 0
    for lay, experts in calls:
        h, m = policy.access(lay, experts)
        hits, misses = hits + h, misses + m
    return hits, misses


def resident(policy, layer=0):
    return policy.resident(layer)


# ------------------------------------------------------------------------------------------------
# LRU (the engine's)


def test_lru_classic():
    # 3 slots: 0 1 2 miss (fill); 0 hit (order 1 2 0); 3 miss evicts 1 (order 2 0 3);
    # 1 miss evicts 2 (order 0 3 1); 0 hit -> 2 hits, 5 misses
    p = LRU(3)
    assert run(p, [[0], [1], [2], [0], [3], [1], [0]]) == (2, 5)
    assert resident(p) == {0, 1, 3}


def test_lru_ties_go_to_the_lowest_slot_like_the_engine():
    # 2 slots. [0] -> slot 0, [1] -> slot 1, [0] hit (slot 0 now more recent than slot 1).
    # [2, 3]: both miss; 2 takes the LRU slot 1, 3 takes slot 0: both last used by this call.
    # [4]: a tie between slot 0 (expert 3) and slot 1 (expert 2): remap.c takes the lowest slot,
    # so 3 goes (evicting in load order would drop 2 instead). [2] is then a hit.
    # hits: [0], [2] = 2; misses: 0 1 2 3 4 = 5
    p = LRU(2)
    assert run(p, [[0], [1], [0], [2, 3], [4], [2]]) == (2, 5)
    assert p.slot_table(0) == [4, 2]


def test_distinct_experts_count_once_per_call():
    # one call routing tokens to 0,1,0,1 (as T=2 tokens x top-2): 2 distinct misses, no hits;
    # then [1, 1]: one hit
    p = LRU(4)
    assert p.access(0, [0, 1, 0, 1]) == (0, 2)
    assert p.access(0, [1, 1]) == (1, 0)


def test_layers_are_independent_per_layer():
    # layer 0 and layer 1 each have 1 slot: [0]@0, [0]@1, [0]@0 hit, [0]@1 hit
    p = LRU(1)
    assert run(p, [(0, [0]), (1, [0]), (0, [0]), (1, [0])]) == (2, 2)


def test_a_call_needing_more_than_the_slots_is_refused_by_the_lab_policies():
    for name in ("lfu", "slru", "arc", "belady"):
        p = make_policy(name, 2)
        with pytest.raises(CapacityError):
            run(p, [[0, 1, 2]])


def test_the_engine_policies_run_a_larger_call_in_waves():
    # 4 slots, one token routed to 6 experts: the engine's wave plan, all 6 read once; the last
    # two waves (two halves of 2 slots) stay resident
    for name in ("lru", "lfu-decay"):
        p = make_policy(name, 4)
        assert p.access_batch(0, [[0, 1, 2, 3, 4, 5]]) == (0, 6)
        assert len(p.resident(0)) == 4 and p.resident(0) <= set(range(6))
        # a token's experts in its own rows: the later tokens' experts stay (last use)
        p = make_policy(name, 4)
        assert p.access_batch(0, [[0, 1], [2, 3], [4, 5]]) == (0, 6)
        assert p.resident(0) == {2, 3, 4, 5}


# ------------------------------------------------------------------------------------------------
# LFU and LFU with decay (the engine's)


LFU_CALLS = [[0], [0], [1], [1], [2], [0], [1]]


def test_lfu_decay_by_hand():
    # 2 slots; counts halve after every 2nd call of the layer (n_remaps % n_slots == 0).
    # c1 [0] miss: s0=0 uses 1                          (1 call)
    # c2 [0] hit : uses 2; decay -> s0 1, s1 0          (2 calls)
    # c3 [1] miss: s1 empty -> s1=1 uses 1              (3)
    # c4 [1] hit : s1 uses 2; decay -> s0 0, s1 1       (4)
    # c5 [2] miss: fewest uses s0 (expert 0) goes; s0=2 uses 1
    # c6 [0] miss: s0 1 (last c5) vs s1 1 (last c4): tie -> least recent s1 (expert 1) goes;
    #             s1=0 uses 1; decay -> both 0            (6)
    # c7 [1] miss: both 0 uses -> least recent s0 (expert 2) goes
    # hits c2 c4 = 2, misses 5; expert 0 (s1) and 1 (s0) resident
    p = LFUDecay(2)
    assert run(p, LFU_CALLS) == (2, 5)
    assert p.slot_table(0) == [1, 0]


def test_lfu_without_decay_by_hand():
    # the same calls, counts never halve:
    # c1 miss s0=0 (1); c2 hit (2); c3 miss s1=1 (1); c4 hit (2)
    # c5 [2]: s0 2 (last c2) vs s1 2 (last c4): tie -> s0 (expert 0) goes; s0=2 (1)
    # c6 [0]: s0 1 < s1 2 -> expert 2 goes; s0=0 (1)
    # c7 [1]: hit -> 3 hits, 4 misses
    assert run(LFU(2), LFU_CALLS) == (3, 4)


def test_lru_on_the_lfu_calls():
    # c1 m, c2 h, c3 m, c4 h, c5 [2] evicts 0 (last c2), c6 [0] evicts 1 (last c4),
    # c7 [1] evicts 2 (last c5) -> 2 hits, 5 misses
    assert run(LRU(2), LFU_CALLS) == (2, 5)


# ------------------------------------------------------------------------------------------------
# g-lru (the engine's): one budget for all layers


def test_glru_shares_its_budget_across_layers():
    # layers A=0, B=1, 100 bytes per expert each; N=2 slots per layer -> budget 2 x 200 = 400
    # bytes (4 experts in all), a layer's pool holds min(8, max(2x2, 2+1)) = 4 (top-1).
    # A[0] A[1] A[2] A[3]: 4 misses, 400 bytes: A holds 4 experts, B none
    # B[0]: miss; B has empty slots, the budget is full -> the least recent of any layer, A0, goes
    # A[0]: miss; A's slot of 0 is empty again -> budget: A1 (now the least recent) goes
    # A[2]: hit -> 1 hit, 6 misses. Per-layer LRU with 2 slots each: no hits at all.
    calls = [(0, [0]), (0, [1]), (0, [2]), (0, [3]), (1, [0]), (0, [0]), (0, [2])]
    p = GLRU(2, {0: 100, 1: 100}, n_expert=8, n_expert_used=1)
    assert p.capacity() == 4 and p.budget == 400
    assert run(p, calls) == (1, 6)
    assert resident(p, 0) == {0, 2, 3} and resident(p, 1) == {0} and p.resident_bytes() == 400
    assert run(LRU(2), calls) == (0, 7)


def test_glru_full_layer_evicts_its_own_lru_even_with_budget_left():
    # three layers of 100 bytes, N=2 -> budget 600, a pool holds 4 (top-1)
    # A[0..3]: 4 misses (400 bytes); A[4]: A's pool is full -> A's own LRU (0) goes although the
    # budget has room; A[0]: A full again -> A1 goes; B[0]: fits the budget (500), nothing goes;
    # A[2]: hit -> 1 hit, 7 misses
    calls = [(0, [e]) for e in range(5)] + [(0, [0]), (1, [0]), (0, [2])]
    p = GLRU(2, {0: 100, 1: 100, 2: 100}, n_expert=8, n_expert_used=1)
    assert run(p, calls) == (1, 7)
    assert resident(p, 0) == {2, 3, 4, 0} and resident(p, 1) == {0} and p.resident_bytes() == 500


def test_glru_never_evicts_the_current_call_and_the_budget_yields():
    # one layer of 100 bytes, N=1, top-2: budget 100, pool of min(8, max(2, 3)) = 3 slots.
    # [0, 1]: two misses; the budget holds one, but both are this call's: 200 bytes resident.
    # [2]: miss; budget: 0 and 1 (least recent first) go until 100 more fit -> both go.
    p = GLRU(1, {0: 100}, n_expert=8, n_expert_used=2)
    assert p.access(0, [0, 1]) == (0, 2) and p.resident_bytes() == 200
    assert p.access(0, [2]) == (0, 1) and p.resident_bytes() == 100 and resident(p) == {2}


# ------------------------------------------------------------------------------------------------
# lrfu and g-lrfu (lab only): use counts decayed continuously


def test_lrfu_keeps_the_recent_expert_that_lfu_evicts():
    # 2 slots, half-life 4 x 2 = 8 calls. c1-c6 [0], c7-c10 [1], c11 [2], c12 [1].
    # At c11 expert 0 scores sum_{t=1..6} 2^-((11-t)/8) = 3.17 and expert 1 sum_{t=7..10} = 3.24:
    # 0 goes, so c12 is a hit: hits c2-c6, c8-c10, c12 = 9, misses c1 c7 c11 = 3.
    # LFU counts 6 uses against 4: 1 goes, and c12 misses.
    calls = [[0]] * 6 + [[1]] * 4 + [[2], [1]]
    p = LRFU(2)
    assert run(p, calls) == (9, 3) and resident(p) == {1, 2}
    assert run(LFU(2), calls) == (8, 4)


def test_glrfu_evicts_the_lowest_decayed_count_of_any_layer():
    # layers A=0, B=1 of 100 bytes, N=2, top-1: budget 400 bytes, a pool of 4; half-life
    # 2 tokens x 2 slots x 2 layers = 8 calls. A[0] x3 (t1-t3), B[0] (t4), B[1] (t5), A[1] (t6):
    # 400 bytes. A[2] (t7): A0 scores 2^-(6/8) + 2^-(5/8) + 2^-(4/8) = 1.95, B0 0.77, B1 0.84,
    # A1 0.92: B0 goes (g-lru takes the least recent, A0). A[0] (t8): a hit (g-lru: a miss).
    calls = [(0, [0])] * 3 + [(1, [0]), (1, [1]), (0, [1]), (0, [2]), (0, [0])]
    p = GLRFU(2, {0: 100, 1: 100}, n_expert=8, n_expert_used=1)
    assert p.capacity() == 4
    assert run(p, calls) == (3, 5)
    assert resident(p, 0) == {0, 1, 2} and resident(p, 1) == {1}
    assert run(GLRU(2, {0: 100, 1: 100}, n_expert=8, n_expert_used=1), calls) == (2, 6)


def test_lrfu_scores_survive_a_long_trace():
    # the scaled scores are rescaled before they overflow (half-life 8 calls: 2^(1/8) a call,
    # past 1e200 every ~5300 calls): 50 000 calls alternating experts 0 and 1 in 2 slots, then
    # [2], which must evict 0 (last used a call before 1), then [1] a hit and [0] a miss that
    # evicts 2 (one use against 1's many): the victims still follow the scores after the rescales
    p = LRFU(2)
    assert run(p, [[i % 2] for i in range(50_000)]) == (49_998, 2)
    assert run(p, [[2], [1], [0]]) == (1, 2) and resident(p) == {0, 1}
    counts = p.state(0)[1]
    assert counts.t == 50_003 and counts.unit < 1e200
    assert all(math.isfinite(v) and v > 0 for v in counts.score.values())


def test_glrfu_never_evicts_the_current_call_and_the_budget_yields():
    # as g-lru: one layer of 100 bytes, N=1, top-2: budget 100, a pool of 3. [0, 1] holds 200
    # bytes (both this call's); [2] evicts until it fits: both go
    p = GLRFU(1, {0: 100}, n_expert=8, n_expert_used=2)
    assert p.access(0, [0, 1]) == (0, 2) and p.bytes == 200
    assert p.access(0, [2]) == (0, 1) and p.bytes == 100 and resident(p) == {2}


# ------------------------------------------------------------------------------------------------
# Belady


def test_belady_classic():
    # 2 slots, 0 1 2 0 1 3 0 1:
    # 0 m, 1 m; 2 m: next uses 0 @3, 1 @4 -> evict 1 {0,2}; 0 hit; 1 m: 0 @6, 2 never -> evict 2
    # {0,1}; 3 m: 0 @6, 1 @7 -> evict 1 {0,3}; 0 hit; 1 m -> 2 hits, 6 misses
    calls = [[0], [1], [2], [0], [1], [3], [0], [1]]
    assert run(Belady(2), calls) == (2, 6)
    # LRU on the same: every access misses
    assert run(LRU(2), calls) == (0, 8)


def test_belady_never_evicts_the_current_call():
    # 3 slots: [0,1] 2 m; [2] m; [0,3]: 0 hit, 3 miss -> evict among 1 (next @3) and 2 (next @4):
    # 2 goes; 0 itself is never used again (the furthest of all) but belongs to this call.
    # [1] hit; [2] miss -> 2 hits, 5 misses
    assert run(Belady(3), [[0, 1], [2], [0, 3], [1], [2]]) == (2, 5)


def test_belady_needs_the_calls_it_was_prepared_with():
    p = Belady(2)
    p.prepare([(0, [0]), (0, [1])])
    p.access(0, [0])
    with pytest.raises(ValueError):
        p.access(0, [2])


# ------------------------------------------------------------------------------------------------
# SLRU and ARC: scan resistance by hand, invariants on random calls


SCAN = [[0], [1], [0], [1], [2], [3], [4], [5], [6], [0], [1]]


def test_slru_keeps_the_protected_through_a_scan():
    # 4 slots, protected 3. 0 1 miss (probation); 0 1 hit -> protected; 2 3 miss (probation);
    # 4 miss: full -> probation's LRU 2 goes; 5 evicts 3; 6 evicts 4; 0 1 hit -> 4 hits, 7 misses
    assert run(SLRU(4), SCAN) == (4, 7)
    # LRU-4: 0 1 miss, 0 1 hit, 2 3 miss, 4 5 6 evict 0 1 2, 0 1 miss -> 2 hits, 9 misses
    assert run(LRU(4), SCAN) == (2, 9)


def test_arc_by_hand():
    # c=4. 0 1 -> t1; 0 1 hit -> t2 {0,1}; 2 3 -> t1 {2,3} (full)
    # 4: |t1|+|b1| = 2 < 4, total 4 >= 4 -> REPLACE (p=0, |t1|>p): t1's LRU 2 -> b1; t1 {3,4}
    # 5: |t1|+|b1| = 3 -> REPLACE: 3 -> b1 {2,3}; t1 {4,5}
    # 6: |t1|+|b1| = 4, |t1| < 4 -> drop b1's LRU (2); REPLACE: 4 -> b1 {3,4}; t1 {5,6}
    # 0 1 hit -> 4 hits, 7 misses
    p = ARC(4)
    assert run(p, SCAN) == (4, 7)
    a = p.layers[0]
    assert list(a.t1) == [5, 6] and list(a.t2) == [0, 1] and list(a.b1) == [3, 4] and a.p == 0
    # 3 again: a ghost in b1 -> p = min(4, 0 + max(|b2|/|b1|, 1)) = 1; REPLACE: |t1| = 2 > 1 ->
    # t1's LRU 5 -> b1; 3 enters t2
    assert p.access(0, [3]) == (0, 1)
    assert a.p == 1 and list(a.t1) == [6] and list(a.t2) == [0, 1, 3] and list(a.b1) == [4, 5]


def random_calls(seed, n_calls=400, n_layers=2, n_expert=12, max_distinct=3, skew=1.3):
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** skew for i in range(n_expert)]
    calls = []
    for _ in range(n_calls):
        layer = rng.randrange(n_layers)
        experts = list(dict.fromkeys(rng.choices(range(n_expert), weights, k=rng.randint(1, max_distinct))))
        calls.append((layer, experts))
    return calls


@pytest.mark.parametrize("seed", range(4))
def test_invariants_and_belady_bound_on_random_calls(seed):
    calls = random_calls(seed)
    accesses = sum(len(e) for _, e in calls)
    for slots in (3, 5, 8):
        belady = run(Belady(slots), calls)
        assert sum(belady) == accesses
        for cls in (LRU, LFU, LFUDecay, SLRU, ARC, LRFU):
            p = cls(slots)
            hits, misses = run(p, calls)
            assert hits + misses == accesses
            assert belady[1] <= misses, (cls.name, slots)  # nothing beats the optimum
            assert all(len(p.resident(lay)) <= slots for lay in {lay for lay, _ in calls})
            if isinstance(p, ARC):
                for a in p.layers.values():
                    assert len(a.t1) + len(a.t2) <= slots and len(a.t1) + len(a.b1) <= slots
                    assert len(a.t1) + len(a.t2) + len(a.b1) + len(a.b2) <= 2 * slots
            elif isinstance(p, SLRU):
                for probation, protected in p.layers.values():
                    assert len(probation) + len(protected) <= slots
        # g-lrfu (one budget for the layers): within its budget after every call, each layer
        # within its pool
        layers = sorted({lay for lay, _ in calls})
        g = GLRFU(slots, {lay: 100 for lay in layers}, n_expert=12, n_expert_used=1)
        for lay, experts in calls:
            if len(experts) > g.capacity():
                continue
            h, m = g.access(lay, experts)
            assert h + m == len(experts)
            assert g.bytes == 100 * sum(len(g.resident(x)) for x in layers)
            assert g.bytes <= max(g.budget, 100 * len(experts)) and len(g.resident(lay)) <= g.capacity()
        # every policy with as many slots as experts misses only the first use of each
        assert run(make_policy("arc", 12), calls)[1] == len({(il, e) for il, es in calls for e in es})


# ------------------------------------------------------------------------------------------------
# the replay driver on a hand-made trace


def hand_trace():
    """2 MoE layers (ids 1 and 3, 100 and 300 bytes per expert), top-1, 4 experts.
    Micro-batch 0: 3 prompt tokens; layer 3 (the last) ran only the last one.
    Micro-batches 1-3: one decode token each."""
    experts = np.array([[[0], [-1]],
                        [[1], [-1]],
                        [[2], [0]],
                        [[0], [0]],     # decode
                        [[3], [1]],     # decode
                        [[0], [0]]],    # decode
                       dtype=np.int16)
    return Trace(experts=experts, prompt=np.array([True, True, True, False, False, False]),
                 tokens=np.arange(6, dtype=np.int32), segment=np.array([0, 0, 0, 1, 1, 1], dtype=np.int32),
                 ubatch=np.array([3, 1, 1, 1], dtype=np.int32),
                 calls=np.array([[3, 1], [1, 1], [1, 1], [1, 1]], dtype=np.int32),
                 meta=dict(model="hand.gguf", architecture="test", n_expert=4, n_expert_used=1,
                           moe_layers=[1, 3], expert_bytes=[100, 300], recorded_with={}))


def test_build_calls_follows_the_recorded_micro_batches():
    calls, split = build_calls(hand_trace())
    assert split == 0
    assert [(c.layer, c.experts, c.counted) for c in calls] == [
        (1, [0, 1, 2], False), (3, [0], False),   # the prompt micro-batch: layer 3 ran token 2
        (1, [0], True), (3, [0], True),
        (1, [3], True), (3, [1], True),
        (1, [0], True), (3, [0], True)]
    # at most 2 tokens per micro-batch: tokens 0-1, then 2 (with the last layer's call)
    calls, split = build_calls(hand_trace(), max_tokens=2)
    assert split == 1
    assert [(c.layer, c.experts) for c in calls[:3]] == [(1, [0, 1]), (1, [2]), (3, [0])]


def test_replay_counts_decode_and_prices_misses():
    # LRU, 2 slots per layer, top-1: the prompt micro-batch runs in waves of one slot, as the
    # engine runs it (0, 1, then 2 in 0's slot).
    # layer 1: [0,1,2] m m m (2 evicts 0) | decode: [0] m (evicts 1), [3] m (evicts 2), [0] hit
    # layer 3: [0] m | decode: [0] hit, [1] m, [0] hit
    # decode: 3 hits, 3 misses -> 50 %; missed bytes 2 x 100 + 1 x 300 = 500 over 3 decode tokens
    report = replay(hand_trace(), sizes=[2], policies=["lru"], gbps=1.0)
    r = report["results"][0]
    assert (r["hits"], r["misses"], r["warm_hits"], r["warm_misses"]) == (3, 3, 0, 4)
    assert r["hit_rate"] == 0.5
    assert r["missed_bytes_per_token"] == pytest.approx(500 / 3)
    assert r["ceiling_tok_s"] == pytest.approx(1e9 / (500 / 3))
    assert r["n_split_ubatches"] == 0
    # a lab policy splits it instead (micro-batches of 2 tokens at most): the same counts here
    lfu = replay(hand_trace(), sizes=[2], policies=["lfu"])["results"][0]
    assert lfu["n_split_ubatches"] == 1 and (lfu["warm_hits"], lfu["warm_misses"]) == (0, 4)
    # with every expert resident after warm-up, decode still misses expert 3 of layer 1 and 1 of 3
    full = replay(hand_trace(), sizes=[4], policies=["belady"])["results"][0]
    assert (full["hits"], full["misses"]) == (4, 2)
    none = replay(hand_trace(), sizes=[4], policies=["lru"], count="all")["results"][0]
    assert none["hits"] + none["misses"] == 3 + 1 + 6 and not math.isinf(none["ceiling_tok_s"])


def test_a_guessed_expert_is_evicted_last():
    # LRU, 2 slots: 0 1 miss. A guess naming 0 (the least recent) makes [2] evict 1 instead; without
    # the guess 0 goes. The guess lasts one call: afterwards plain LRU again. The engine's own code.
    plain, guessed = LRU(2), LRU(2)
    for p in (plain, guessed):
        run(p, [[0], [1]])
    guessed.guess(0, [0, 5])
    assert plain.access(0, [2]) == guessed.access(0, [2]) == (0, 1)
    assert plain.resident(0) == {1, 2} and guessed.resident(0) == {0, 2}
    assert guessed.access(0, [3]) == (0, 1) and guessed.resident(0) == {2, 3}  # 0 was least recent


@pytest.mark.parametrize("policy", ["lru", "lfu-decay", "g-lru"])
def test_preload_order_keeps_the_first_longest(policy):
    # a profile's order [5, 3, 1] (most used first) into 3 slots: the first miss evicts 1, the next 3
    from empanel_gguf.engine.pools import LabPool

    lab = LabPool(policy, [3], 8, [100], budget_bytes=300)
    assert lab.preload({0: [5, 3, 1]}) == 3 and set(lab.slot_table(0)) == {5, 3, 1}
    assert lab.access(0, [7]) == (0, 1) and set(lab.slot_table(0)) == {5, 3, 7}
    assert lab.access(0, [6]) == (0, 1) and set(lab.slot_table(0)) == {5, 7, 6}
