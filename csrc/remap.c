// The remap: which slots a micro-batch's experts take in one layer, what to evict, what to read.
//
// A remap call handles one micro-batch of one layer: hits keep their slots, misses take the slots
// the policy gives up (none that this micro-batch uses) and are read from the file. A micro-batch
// that routes to more distinct experts than the pool holds runs in waves (plan_waves), one call
// per wave and pool tensor (remap_wave_locked). Error recovery changes the same tables; preload
// (preload.c) and the gate-ahead guess (guess.c) use the helpers declared in empanel-impl.h.

#include "empanel.h"
#include "empanel-impl.h"

#include "llama-empanel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// whether slot s holds an expert that the live gate-ahead guess named (evicted last)
static int slot_guessed(const struct empanel_layer * layer, int32_t s) {
    const int32_t e = layer->expert_in[s];
    return layer->guess_live && e >= 0 && layer->guess_mark[e] == layer->guess_stamp;
}

// the slot in [begin, end) to evict, among those whose mark is not `taken`, -1 if none. Empty
// slots (last_use 0, uses 0) go first under every policy; experts a live guess named go last.
//   LRU:       least recently used
//   LFU_DECAY: fewest uses (counts halve every n_slots micro-batches of the layer), then least recent
int32_t empanel_pick_victim(const struct empanel_layer * layer, int32_t policy, int32_t begin, int32_t end,
                           const uint64_t * mark, uint64_t taken) {
    int32_t  victim  = -1;
    int      guessed = 2;
    uint32_t fewest  = UINT32_MAX;
    uint64_t oldest  = UINT64_MAX;
    for (int32_t s = begin; s < end; s++) {
        if (mark[s] == taken) {
            continue;
        }
        const int      g    = slot_guessed(layer, s);
        const uint32_t uses = policy == EMPANEL_POLICY_LFU_DECAY ? layer->uses[s] : 0;
        if (g < guessed || (g == guessed && (uses < fewest || (uses == fewest && layer->last_use[s] < oldest)))) {
            guessed = g;
            fewest  = uses;
            oldest  = layer->last_use[s];
            victim  = s;
        }
    }
    return victim;
}

void empanel_note_use(struct empanel_layer * layer, int32_t s, uint64_t call) {
    layer->call_mark[s] = call;
    layer->last_use[s]  = call;
    layer->uses[s]     += layer->uses[s] < UINT32_MAX;
}

// one micro-batch done: the decay clock ticks (the layer's own, not its statistics)
static void end_batch(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n_waves) {
    layer->stats.n_remaps++;
    layer->stats.n_waves += (uint64_t) n_waves;
    layer->n_batches++;
    if (pool->policy == EMPANEL_POLICY_LFU_DECAY && layer->n_batches % (uint64_t) layer->n_slots == 0) {
        for (int32_t s = 0; s < layer->n_slots; s++) {
            layer->uses[s] /= 2;
        }
    }
}

int empanel_trace_call(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                      int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    const uint64_t need = pool->trace_len + 3 + (uint64_t) n_tokens * n_used;
    if (need > pool->trace_cap) {
        uint64_t cap = pool->trace_cap ? pool->trace_cap : 1 << 16;
        while (cap < need) {
            cap *= 2;
        }
        int32_t * grown = realloc(pool->trace, sizeof(int32_t) * cap);
        if (grown == NULL) {
            empanel_set_error(pool, "trace: out of memory for %llu entries", (unsigned long long) cap);
            return -1;
        }
        pool->trace     = grown;
        pool->trace_cap = cap;
    }
    int32_t * out = pool->trace + pool->trace_len;
    *out++ = il;
    *out++ = n_tokens;
    *out++ = n_used;
    for (int32_t t = 0; t < n_tokens; t++) {
        memcpy(out, expert_ids + (int64_t) t * ids_row_stride, sizeof(int32_t) * n_used);
        out += n_used;
    }
    pool->trace_len = need;
    return 0;
}

