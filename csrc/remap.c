// The remap: which slots a micro-batch's experts take in one layer, what to evict, what to read.
//
// A remap call handles one micro-batch of one layer: hits keep their slots, misses take the slots
// the policy gives up (none that this micro-batch uses) and are read from the file. A micro-batch
// that routes to more distinct experts than the pool holds runs in waves (plan_waves), one call
// per wave and pool tensor (remap_wave_locked). Error recovery changes the same tables; preload
// (preload.c) and the gate-ahead guess (guess.c) use the same tables through slots.c (slots.h).

#include "remap.h"
#include "batch.h"
#include "files.h"
#include "ready.h"
#include "slots.h"
#include "trace.h"
#include "util.h"
#include "state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// the misses of a micro-batch may be read while the layer computes: every tensor's MUL_MAT_ID
// waited for its own reads last time (empanel_ready), and its pools are plain host memory that
// the reads land in. CPU_REPACK pools are not: their readers repack every expert, and on two
// cores that CPU taken from the compute costs more than the overlap gives (docs/performance.md,
// "Layouts")
static int overlap_reads(const struct empanel_pool * pool, const struct empanel_layer * layer) {
    if (!layer->ready.armed || pool->config.lab || empanel_batch_inflight(pool, EMPANEL_LANE_DEMAND, NULL)) {
        return 0;
    }
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        const struct empanel_tensor * t = &layer->tensors[i];
        if (!t->direct || t->remote != NULL) {
            return 0;
        }
    }
    return 1;
}

// as empanel_batch_fill_slots, but the reads are posted, not waited for: each tensor's MUL_MAT_ID waits
// for its own (empanel_ready; the tensors are read in the order the graph computes them), and the
// tables say where the experts will be. A failed read empties their slots again (reconcile)
static int fill_slots_overlapped(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    int32_t order[EMPANEL_MAX_TENSORS];
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        order[layer->ready.rank[i]] = i; // ranks 0 .. n_tensors - 1: every tensor's call was seen
    }
    if (empanel_batch_post_layer(pool, layer, layer->tables.misses, layer->tables.victims, n, order) != 0) {
        pool->budget.resident_bytes -= (uint64_t) n * layer->expert_bytes;
        return -1;
    }
    empanel_slots_hold_misses(pool, layer, n);
    layer->ready.reads_open = 1;
    layer->stats.overlapped++;
    return 0;
}

// the layer, or NULL with the error recorded
static struct empanel_layer * remap_layer(struct empanel_pool * pool, int32_t il) {
    if (atomic_load(&pool->error.failed)) {
        return NULL;
    }
    if (il < 0 || il >= pool->n_layer || (pool->layers[il].n_slots == 0 && !pool->layers[il].observe)) {
        empanel_util_set_error(pool, "remap: layer %d has no slot pool", il);
        return NULL;
    }
    return &pool->layers[il];
}

// every remap call begins so: a read-ahead not posted by now comes too late, and the batches in
// flight are finished (a read-ahead of this layer first loses the experts it does not route to,
// when drop_unrouted), but for a read-ahead of another layer that may stay beside this layer's
// reads (empanel_batch_beside). The layer, or NULL with the error recorded
static struct empanel_layer * remap_begin(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                                          int64_t ids_row_stride, int32_t n_used, int32_t n_tokens, int drop_unrouted) {
    struct empanel_layer * layer = remap_layer(pool, il);
    pool->deferred_guess = NULL;
    if (layer == NULL) {
        return NULL;
    }
    if (drop_unrouted) {
        empanel_batch_drop_unrouted(pool, layer, expert_ids, ids_row_stride, n_used, n_tokens);
    }
    // (a read-ahead stays in flight where this layer's reads may be posted beside it)
    if (empanel_batch_finish_lane(pool, EMPANEL_LANE_DEMAND) != 0 ||
        (!empanel_batch_can_post(pool, EMPANEL_LANE_DEMAND, layer) &&
         empanel_batch_finish_lane(pool, EMPANEL_LANE_AHEAD) != 0)) {
        return NULL;
    }
    return layer;
}

