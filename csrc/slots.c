// The slot tables of a layer: which expert each slot holds, which slot to evict (LRU, LFU with
// decay, g-lru), the recency list over every layer that g-lru and the live budget evict from,
// claiming and placing, and the accounting of guesses and read-ahead that the tables carry. No
// I/O: the remap (remap.c), the read-ahead (guess.c), preload (preload.c), the read batches
// (batch.c) and the policy lab all change the tables through these functions.
//
// Each paged layer has n_slots slots shared by its expert tensors (gate/up/down or gate_up/down):
// slot s of every tensor of the layer holds the same expert.

#include "slots.h"
#include "backend.h"
#include "util.h"
#include "state.h"

#include <stdlib.h>

// whether slot s holds an expert that the live gate-ahead guess named (evicted last)
static int slot_guessed(const struct empanel_layer * layer, int32_t s) {
    const int32_t e = layer->tables.expert_in[s];
    return layer->guess.live && e >= 0 && layer->guess.mark[e] == layer->guess.stamp;
}

// Empty slots (last_use 0, uses 0) go first under every policy; experts a live guess named go last.
//   LRU:       least recently used
//   LFU_DECAY: fewest uses (counts halve every n_slots micro-batches of the layer), then least recent
int32_t empanel_slots_pick_victim(const struct empanel_layer * layer, int32_t policy, int32_t begin, int32_t end,
                                  const uint64_t * mark, uint64_t taken) {
    const struct empanel_tables * tb = &layer->tables;
    int32_t  victim  = -1;
    int      guessed = 2;
    uint32_t fewest  = UINT32_MAX;
    uint64_t oldest  = UINT64_MAX;
    for (int32_t s = begin; s < end; s++) {
        if (mark[s] == taken) {
            continue;
        }
        const int      g    = slot_guessed(layer, s);
        const uint32_t uses = policy == EMPANEL_POLICY_LFU_DECAY ? tb->uses[s] : 0;
        if (g < guessed || (g == guessed && (uses < fewest || (uses == fewest && tb->last_use[s] < oldest)))) {
            guessed = g;
            fewest  = uses;
            oldest  = tb->last_use[s];
            victim  = s;
        }
    }
    return victim;
}

void empanel_slots_note_use(struct empanel_layer * layer, int32_t s, uint64_t call) {
    struct empanel_tables * tb = &layer->tables;
    tb->call_mark[s] = call;
    tb->last_use[s]  = call;
    tb->uses[s]     += tb->uses[s] < UINT32_MAX;
}

void empanel_slots_end_batch(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n_waves) {
    struct empanel_tables * tb = &layer->tables;
    layer->stats.n_remaps++;
    layer->stats.n_waves += (uint64_t) n_waves;
    tb->n_batches++;
    if (pool->config.policy == EMPANEL_POLICY_LFU_DECAY && tb->n_batches % (uint64_t) layer->n_slots == 0) {
        for (int32_t s = 0; s < layer->n_slots; s++) {
            tb->uses[s] /= 2;
        }
    }
}

void empanel_slots_hold_misses(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    struct empanel_tables * tb = &layer->tables;
    for (int32_t i = 0; i < n; i++) {
        tb->expert_in[tb->victims[i]] = tb->misses[i];
        tb->slot_of[tb->misses[i]]    = tb->victims[i];
        empanel_slots_recent_push(pool, layer->lru_base + tb->victims[i]);
    }
}

void empanel_slots_use_hit(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call) {
    empanel_slots_note_use(layer, s, call);
    layer->stats.hits++;
    if (layer->guess.prefetch_mark[s] != 0) { // read ahead and routed: used, counted now (a later
        layer->stats.prefetch_used++;         // wave of the plan may give its slot to another expert)
        layer->guess.prefetch_mark[s] = 0;
    }
    empanel_slots_recent_unlink(pool, layer->lru_base + s);
    empanel_slots_recent_push(pool, layer->lru_base + s);
}

void empanel_slots_claim(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call) {
    struct empanel_tables * tb = &layer->tables;
    empanel_slots_drop_prefetch(layer, s);
    if (tb->expert_in[s] >= 0) {
        // the layer's own expert goes (its bytes stay counted for the one that comes)
        tb->slot_of[tb->expert_in[s]] = -1;
        empanel_slots_recent_unlink(pool, layer->lru_base + s);
    } else {
        empanel_slots_make_room(pool, layer->expert_bytes, call);
        pool->budget.resident_bytes += layer->expert_bytes;
    }
    tb->expert_in[s] = -1;
    tb->uses[s]      = 0;
    empanel_slots_note_use(layer, s, call);
}

void empanel_slots_place(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, int32_t e, uint64_t call) {
    struct empanel_tables * tb = &layer->tables;
    empanel_slots_claim(pool, layer, s, call);
    tb->expert_in[s] = e;
    tb->slot_of[e]   = s;
    empanel_slots_recent_push(pool, layer->lru_base + s);
}