// the tables say that experts layer->misses[0, n) are in slots layer->victims[0, n)
static void hold_misses(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        layer->expert_in[layer->victims[i]] = layer->misses[i];
        layer->slot_of[layer->misses[i]]    = layer->victims[i];
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            empanel_lru_push_recent(pool, layer->lru_base + layer->victims[i]);
        }
    }
}

// read experts layer->misses[0, n) into the claimed, empty slots layer->victims[0, n) and make
// them resident; if a read fails the slots stay empty (g-lru: their bytes leave the budget)
int empanel_fill_slots(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    if (!pool->lab && empanel_read_experts(pool, layer, layer->misses, layer->victims, n) != 0) {
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            pool->resident_bytes -= (uint64_t) n * layer->expert_bytes;
        }
        return -1;
    }
    hold_misses(pool, layer, n);
    return 0;
}

// the misses of a micro-batch may be read while the layer computes: every tensor's MUL_MAT_ID
// waited for its own reads last time (empanel_ready), and its pools are plain host memory that
// the reads land in. CPU_REPACK pools are not: their readers repack every expert, and on two
// cores that CPU taken from the compute cost more than the overlap gave (decode 1.0 vs 1.5 t/s
// on the 48-layer 30B shape under the cap, docs/performance.md)
static int overlap_reads(const struct empanel_pool * pool, const struct empanel_layer * layer) {
    if (!layer->ready_armed || pool->lab || pool->inflight) {
        return 0;
    }
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        const struct empanel_tensor * t = &layer->tensors[i];
        if (!t->direct || t->remote) {
            return 0;
        }
    }
    return 1;
}

// as empanel_fill_slots, but the reads are posted, not waited for: each tensor's MUL_MAT_ID waits
// for its own (empanel_ready; the tensors are read in the order the graph computes them), and the
// tables say where the experts will be. A failed read empties their slots again (reconcile)
static int fill_slots_overlapped(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    int32_t order[EMPANEL_MAX_TENSORS];
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        order[layer->ready_rank[i]] = i; // ranks 0 .. n_tensors - 1: every tensor's call was seen
    }
    if (empanel_read_post_layer(pool, layer, layer->misses, layer->victims, n, order) != 0) {
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            pool->resident_bytes -= (uint64_t) n * layer->expert_bytes;
        }
        return -1;
    }
    hold_misses(pool, layer, n);
    layer->reads_open = 1;
    layer->stats.overlapped++;
    return 0;
}

// the layer, or NULL with the error recorded
static struct empanel_layer * remap_layer(struct empanel_pool * pool, int32_t il) {
    if (atomic_load(&pool->failed)) {
        return NULL;
    }
    if (il < 0 || il >= pool->n_layer || (pool->layers[il].n_slots == 0 && !pool->layers[il].observe)) {
        empanel_set_error(pool, "remap: layer %d has no slot pool", il);
        return NULL;
    }
    return &pool->layers[il];
}

// the distinct experts of a micro-batch in order of first use, into layer->distinct; their
// number, or -1 if an id is out of range
static int32_t collect_distinct(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il, uint64_t call,
                                const int32_t * expert_ids, int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    int32_t n = 0;
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            if (e < 0 || e >= pool->n_expert) {
                empanel_set_error(pool, "remap: layer %d routed to expert %d of %d", il, e, pool->n_expert);
                return -1;
            }
            if (layer->miss_mark[e] != call) {
                layer->miss_mark[e] = call;
                layer->distinct[n++] = e;
            }
        }
    }
    layer->stats.n_ids += (uint64_t) n_tokens * (uint64_t) n_used;
    return n;
}

// a hit: the expert stays where it is, and is used now
static void use_hit(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call) {
    empanel_note_use(layer, s, call);
    layer->stats.hits++;
    if (pool->policy == EMPANEL_POLICY_GLRU) {
        empanel_lru_unlink(pool, layer->lru_base + s);
        empanel_lru_push_recent(pool, layer->lru_base + s);
    }
}