// a micro-batch starts in the layer: what an earlier one left open is reconciled, the LRU clock
// ticks, the routing is traced. Its call stamp, or 0 with the error recorded
static uint64_t start_batch(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il,
                            const int32_t * expert_ids, int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    if (empanel_layer_open(layer)) {
        empanel_slots_reconcile(pool, layer);
    }
    const uint64_t call = ++pool->call;
    pool->budget.busy_call = call; // its slots are the ones the graph reads until the next remap
    if (pool->trace.on && empanel_trace_call(pool, il, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
        return 0;
    }
    return call;
}

// what a shrink had to leave (busy then) goes now, but the slots of the micro-batch's n distinct
// experts that are resident: marked as this call's first, so that no hit is evicted and read again
static void shrink_sparing_hits(struct empanel_pool * pool, struct empanel_layer * layer, uint64_t call, int32_t n) {
    if (pool->budget.resident_bytes <= pool->budget.bytes) {
        return;
    }
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = layer->tables.slot_of[layer->tables.distinct[i]];
        if (s >= 0) {
            layer->tables.call_mark[s] = call;
        }
    }
    empanel_slots_shrink(pool);
}

// the distinct experts of a micro-batch in order of first use, into layer->tables.distinct; their
// number, or -1 if an id is out of range
static int32_t collect_distinct(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il, uint64_t call,
                                const int32_t * expert_ids, int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    int32_t n = 0;
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            if (e < 0 || e >= pool->n_expert) {
                empanel_util_set_error(pool, "remap: layer %d routed to expert %d of %d", il, e, pool->n_expert);
                return -1;
            }
            if (layer->tables.miss_mark[e] != call) {
                layer->tables.miss_mark[e] = call;
                layer->tables.distinct[n++] = e;
            }
        }
    }
    layer->stats.n_ids += (uint64_t) n_tokens * (uint64_t) n_used;
    return n;
}