void empanel_slots_sort_file_order(struct empanel_layer * layer, int32_t n) {
    struct empanel_tables * tb = &layer->tables;
    for (int32_t i = 0; i < n; i++) {
        tb->order_key[i] = (uint64_t) tb->misses[i] << 32 | (uint32_t) tb->victims[i];
    }
    qsort(tb->order_key, (size_t) n, sizeof(uint64_t), empanel_util_compare_uint64);
    for (int32_t i = 0; i < n; i++) {
        tb->misses[i]  = (int32_t) (tb->order_key[i] >> 32);
        tb->victims[i] = (int32_t) (tb->order_key[i] & 0xffffffffu);
    }
}

// the pages of host tensor t's slots [begin, end) back to the kernel, the slots holding nothing;
// 1 if the kernel refused them (pinned memory)
static int release_run(struct empanel_tensor * t, int32_t begin, int32_t end) {
    for (int32_t s = begin; s < end; s++) {
        t->held[s] = -1;
    }
    return empanel_backend_memory_release(t->host + (uint64_t) begin * t->expert_size,
                                          (uint64_t) (end - begin) * t->expert_size, 0) < 0;
}

int empanel_slots_release(struct empanel_layer * layer, int32_t slot) {
    int refused = 0;
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        if (layer->tensors[i].host != NULL) {
            refused |= release_run(&layer->tensors[i], slot, slot + 1);
        }
    }
    return refused ? -1 : 0;
}

// ------------------------------------------------------------------------------------------------
// the recency list of all layers and the budget

void empanel_slots_recent_unlink(struct empanel_pool * pool, int32_t e) {
    const int32_t prev = pool->budget.prev[e];
    const int32_t next = pool->budget.next[e];
    if (prev >= 0) { pool->budget.next[prev] = next; } else { pool->budget.head = next; }
    if (next >= 0) { pool->budget.prev[next] = prev; } else { pool->budget.tail = prev; }
}

void empanel_slots_recent_push(struct empanel_pool * pool, int32_t e) {
    pool->budget.prev[e] = pool->budget.tail;
    pool->budget.next[e] = -1;
    if (pool->budget.tail >= 0) { pool->budget.next[pool->budget.tail] = e; } else { pool->budget.head = e; }
    pool->budget.tail = e;
}

// entry e may leave its slot now: not a slot of `keep` (the call claiming room) nor of the layer
// computing now (busy_call), not in a layer whose waves still run (its plan counts on its slots)
// or with reads in flight (they would land in the released pages)
static int evictable(const struct empanel_pool * pool, int32_t e, uint64_t keep) {
    const struct empanel_layer * layer = &pool->layers[pool->budget.entry_layer[e]];
    const uint64_t mark = layer->tables.call_mark[e - layer->lru_base];
    if (mark == keep || mark == pool->budget.busy_call || layer->waves.open) {
        return 0;
    }
    for (int32_t lane = 0; lane < EMPANEL_N_LANES; lane++) {
        if (pool->lanes.batch[lane].inflight && pool->lanes.batch[lane].layer == layer) {
            return 0;
        }
    }
    return 1;
}

// a host slot a shrink emptied, its pages not yet given back (release_pending gives them back
// before the shrink returns, so nothing else ever sees it)
#define SLOT_RELEASE_PENDING (-2)

// slot s of the layer, which the tables say holds an expert, holds nothing from now on: the
// tables forget it (taken first by its layer), the budget no longer counts it and its pages go
// back to the kernel (host pools): now, or with defer marked for release_pending; -1 if the
// kernel refused them (pinned memory), else 0
static int empty_slot(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, int defer) {
    struct empanel_tables * tb = &layer->tables;
    empanel_slots_recent_unlink(pool, layer->lru_base + s);
    tb->slot_of[tb->expert_in[s]] = -1;
    tb->expert_in[s] = -1;
    tb->last_use[s]  = 0;
    tb->uses[s]      = 0;
    pool->budget.resident_bytes -= layer->expert_bytes;
    empanel_slots_drop_prefetch(layer, s);
    if (defer) {
        for (int32_t i = 0; i < layer->n_tensors; i++) {
            if (layer->tensors[i].host != NULL) {
                layer->tensors[i].held[s] = SLOT_RELEASE_PENDING;
            }
        }
        return 0;
    }
    return empanel_slots_release(layer, s);
}

// entry e leaves its slot (empty_slot); bytes freed while over the budget count as given back
// where the kernel took the pages (deferred: counted by release_pending)
static void evict(struct empanel_pool * pool, int32_t e, int defer) {
    struct empanel_layer * layer = &pool->layers[pool->budget.entry_layer[e]];
    const int over = pool->budget.resident_bytes > pool->budget.bytes;
    if (empty_slot(pool, layer, e - layer->lru_base, defer) == 0 && over && !defer) {
        pool->budget.given_back_bytes += layer->expert_bytes;
    }
}