// claim slot s for an expert that comes: its expert leaves (g-lru: an empty slot takes room in
// the budget from the least recent expert of any layer)
static void claim_slot(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call) {
    empanel_prefetch_drop(layer, s);
    if (layer->expert_in[s] >= 0) {
        // the layer's own expert goes (its bytes stay counted for the one that comes)
        layer->slot_of[layer->expert_in[s]] = -1;
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            empanel_lru_unlink(pool, layer->lru_base + s);
        }
    } else if (pool->policy == EMPANEL_POLICY_GLRU) {
        empanel_glru_make_room(pool, layer->expert_bytes, call);
        pool->resident_bytes += layer->expert_bytes;
    }
    layer->expert_in[s] = -1;
    layer->uses[s]      = 0;
    empanel_note_use(layer, s, call);
}

static int compare_int32(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a;
    const int32_t y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

int empanel_compare_uint64(const void * a, const void * b) {
    const uint64_t x = *(const uint64_t *) a;
    const uint64_t y = *(const uint64_t *) b;
    return (x > y) - (x < y);
}

// expert e takes slot s (claimed for `call`): the tables say it is there from now on, its bytes
// come with the reads that follow
void empanel_place_expert(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, int32_t e, uint64_t call) {
    claim_slot(pool, layer, s, call);
    layer->expert_in[s] = e;
    layer->slot_of[e]   = s;
    if (pool->policy == EMPANEL_POLICY_GLRU) {
        empanel_lru_push_recent(pool, layer->lru_base + s);
    }
}

// misses[0, n) -> victims[0, n) reordered by expert id: reads in file order
void empanel_sort_file_order(struct empanel_layer * layer, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        layer->order_key[i] = (uint64_t) layer->misses[i] << 32 | (uint32_t) layer->victims[i];
    }
    qsort(layer->order_key, (size_t) n, sizeof(uint64_t), empanel_compare_uint64);
    for (int32_t i = 0; i < n; i++) {
        layer->misses[i]  = (int32_t) (layer->order_key[i] >> 32);
        layer->victims[i] = (int32_t) (layer->order_key[i] & 0xffffffffu);
    }
}

// the n distinct experts: hits are used where they are, misses listed in layer->misses; the
// number of misses
static int32_t split_hits(struct empanel_pool * pool, struct empanel_layer * layer, uint64_t call, int32_t n) {
    int32_t n_miss = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = layer->distinct[i];
        if (layer->slot_of[e] >= 0) {
            use_hit(pool, layer, layer->slot_of[e], call);
        } else {
            layer->misses[n_miss++] = e;
        }
    }
    return n_miss;
}

// the n distinct experts fit the pool: hits keep their slots, misses take the slots the policy
// gives up (none that this micro-batch uses) and are read, every tensor at once (overlap: a
// one-wave graph's remap, whose MUL_MAT_IDs may wait for their reads; else they are waited for)
static int resolve_one_wave(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il, uint64_t call, int32_t n,
                            int overlap) {
    const int32_t n_miss = split_hits(pool, layer, call, n);
    // victims first: every slot is empty until all misses are read (a failed read leaves no
    // slot claiming an expert it does not hold)
    for (int32_t i = 0; i < n_miss; i++) {
        const int32_t s = empanel_pick_victim(layer, pool->policy, 0, layer->n_slots, layer->call_mark, call);
        if (s < 0) {
            empanel_set_error(pool,
                "remap: layer %d: this micro-batch routes to more distinct experts than the %d slots "
                "(lower n_ubatch, or raise moe_slots)", il, layer->n_slots);
            return -1;
        }
        claim_slot(pool, layer, s, call);
        layer->victims[i] = s;
    }
    if (n_miss > 0 && (overlap && overlap_reads(pool, layer) ? fill_slots_overlapped(pool, layer, n_miss)
                                                          : empanel_fill_slots(pool, layer, n_miss)) != 0) {
        return -1;
    }
    layer->stats.misses += (uint64_t) n_miss;
    return 0;
}