static int compare_int32(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a;
    const int32_t y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

// the n distinct experts: hits are used where they are, misses listed in layer->tables.misses; the
// number of misses
static int32_t split_hits(struct empanel_pool * pool, struct empanel_layer * layer, uint64_t call, int32_t n) {
    int32_t n_miss = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = layer->tables.distinct[i];
        if (layer->tables.slot_of[e] >= 0) {
            empanel_slots_use_hit(pool, layer, layer->tables.slot_of[e], call);
        } else {
            layer->tables.misses[n_miss++] = e;
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
        const int32_t s = empanel_slots_pick_victim(layer, pool->config.policy, 0, layer->n_slots, layer->tables.call_mark, call);
        if (s < 0) {
            empanel_util_set_error(pool,
                "remap: layer %d: this micro-batch routes to more distinct experts than the %d slots "
                "(lower n_ubatch, or raise moe_slots)", il, layer->n_slots);
            return -1;
        }
        empanel_slots_claim(pool, layer, s, call);
        layer->tables.victims[i] = s;
    }
    if (n_miss > 0 && (overlap && overlap_reads(pool, layer) ? fill_slots_overlapped(pool, layer, n_miss)
                                                          : empanel_batch_fill_slots(pool, layer, n_miss)) != 0) {
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
    const int32_t split   = n_half == 2 ? LLAMA_EMPANEL_WAVE_EXPERTS(n_slots) : n_slots;
    const int32_t half_begin[2] = { 0, split };
    const int32_t half_end[2]   = { split, n_slots };

    for (int32_t i = 0; i < n; i++) {
        layer->waves.wave_of[layer->tables.distinct[i]] = -1;
    }
    const int32_t n_miss = split_hits(pool, layer, call, n);
    // last use of every expert: the token index (victims is free scratch here)
    int32_t * last_use = layer->tables.victims;
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            last_use[row[j]] = t;
        }
    }
    for (int32_t i = 0; i < n_miss; i++) {
        const int32_t e = layer->tables.misses[i];
        layer->tables.order_key[i] = (uint64_t) last_use[e] * (uint64_t) pool->n_expert + (uint64_t) e;
    }
    qsort(layer->tables.order_key, (size_t) n_miss, sizeof(uint64_t), empanel_util_compare_uint64);
    for (int32_t i = 0; i < n_miss; i++) {
        layer->tables.misses[i] = (int32_t) (layer->tables.order_key[i] % (uint64_t) pool->n_expert);
    }
    layer->stats.misses += (uint64_t) n_miss;

    int32_t n_order = 0; // experts placed
    int32_t next    = 0; // next miss to place
    int32_t w       = 0;
    for (; next < n_miss || w < n_half; w++) {
        if (w >= graph_waves) {
            empanel_util_set_error(pool, "remap: layer %d: %d distinct experts need more than the graph's %d waves",
                                   il, n, graph_waves);
            return -1;
        }
        const int32_t  h     = w % n_half;
        const uint64_t stamp = ++layer->tables.mark_stamp;
        layer->waves.begin[w] = n_order;
        int32_t count = 0;
        for (int32_t i = 0; w < n_half && i < n; i++) {
            const int32_t e = layer->tables.distinct[i];
            const int32_t s = layer->tables.slot_of[e];
            if (layer->waves.wave_of[e] < 0 && s >= half_begin[h] && s < half_end[h]) {
                layer->waves.wave_of[e] = w;   // a hit of this half
                layer->waves.slot_of[e] = s;
                layer->tables.slot_mark[s] = stamp;
                layer->waves.order[n_order++] = e;
                count++;
            }
        }
        for (; count < half_end[h] - half_begin[h] && next < n_miss; count++) {
            const int32_t s = empanel_slots_pick_victim(layer, pool->config.policy, half_begin[h], half_end[h], layer->tables.slot_mark, stamp);
            if (s < 0) { // the half has room for count < its size experts: never, unless the tables are wrong
                empanel_util_set_error(pool, "remap: layer %d: wave %d found no slot for its expert in slots [%d, %d)",
                                       il, w, half_begin[h], half_end[h]);
                return -1;
            }
            const int32_t e = layer->tables.misses[next++];
            empanel_slots_place(pool, layer, s, e, call);
            layer->waves.wave_of[e] = w;
            layer->waves.slot_of[e] = s;
            layer->tables.slot_mark[s] = stamp;
            layer->waves.order[n_order++] = e;
        }
        // read in file order
        qsort(layer->waves.order + layer->waves.begin[w], (size_t) (n_order - layer->waves.begin[w]),
              sizeof(int32_t), compare_int32);
    }
    layer->waves.begin[w] = n_order;
    layer->waves.n    = w;
    return 0;
}

// pool == NULL: the micro-batch fits the pools; one remap for all the layer's tensors
static int32_t remap_locked(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                            int64_t ids_row_stride, int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_layer * layer = remap_begin(pool, il, expert_ids, ids_row_stride, n_used, n_tokens, 1);
    const uint64_t call = layer != NULL ? start_batch(pool, layer, il, expert_ids, ids_row_stride, n_used, n_tokens) : 0;
    if (call == 0) {
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
    // every tensor's MUL_MAT_ID waited for its reads after the layer's last remap (the graph has
    // its ready ops): this micro-batch's reads may overlap the layer's compute
    layer->ready.armed = empanel_ready_all_seen(layer);
    layer->ready.seen  = 0;
    layer->ready.next  = 0;
    const int32_t n = collect_distinct(pool, layer, il, call, expert_ids, ids_row_stride, n_used, n_tokens);
    if (n >= 0) {
        shrink_sparing_hits(pool, layer, call, n);
    }
    if (n < 0 || resolve_one_wave(pool, layer, il, call, n, 1) != 0) {
        return -1;
    }
    empanel_slots_close_guess(layer, n);
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            slot_ids[(int64_t) t * n_used + j] = layer->tables.slot_of[row[j]];
        }
    }
    empanel_slots_end_batch(pool, layer, 1);
    return 0;
}