// the pages of the slots a shrink emptied, given back per tensor in runs of adjacent slots, one
// madvise a run: a call per slot took 149 ms for 1.7 GiB of 884,736-byte slots while another
// thread of the process ran (each call shoots down its TLB), one call for all 80 ms. Each
// layer's released slots count as given back unless the kernel refused them
static void release_pending(struct empanel_pool * pool) {
    for (int32_t il = 0; il < pool->n_layer; il++) {
        struct empanel_layer * layer = &pool->layers[il];
        int32_t n_released = 0;
        int     refused    = 0;
        for (int32_t i = 0; i < layer->n_tensors; i++) {
            struct empanel_tensor * t = &layer->tensors[i];
            if (t->host == NULL) {
                continue;
            }
            int32_t n_tensor = 0;
            for (int32_t s = 0; s < layer->n_slots; ) {
                if (t->held[s] != SLOT_RELEASE_PENDING) {
                    s++;
                    continue;
                }
                int32_t end = s + 1;
                while (end < layer->n_slots && t->held[end] == SLOT_RELEASE_PENDING) {
                    end++;
                }
                refused  |= release_run(t, s, end);
                n_tensor += end - s;
                s = end;
            }
            n_released = n_tensor > n_released ? n_tensor : n_released;
        }
        if (!refused) {
            pool->budget.given_back_bytes += (uint64_t) n_released * layer->expert_bytes;
        }
    }
}

// evict least recent experts of any layer that may leave (evictable) until `need` more bytes fit
// in the budget; the budget yields where none may. A shrink (need 0: every eviction is over the
// budget) gives the pages back together at the end (release_pending). Bytes emptied
static uint64_t fit_budget(struct empanel_pool * pool, uint64_t need, uint64_t keep) {
    const uint64_t before = pool->budget.resident_bytes;
    const int      defer  = need == 0;
    int32_t e = pool->budget.head;
    while (e >= 0 && pool->budget.resident_bytes + need > pool->budget.bytes) {
        const int32_t next = pool->budget.next[e];
        if (evictable(pool, e, keep)) {
            evict(pool, e, defer);
        }
        e = next;
    }
    if (defer && before > pool->budget.resident_bytes) {
        release_pending(pool);
    }
    const uint64_t after = pool->budget.resident_bytes + need; // what the budget will hold
    if (after > pool->budget.bytes && after - pool->budget.bytes > pool->budget.max_over_bytes) {
        pool->budget.max_over_bytes = after - pool->budget.bytes;
    }
    return before - pool->budget.resident_bytes;
}

void empanel_slots_make_room(struct empanel_pool * pool, uint64_t need, uint64_t call) {
    fit_budget(pool, need, call);
}

uint64_t empanel_slots_shrink(struct empanel_pool * pool) {
    return fit_budget(pool, 0, pool->budget.busy_call);
}

// ------------------------------------------------------------------------------------------------
// what the tables say of guesses and read-ahead

void empanel_slots_drop_prefetch(struct empanel_layer * layer, int32_t s) {
    if (layer->guess.prefetch_mark[s] != 0) {
        layer->stats.prefetch_wasted += layer->expert_bytes;
        layer->guess.prefetch_mark[s] = 0;
    }
}

void empanel_slots_close_guess(struct empanel_layer * layer, int32_t n) {
    struct empanel_guess_state * g = &layer->guess;
    if (g->live) {
        layer->stats.guessed      += (uint64_t) g->n;
        layer->stats.guess_routed += (uint64_t) n;
        for (int32_t i = 0; i < n; i++) {
            layer->stats.guess_hits += g->mark[layer->tables.distinct[i]] == g->stamp;
        }
        g->live = 0;
    }
    // read-ahead slots still marked were not routed (a routed one counted as used at its hit,
    // empanel_slots_use_hit; one whose slot was taken was dropped then): wasted
    for (int32_t s = 0; s < layer->n_slots; s++) {
        empanel_slots_drop_prefetch(layer, s);
    }
}

void empanel_slots_reconcile(struct empanel_pool * pool, struct empanel_layer * layer) {
    struct empanel_tables * tb = &layer->tables;
    for (int32_t s = 0; s < layer->n_slots; s++) {
        const int32_t e = tb->expert_in[s];
        int held = e >= 0;
        for (int32_t i = 0; held && i < layer->n_tensors; i++) {
            held = layer->tensors[i].held[s] == e;
        }
        if (e >= 0 && !held) {
            (void) empty_slot(pool, layer, s, 0); // the budget no longer counts it: neither does memory
        }
    }
    layer->waves.open        = 0;
    layer->guess.prefetch_open = 0;
    layer->ready.reads_open  = 0;
}