// the n distinct experts exceed the pool: plan waves of at most half a pool each, alternating
// halves, so that one half is read while the other computes. Hits go in the first wave of their
// half (no read); the misses follow by their last use in the micro-batch, so the last two waves,
// which stay resident, hold the experts of its last tokens (decoding goes on from there), and
// each wave is read in file order (expert ids ascending). The tables are left as they will be
// after the last wave; the reads happen wave by wave (remap_wave_locked).
static int plan_waves(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il, uint64_t call,
                      int32_t n, int32_t graph_waves, const int32_t * expert_ids, int64_t ids_row_stride,
                      int32_t n_used, int32_t n_tokens) {
    const int32_t n_slots = layer->n_slots;
    const int32_t n_half  = n_slots >= 2 ? 2 : 1;
    const int32_t split   = n_half == 2 ? llama_empanel_wave_experts(n_slots) : n_slots;
    const int32_t half_begin[2] = { 0, split };
    const int32_t half_end[2]   = { split, n_slots };

    for (int32_t i = 0; i < n; i++) {
        layer->plan_wave[layer->distinct[i]] = -1;
    }
    const int32_t n_miss = split_hits(pool, layer, call, n);
    // last use of every expert: the token index (victims is free scratch here)
    int32_t * last_use = layer->victims;
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            last_use[row[j]] = t;
        }
    }
    for (int32_t i = 0; i < n_miss; i++) {
        const int32_t e = layer->misses[i];
        layer->order_key[i] = (uint64_t) last_use[e] * (uint64_t) pool->n_expert + (uint64_t) e;
    }
    qsort(layer->order_key, (size_t) n_miss, sizeof(uint64_t), empanel_compare_uint64);
    for (int32_t i = 0; i < n_miss; i++) {
        layer->misses[i] = (int32_t) (layer->order_key[i] % (uint64_t) pool->n_expert);
    }
    layer->stats.misses += (uint64_t) n_miss;

    int32_t n_order = 0; // experts placed
    int32_t next    = 0; // next miss to place
    int32_t w       = 0;
    for (; next < n_miss || w < n_half; w++) {
        if (w >= graph_waves) {
            empanel_set_error(pool, "remap: layer %d: %d distinct experts need more than the graph's %d waves",
                              il, n, graph_waves);
            return -1;
        }
        const int32_t  h     = w % n_half;
        const uint64_t stamp = ++layer->wave_stamp;
        layer->plan_begin[w] = n_order;
        int32_t count = 0;
        for (int32_t i = 0; w < n_half && i < n; i++) {
            const int32_t e = layer->distinct[i];
            const int32_t s = layer->slot_of[e];
            if (layer->plan_wave[e] < 0 && s >= half_begin[h] && s < half_end[h]) {
                layer->plan_wave[e] = w;   // a hit of this half
                layer->plan_slot[e] = s;
                layer->wave_mark[s] = stamp;
                layer->plan_order[n_order++] = e;
                count++;
            }
        }
        for (; count < half_end[h] - half_begin[h] && next < n_miss; count++) {
            const int32_t s = empanel_pick_victim(layer, pool->policy, half_begin[h], half_end[h], layer->wave_mark, stamp);
            if (s < 0) { // the half has room for count < its size experts: never, unless the tables are wrong
                empanel_set_error(pool, "remap: layer %d: wave %d found no slot for its expert in slots [%d, %d)",
                                  il, w, half_begin[h], half_end[h]);
                return -1;
            }
            const int32_t e = layer->misses[next++];
            empanel_place_expert(pool, layer, s, e, call);
            layer->plan_wave[e] = w;
            layer->plan_slot[e] = s;
            layer->wave_mark[s] = stamp;
            layer->plan_order[n_order++] = e;
        }
        // read in file order
        qsort(layer->plan_order + layer->plan_begin[w], (size_t) (n_order - layer->plan_begin[w]),
              sizeof(int32_t), compare_int32);
    }
    layer->plan_begin[w] = n_order;
    layer->plan_waves    = w;
    return 0;
}