// the calls of a plan carry the micro-batch's expert ids: the same ids as the open plan's
static int same_ids(const struct empanel_layer * layer, const int32_t * expert_ids, int64_t ids_row_stride,
                    int32_t n_used, int32_t n_tokens) {
    if (layer->waves.n_ids != (int64_t) n_tokens * n_used) {
        return 0;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        if (memcmp(layer->waves.ids + (int64_t) t * n_used, expert_ids + (int64_t) t * ids_row_stride,
                   sizeof(int32_t) * n_used) != 0) {
            return 0;
        }
    }
    return 1;
}

static int keep_ids(struct empanel_pool * pool, struct empanel_layer * layer, const int32_t * expert_ids,
                    int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    const int64_t n_ids = (int64_t) n_tokens * n_used;
    if (n_ids > layer->waves.ids_cap) {
        int32_t * grown = realloc(layer->waves.ids, sizeof(int32_t) * (size_t) n_ids);
        if (grown == NULL) {
            empanel_util_set_error(pool, "remap: out of memory for %lld expert ids", (long long) n_ids);
            return -1;
        }
        layer->waves.ids     = grown;
        layer->waves.ids_cap = n_ids;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        memcpy(layer->waves.ids + (int64_t) t * n_used, expert_ids + (int64_t) t * ids_row_stride, sizeof(int32_t) * n_used);
    }
    layer->waves.n_ids = n_ids;
    return 0;
}

// the experts of wave w that tensor ti's slots do not hold yet, into layer->tables.misses / victims
static int32_t wave_missing(struct empanel_layer * layer, int32_t ti, int32_t w) {
    if (w >= layer->waves.n) {
        return 0;
    }
    const int32_t * held = layer->tensors[ti].held;
    int32_t n = 0;
    for (int32_t k = layer->waves.begin[w]; k < layer->waves.begin[w + 1]; k++) {
        const int32_t e = layer->waves.order[k];
        const int32_t s = layer->waves.slot_of[e];
        if (held[s] != e) {
            layer->tables.misses[n]  = e;
            layer->tables.victims[n] = s;
            n++;
        }
    }
    return n;
}