// a plan that did not run to its end (a failure, an aborted graph): slots whose tensors do not
// all hold the expert the tables say are emptied
static void reconcile(struct empanel_pool * pool, struct empanel_layer * layer) {
    for (int32_t s = 0; s < layer->n_slots; s++) {
        const int32_t e = layer->expert_in[s];
        int held = e >= 0;
        for (int32_t i = 0; held && i < layer->n_tensors; i++) {
            held = layer->tensors[i].held[s] == e;
        }
        if (e < 0 || held) {
            continue;
        }
        layer->slot_of[e]   = -1;
        layer->expert_in[s] = -1;
        layer->uses[s]      = 0;
        layer->last_use[s]  = 0;
        empanel_prefetch_drop(layer, s);
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            empanel_lru_unlink(pool, layer->lru_base + s);
            pool->resident_bytes -= layer->expert_bytes;
            empanel_slot_release(layer, s); // the budget no longer counts it: neither does memory
        }
    }
    layer->plan_open     = 0;
    layer->prefetch_open = 0;
    layer->reads_open    = 0;
}

// pool == NULL: the micro-batch fits the pools; one remap for all the layer's tensors
static int32_t remap_locked(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                            int64_t ids_row_stride, int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_layer * layer = remap_layer(pool, il);
    pool->deferred_guess = NULL; // a read-ahead not posted by now comes too late
    if (layer == NULL) {
        return -1;
    }
    empanel_prefetch_drop_unrouted(pool, layer, expert_ids, ids_row_stride, n_used, n_tokens);
    if (empanel_read_finish(pool) != 0) {
        return -1;
    }
    const uint64_t call = ++pool->call;
    if (pool->tracing && empanel_trace_call(pool, il, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
        return -1;
    }
    if (layer->observe) {
        for (int32_t t = 0; t < n_tokens; t++) {
            memcpy(slot_ids + (int64_t) t * n_used, expert_ids + (int64_t) t * ids_row_stride, sizeof(int32_t) * n_used);
        }
        layer->stats.n_remaps++;
        layer->stats.n_ids += (uint64_t) n_tokens * (uint64_t) n_used;
        return 0;
    }
    if (layer->plan_open || layer->prefetch_open || layer->reads_open) {
        reconcile(pool, layer);
    }
    // every tensor's MUL_MAT_ID waited for its reads after the layer's last remap (the graph has
    // its ready ops): this micro-batch's reads may overlap the layer's compute
    layer->ready_armed = empanel_ready_all_seen(layer);
    layer->ready_seen  = 0;
    layer->ready_next  = 0;
    const int32_t n = collect_distinct(pool, layer, il, call, expert_ids, ids_row_stride, n_used, n_tokens);
    if (n < 0 || resolve_one_wave(pool, layer, il, call, n, 1) != 0) {
        return -1;
    }
    empanel_guess_close(layer, n, call);
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            slot_ids[(int64_t) t * n_used + j] = layer->slot_of[row[j]];
        }
    }
    end_batch(pool, layer, 1);
    return 0;
}

// the calls of a plan carry the micro-batch's expert ids: the same ids as the open plan's
static int same_ids(const struct empanel_layer * layer, const int32_t * expert_ids, int64_t ids_row_stride,
                    int32_t n_used, int32_t n_tokens) {
    if (layer->plan_n_ids != (int64_t) n_tokens * n_used) {
        return 0;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        if (memcmp(layer->plan_ids + (int64_t) t * n_used, expert_ids + (int64_t) t * ids_row_stride,
                   sizeof(int32_t) * n_used) != 0) {
            return 0;
        }
    }
    return 1;
}

static int keep_ids(struct empanel_pool * pool, struct empanel_layer * layer, const int32_t * expert_ids,
                    int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    const int64_t n_ids = (int64_t) n_tokens * n_used;
    if (n_ids > layer->plan_ids_cap) {
        int32_t * grown = realloc(layer->plan_ids, sizeof(int32_t) * (size_t) n_ids);
        if (grown == NULL) {
            empanel_set_error(pool, "remap: out of memory for %lld expert ids", (long long) n_ids);
            return -1;
        }
        layer->plan_ids     = grown;
        layer->plan_ids_cap = n_ids;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        memcpy(layer->plan_ids + (int64_t) t * n_used, expert_ids + (int64_t) t * ids_row_stride, sizeof(int32_t) * n_used);
    }
    layer->plan_n_ids = n_ids;
    return 0;
}

// the experts of wave w that tensor ti's slots do not hold yet, into layer->misses / victims
static int32_t wave_missing(struct empanel_layer * layer, int32_t ti, int32_t w) {
    if (w >= layer->plan_waves) {
        return 0;
    }
    const int32_t * held = layer->tensors[ti].held;
    int32_t n = 0;
    for (int32_t k = layer->plan_begin[w]; k < layer->plan_begin[w + 1]; k++) {
        const int32_t e = layer->plan_order[k];
        const int32_t s = layer->plan_slot[e];
        if (held[s] != e) {
            layer->misses[n]  = e;
            layer->victims[n] = s;
            n++;
        }
    }
    return n;
}

// one wave of one pool tensor: plan the micro-batch at its layer's first call, make the wave's
// experts resident in this tensor, give their pairs slot ids (others -1), and start reading what
// comes next while this wave computes
static int32_t remap_wave_locked(struct empanel_pool * pool, int32_t il, const void * pool_tensor, int32_t wave,
                                 int32_t n_waves, const int32_t * expert_ids, int64_t ids_row_stride,
                                 int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_layer * layer = remap_layer(pool, il);
    pool->deferred_guess = NULL;
    if (layer == NULL || empanel_read_finish(pool) != 0) {
        return -1;
    }
    const int32_t ti = empanel_tensor_index(layer, pool_tensor);
    if (ti < 0 || layer->observe) {
        empanel_set_error(pool, "remap: layer %d has no pool tensor %p", il, pool_tensor);
        return -1;
    }

    const int continues = layer->plan_open && layer->plan_graph_waves == n_waves && layer->plan_next[ti] == wave &&
                          same_ids(layer, expert_ids, ids_row_stride, n_used, n_tokens);
    if (!continues) {
        if (wave != 0) {
            empanel_set_error(pool, "remap: layer %d, %s: wave %d of %d out of order", il,
                              layer->tensors[ti].name, wave, n_waves);
            return -1;
        }
        if (layer->plan_open || layer->prefetch_open || layer->reads_open) {
            reconcile(pool, layer);
        }
        const uint64_t call = ++pool->call;
        if (pool->tracing && empanel_trace_call(pool, il, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
            return -1;
        }
        if (keep_ids(pool, layer, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
            return -1;
        }
        const int32_t n = collect_distinct(pool, layer, il, call, expert_ids, ids_row_stride, n_used, n_tokens);
        if (n < 0) {
            return -1;
        }
        layer->plan_open        = 1; // from here on the tables describe the plan's end
        layer->plan_graph_waves = n_waves;
        for (int32_t i = 0; i < EMPANEL_MAX_TENSORS; i++) {
            layer->plan_next[i] = 0;
        }
        if (n <= layer->n_slots) {
            // it fits: one wave, read for every tensor at once
            if (resolve_one_wave(pool, layer, il, call, n, 0) != 0) {
                return -1;
            }
            for (int32_t i = 0; i < n; i++) {
                const int32_t e = layer->distinct[i];
                layer->plan_wave[e]  = 0;
                layer->plan_slot[e]  = layer->slot_of[e];
                layer->plan_order[i] = e;
            }
            layer->plan_begin[0] = 0;
            layer->plan_begin[1] = n;
            layer->plan_waves    = 1;
        } else if (plan_waves(pool, layer, il, call, n, n_waves, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
            return -1;
        }
        empanel_guess_close(layer, n, call);
        end_batch(pool, layer, layer->plan_waves);
    }

    // this wave's experts in this tensor's slots (normally read while the previous wave computed)
    const int32_t n_missing = wave_missing(layer, ti, wave);
    if (n_missing > 0 && (empanel_read_post(pool, layer, ti, layer->misses, layer->victims, n_missing) != 0 ||
                          empanel_read_finish(pool) != 0)) {
        return -1;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            slot_ids[(int64_t) t * n_used + j] = layer->plan_wave[e] == wave ? layer->plan_slot[e] : -1;
        }
    }
    layer->plan_next[ti] = wave + 1;

    // read ahead: this tensor's next wave goes to the other half of its pool (free: the wave
    // before this one has computed), unless reads land in slots that this wave's masked kernel
    // reads; after its last wave, the first wave of a tensor that has not started (its pool is
    // idle)
    int32_t next_tensor = -1;
    int32_t next_wave   = 0;
    if (wave + 1 < layer->plan_waves) {
        if (layer->n_slots >= 2 && !(layer->tensors[ti].masked && layer->tensors[ti].direct)) {
            next_tensor = ti;
            next_wave   = wave + 1;
        }
    } else {
        for (int32_t i = 0; i < layer->n_tensors && next_tensor < 0; i++) {
            next_tensor = layer->plan_next[i] == 0 ? i : -1;
        }
    }
    if (next_tensor >= 0) {
        const int32_t n_ahead = wave_missing(layer, next_tensor, next_wave);
        if (n_ahead > 0 && empanel_read_post(pool, layer, next_tensor, layer->misses, layer->victims, n_ahead) != 0) {
            return -1;
        }
    }

    int open = 0;
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        open |= layer->plan_next[i] < layer->plan_graph_waves;
    }
    layer->plan_open = open;
    return 0;
}

int32_t empanel_remap(void * user, int32_t il, const void * pool_tensor, int32_t wave, int32_t n_waves,
                      const int32_t * expert_ids, int64_t ids_row_stride,
                      int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_pool * pool = user;
    const uint64_t t0 = empanel_now_ns();
    pthread_mutex_lock(&pool->lock);
    // every call looks at the files first: a write anywhere in them (the mapped dense tensors
    // too) fails the next decode, whether or not it misses
    const int32_t rc = empanel_files_check(pool) != 0 ? -1 : pool_tensor == NULL
        ? remap_locked(pool, il, expert_ids, ids_row_stride, slot_ids, n_used, n_tokens)
        : remap_wave_locked(pool, il, pool_tensor, wave, n_waves, expert_ids, ids_row_stride, slot_ids, n_used, n_tokens);
    if (rc != 0) {
        empanel_read_finish(pool); // nothing stays in flight after a failure
    }
    if (il >= 0 && il < pool->n_layer) {
        pool->layers[il].stats.remap_ns     += empanel_now_ns() - t0;
        pool->layers[il].stats.device_syncs += (uint64_t) pool->layers[il].device;
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}

void empanel_pool_clear_error(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    // a batch still in flight (the graph stopped before waiting for it) ends here, its slots
    // holding nothing; plans cut short are closed, so the next micro-batch plans afresh
    empanel_read_finish(pool);
    pool->deferred_guess = NULL;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        if (pool->layers[il].plan_open || pool->layers[il].prefetch_open || pool->layers[il].reads_open) {
            reconcile(pool, &pool->layers[il]);
        }
    }
    atomic_store(&pool->failed, 0); // no reader threads run now: the message is free again
    pool->error[0] = '\0';
    atomic_store(&pool->error_claimed, 0);
    pthread_mutex_unlock(&pool->lock);
}

int32_t empanel_lab_access(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids, int32_t n_used,
                           int32_t n_tokens) {
    pthread_mutex_lock(&pool->lock);
    int32_t rc = -1;
    struct empanel_layer * layer = pool->lab ? remap_layer(pool, il) : NULL;
    if (!pool->lab) {
        empanel_set_error(pool, "empanel_lab_access: not a lab pool (empanel_lab_init)");
    } else if (layer != NULL) {
        // the engine's call: one remap when the distinct experts fit, else the waves a wave
        // graph runs (a lab has no graph: as many waves as the plan needs)
        const uint64_t misses = layer->stats.misses;
        const uint64_t call   = ++pool->call;
        const int32_t  n      = collect_distinct(pool, layer, il, call, expert_ids, n_used, n_used, n_tokens);
        const int      fits   = n <= layer->n_slots;
        if (n >= 0 && (fits ? resolve_one_wave(pool, layer, il, call, n, 0)
                            : plan_waves(pool, layer, il, call, n, INT32_MAX, expert_ids, n_used, n_used, n_tokens)) == 0) {
            empanel_guess_close(layer, n, call);
            end_batch(pool, layer, fits ? 1 : layer->plan_waves);
            rc = (int32_t) (layer->stats.misses - misses);
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}