// the layer's first call for a micro-batch (wave 0): plan its waves, n_waves as the graph runs
// them; the tables describe the plan's end from here on. 0, or -1 with the error recorded
static int plan_batch_waves(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il, int32_t n_waves,
                            const int32_t * expert_ids, int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    const uint64_t call = start_batch(pool, layer, il, expert_ids, ids_row_stride, n_used, n_tokens);
    if (call == 0 || keep_ids(pool, layer, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
        return -1;
    }
    const int32_t n = collect_distinct(pool, layer, il, call, expert_ids, ids_row_stride, n_used, n_tokens);
    if (n < 0) {
        return -1;
    }
    shrink_sparing_hits(pool, layer, call, n);
    layer->waves.open        = 1; // from here on the tables describe the plan's end
    layer->waves.n_graph = n_waves;
    for (int32_t i = 0; i < EMPANEL_MAX_TENSORS; i++) {
        layer->waves.next[i] = 0;
    }
    if (n <= layer->n_slots) {
        // it fits: one wave, read for every tensor at once
        if (resolve_one_wave(pool, layer, il, call, n, 0) != 0) {
            return -1;
        }
        for (int32_t i = 0; i < n; i++) {
            const int32_t e = layer->tables.distinct[i];
            layer->waves.wave_of[e]  = 0;
            layer->waves.slot_of[e]  = layer->tables.slot_of[e];
            layer->waves.order[i] = e;
        }
        layer->waves.begin[0] = 0;
        layer->waves.begin[1] = n;
        layer->waves.n    = 1;
    } else if (plan_waves(pool, layer, il, call, n, n_waves, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
        return -1;
    }
    empanel_slots_close_guess(layer, n);
    empanel_slots_end_batch(pool, layer, layer->waves.n);
    return 0;
}

// read ahead after wave `wave` of tensor ti: this tensor's next wave goes to the other half of its
// pool (free: the wave before this one has computed), unless reads land in slots that this wave's
// masked kernel reads; after its last wave, the first wave of a tensor that has not started (its
// pool is idle). 0, or -1 with the error recorded
static int read_ahead_wave(struct empanel_pool * pool, struct empanel_layer * layer, int32_t ti, int32_t wave) {
    int32_t next_tensor = -1;
    int32_t next_wave   = 0;
    if (wave + 1 < layer->waves.n) {
        if (layer->n_slots >= 2 && !(layer->tensors[ti].masked && layer->tensors[ti].direct)) {
            next_tensor = ti;
            next_wave   = wave + 1;
        }
    } else {
        for (int32_t i = 0; i < layer->n_tensors && next_tensor < 0; i++) {
            next_tensor = layer->waves.next[i] == 0 ? i : -1;
        }
    }
    if (next_tensor >= 0) {
        const int32_t n_ahead = wave_missing(layer, next_tensor, next_wave);
        if (n_ahead > 0 && empanel_batch_post(pool, layer, next_tensor, layer->tables.misses, layer->tables.victims, n_ahead) != 0) {
            return -1;
        }
    }
    return 0;
}

// layer il starts a micro-batch of n_pairs (token, expert) pairs in waves: where that many pairs
// route to nearly every expert (4 per expert or more), the next paged layer's empty slots are read
// into ahead, in the read-ahead lane behind this layer's own reads, experts in file order, within
// the budget (params.prompt_ahead). A cold pool's first waves are then resident when its
// micro-batch comes, instead of read while the graph waits; a pool with no empty slot reads none
static void read_ahead_next_layer(struct empanel_pool * pool, int32_t il, int64_t n_pairs) {
    if (!pool->config.prompt_ahead || pool->config.lab || n_pairs < 4 * (int64_t) pool->n_expert) {
        return;
    }
    // the next paged layer, unless it is the last: llama.cpp's last layer computes only the tokens
    // whose outputs are kept (one, in a prompt), which would leave what was read unused
    struct empanel_layer * next = NULL;
    int32_t last = -1;
    for (int32_t j = 0; j < pool->n_layer; j++) {
        if (pool->layers[j].n_slots > 0 && !pool->layers[j].observe) {
            next = next == NULL && j > il ? &pool->layers[j] : next;
            last = j;
        }
    }
    if (next == NULL || next == &pool->layers[last] || next->device || empanel_layer_open(next) ||
        !empanel_batch_can_post(pool, EMPANEL_LANE_AHEAD, next)) {
        return;
    }
    // every expert is the guess, in file order: the resident ones are all kept, so only empty
    // slots are read into (empanel_batch_read_ahead), within the budget
    for (int32_t e = 0; e < pool->n_expert; e++) {
        next->tables.distinct[e] = e;
    }
    empanel_batch_read_ahead(pool, next, pool->n_expert);
}

// one wave of one pool tensor: plan the micro-batch at its layer's first call, make the wave's
// experts resident in this tensor, give their pairs slot ids (others -1), and start reading what
// comes next while this wave computes
static int32_t remap_wave_locked(struct empanel_pool * pool, int32_t il, const void * pool_tensor, int32_t wave,
                                 int32_t n_waves, const int32_t * expert_ids, int64_t ids_row_stride,
                                 int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_layer * layer = remap_begin(pool, il, expert_ids, ids_row_stride, n_used, n_tokens, 0);
    if (layer == NULL) {
        return -1;
    }
    const int32_t ti = empanel_tensor_index(layer, pool_tensor);
    if (ti < 0 || layer->observe) {
        empanel_util_set_error(pool, "remap: layer %d has no pool tensor %p", il, pool_tensor);
        return -1;
    }

    const int continues = layer->waves.open && layer->waves.n_graph == n_waves && layer->waves.next[ti] == wave &&
                          same_ids(layer, expert_ids, ids_row_stride, n_used, n_tokens);
    if (!continues) {
        if (wave != 0) {
            empanel_util_set_error(pool, "remap: layer %d, %s: wave %d of %d out of order", il,
                                   layer->tensors[ti].name, wave, n_waves);
            return -1;
        }
        if (plan_batch_waves(pool, layer, il, n_waves, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
            return -1;
        }
    }

    // this wave's experts in this tensor's slots (normally read while the previous wave computed)
    const int32_t n_missing = wave_missing(layer, ti, wave);
    if (n_missing > 0 && (empanel_batch_post(pool, layer, ti, layer->tables.misses, layer->tables.victims, n_missing) != 0 ||
                          empanel_batch_finish_lane(pool, EMPANEL_LANE_DEMAND) != 0)) {
        return -1;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            slot_ids[(int64_t) t * n_used + j] = layer->waves.wave_of[e] == wave ? layer->waves.slot_of[e] : -1;
        }
    }
    layer->waves.next[ti] = wave + 1;

    if (read_ahead_wave(pool, layer, ti, wave) != 0) {
        return -1;
    }
    if (!continues) { // the next layer's empty slots, while this layer's waves compute
        read_ahead_next_layer(pool, il, (int64_t) n_tokens * n_used);
    }
    int open = 0;
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        open |= layer->waves.next[i] < layer->waves.n_graph;
    }
    layer->waves.open = open;
    return 0;
}

int32_t empanel_remap(void * user, int32_t il, const void * pool_tensor, int32_t wave, int32_t n_waves,
                      const int32_t * expert_ids, int64_t ids_row_stride,
                      int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_pool * pool = user;
    const uint64_t t0 = empanel_util_now_ns();
    pthread_mutex_lock(&pool->lock);
    // every call looks at the files first: a write anywhere in them (the mapped dense tensors
    // too) fails the next decode, whether or not it misses
    const int32_t rc = empanel_files_check(pool) != 0 ? -1 : pool_tensor == NULL
        ? remap_locked(pool, il, expert_ids, ids_row_stride, slot_ids, n_used, n_tokens)
        : remap_wave_locked(pool, il, pool_tensor, wave, n_waves, expert_ids, ids_row_stride, slot_ids, n_used, n_tokens);
    if (rc != 0) {
        empanel_batch_finish(pool); // nothing stays in flight after a failure
    }
    if (il >= 0 && il < pool->n_layer) {
        pool->layers[il].stats.remap_ns     += empanel_util_now_ns() - t0;
        pool->layers[il].stats.device_syncs += (uint64_t) pool->layers[il].device;
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}

int32_t empanel_lab_access(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids, int32_t n_used,
                           int32_t n_tokens) {
    pthread_mutex_lock(&pool->lock);
    int32_t rc = -1;
    struct empanel_layer * layer = pool->config.lab ? remap_layer(pool, il) : NULL;
    if (!pool->config.lab) {
        empanel_util_set_error(pool, "empanel_lab_access: not a lab pool (empanel_lab_init)");
    } else if (layer != NULL) {
        // the engine's call: one remap when the distinct experts fit, else the waves a wave
        // graph runs (a lab has no graph: as many waves as the plan needs)
        const uint64_t misses = layer->stats.misses;
        const uint64_t call   = ++pool->call;
        const int32_t  n      = collect_distinct(pool, layer, il, call, expert_ids, n_used, n_used, n_tokens);
        const int      fits   = n <= layer->n_slots;
        if (n >= 0 && (fits ? resolve_one_wave(pool, layer, il, call, n, 0)
                            : plan_waves(pool, layer, il, call, n, INT32_MAX, expert_ids, n_used, n_used, n_tokens)) == 0) {
            empanel_slots_close_guess(layer, n);
            empanel_slots_end_batch(pool, layer, fits ? 1 : layer->waves.n);
            rc = (int32_t) (layer->stats.misses - misses);
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}
