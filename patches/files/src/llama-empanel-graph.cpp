// empanel hooks, the graph's side: the ops built over a paged layer's pools. After the router's
// top-k, the remap op hands the expert ids to the sidecar and gives MUL_MAT_ID slot ids; a
// micro-batch larger than the pools runs each pool's MUL_MAT_ID as a chain of waves (masked waves
// where the kernel cannot skip pairs); a host pool's MUL_MAT_ID first waits for its own reads
// (the ready op); the gate-ahead guess and the routing substitution ops. The layer each op calls
// is looked up in the registry by pool tensor (llama-empanel-registry.cpp).

#include "llama-empanel.h"
#include "llama-empanel-impl.h"
#include "llama-empanel-state.h"

#include "llama-hparams.h"

#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

// an op run by thread 0 alone (llama_empanel_once): the other threads return from it only once
// thread 0 has finished it, yielding for up to LLAMA_EMPANEL_ONCE_SPIN_US and then asleep, so
// that a remap or a wait for reads does not keep them spinning in ggml's barrier after the node
// (a quarter or more of a paging decode's CPU on two threads). Thread ith's k-th entry
// waits for thread 0's k-th finish: never longer than the current run, since thread 0 runs every
// computation's node (a thread that skipped runs, with fewer threads then, just does not wait)
// EMPANEL_OP_SPIN=1 keeps the others spinning in the barrier (a switch to measure against:
// bench config /EMPANEL_OP_SPIN=1)
#define LLAMA_EMPANEL_ONCE_SPIN_US 20
static bool llama_empanel_once_first(llama_empanel_once & once, int ith) {
    static const bool spin = [] {
        const char * value = getenv("EMPANEL_OP_SPIN");
        return value != nullptr && strcmp(value, "1") == 0;
    }();
    if (ith == 0) {
        return true;
    }
    if (spin || ith >= LLAMA_EMPANEL_ONCE_THREADS) {
        return false;
    }
    const uint32_t run = once.entered[ith].fetch_add(1, std::memory_order_relaxed) + 1;
    const auto     t0  = std::chrono::steady_clock::now();
    while (once.done.load(std::memory_order_acquire) < run) {
        if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(LLAMA_EMPANEL_ONCE_SPIN_US)) {
            std::unique_lock<std::mutex> lock(once.m);
            once.sleepers.fetch_add(1, std::memory_order_seq_cst);
            once.cv.wait(lock, [&] { return once.done.load(std::memory_order_seq_cst) >= run; });
            once.sleepers.fetch_sub(1, std::memory_order_relaxed);
            break;
        }
        std::this_thread::yield();
    }
    return false;
}

// thread 0 has run the op: the others may go on
static void llama_empanel_once_done(llama_empanel_once & once) {
    once.done.fetch_add(1, std::memory_order_seq_cst);
    if (once.sleepers.load(std::memory_order_seq_cst) > 0) {
        std::lock_guard<std::mutex> lock(once.m);
        once.cv.notify_all();
    }
}

// the sidecar's remap: slot_ids [n_used, n_tokens] (contiguous) for a = expert ids [n_used,
// n_tokens] of one wave of one pool (wave == NULL: all the layer's pools, one wave); 0 on success
static int32_t llama_empanel_call_remap(const llama_empanel_layer * layer, const llama_empanel_wave * wave,
                                  const ggml_tensor * a, int32_t * slot_ids) {
    return layer->hooks->remap(layer->hooks->user, layer->il,
            wave ? wave->pool : nullptr, wave ? wave->wave : 0, wave ? wave->n_waves : 1,
            (const int32_t *) a->data, (int64_t) (a->nb[1]/sizeof(int32_t)),
            slot_ids, (int32_t) a->ne[0], (int32_t) a->ne[1]);
}

// CPU op: dst = slot ids of a (llama_empanel_call_remap)
static void llama_empanel_run_remap(ggml_tensor * dst, const ggml_tensor * a, const llama_empanel_layer * layer,
                          const llama_empanel_wave * wave) {
    if (llama_empanel_call_remap(layer, wave, a, (int32_t *) dst->data) != 0) {
        // slot 0 exists and holds finite numbers; the sidecar's abort callback stops this graph
        memset(dst->data, 0, ggml_nbytes(dst));
    }
}

static void llama_empanel_remap_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    const auto * layer = (const llama_empanel_layer *) userdata;
    if (llama_empanel_once_first(*layer->remap_once, ith)) {
        llama_empanel_run_remap(dst, a, layer, nullptr);
        llama_empanel_once_done(*layer->remap_once);
    }
}

// the first wave of a pool: a = expert ids
static void llama_empanel_wave_first_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    const auto * wave = (const llama_empanel_wave *) userdata;
    if (llama_empanel_once_first(*wave->once, ith)) {
        llama_empanel_run_remap(dst, a, wave->layer, wave);
        llama_empanel_once_done(*wave->once);
    }
}

// a later wave: a = expert ids, b = one element of the previous wave's MUL_MAT_ID (only to run
// after it)
static void llama_empanel_wave_next_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, int ith, int nth, void * userdata) {
    GGML_UNUSED(b);
    llama_empanel_wave_first_op(dst, a, ith, nth, userdata);
}

// whether a pair of this wave in row [n_used] uses slot s
static bool llama_empanel_row_uses_slot(const int32_t * row, const int32_t * in_wave, int32_t n_used, int32_t s) {
    for (int32_t j = 0; j < n_used; j++) {
        if (in_wave[j] && row[j] == s) {
            return true;
        }
    }
    return false;
}

// a masked wave: dst = [n_used, n_tokens, 2] I32, plane 0 the slot ids of every pair (the pairs of
// other waves get slots that this token's pairs of this wave do not use, distinct per token, as
// GPU kernels assume), plane 1 whether the pair is this wave's (1) or not (0). src[0] = expert
// ids, src[1] (later waves) = one element of the previous wave's product, only to run after it
static void llama_empanel_wave_masked_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto        * wave     = (const llama_empanel_wave *) userdata;
    const ggml_tensor * a        = dst->src[0];
    const int32_t       n_used   = (int32_t) a->ne[0];
    const int32_t       n_tokens = (int32_t) a->ne[1];
    int32_t * slot_ids = (int32_t *) dst->data;            // [n_used, n_tokens]
    int32_t * in_wave  = slot_ids + (int64_t) n_used*n_tokens; // [n_used, n_tokens]
    const int32_t rc = llama_empanel_call_remap(wave->layer, wave, a, slot_ids);
    for (int32_t t = 0; t < n_tokens; t++) {
        int32_t * row  = slot_ids + (int64_t) t*n_used;
        int32_t * flag = in_wave  + (int64_t) t*n_used;
        for (int32_t j = 0; j < n_used; j++) {
            flag[j] = rc == 0 && row[j] >= 0; // on failure no pair counts (the graph is stopped)
            row[j]  = flag[j] ? row[j] : -1;
        }
        // the smallest slots this token's wave pairs leave free: at most n_used - 1 < n_slots
        int32_t next = 0;
        for (int32_t j = 0; j < n_used; j++) {
            if (row[j] >= 0) {
                continue;
            }
            while (llama_empanel_row_uses_slot(row, flag, n_used, next)) {
                next++;
            }
            row[j] = next++;
        }
    }
}

// dst = the 0/1 mask [1, n_used, n_tokens] F32 of a masked wave's pairs; src[0] = its remap
static void llama_empanel_wave_mask_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    GGML_UNUSED(userdata);
    if (ith != 0) {
        return;
    }
    const int64_t   n_pairs = ggml_nelements(dst);
    const int32_t * in_wave = (const int32_t *) dst->src[0]->data + n_pairs;
    float         * mask    = (float *) dst->data;
    for (int64_t i = 0; i < n_pairs; i++) {
        mask[i] = in_wave[i] ? 1.0f : 0.0f;
    }
}

// waves for a micro-batch of n_tokens x n_used pairs (1: it always fits the pools)
static int32_t llama_empanel_n_waves(const llama_empanel_layer * layer, int64_t n_tokens, int64_t n_used) {
    const int64_t n_pairs = n_tokens*n_used;
    if (!layer->waves || layer->n_slots >= layer->n_expert || n_pairs <= layer->n_slots) {
        return 1;
    }
    const int64_t n_distinct = std::min<int64_t>(layer->n_expert, n_pairs);
    const int64_t per_wave   = LLAMA_EMPANEL_WAVE_EXPERTS(layer->n_slots);
    return (int32_t) ((n_distinct + per_wave - 1)/per_wave);
}

// CPU op: dst = a (this layer's slot ids), and the guess b (expert ids [n_used, n_tokens] of a
// later layer) handed to the sidecar: after this layer's remap, before its experts compute
static void llama_empanel_guess_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    const llama_empanel_guess * g = (const llama_empanel_guess *) userdata;
    if (!llama_empanel_once_first(*g->once, ith)) {
        return;
    }
    memcpy(dst->data, a->data, ggml_nbytes(a));
    g->target->hooks->guess(g->target->hooks->user, g->target->il, g->distance, (const int32_t *) b->data,
                     b->nb[1]/sizeof(int32_t), (int32_t) b->ne[0], (int32_t) b->ne[1]);
    llama_empanel_once_done(*g->once);
}

ggml_tensor * llama_empanel_build_guess(ggml_context * ctx, const ggml_tensor * w, ggml_tensor * cur, ggml_tensor * slot_ids,
                                        int gating_op, int64_t n_used) {
    llama_empanel_layer * layer = llama_empanel_layer_of(w);
    if (layer == nullptr || layer->guesses.empty() || llama_empanel_n_waves(layer, cur->ne[1], n_used) > 1) {
        return slot_ids; // micro-batches in waves read their experts anyway: no guesses for them
    }
    for (llama_empanel_guess & g : layer->guesses) {
        llama_empanel_layer * target = g.target;
        ggml_tensor * sel = ggml_mul_mat(ctx, target->router, cur); // [n_expert, n_tokens]
        if (target->router_bias != nullptr) {
            sel = ggml_add(ctx, sel, target->router_bias);
        }
        // softmax, sigmoid and sqrt(softplus) keep the order of the logits: only a selection bias
        // needs the gating applied first
        if (target->probs_bias != nullptr) {
            switch (gating_op) {
                case LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID:       sel = ggml_sigmoid(ctx, sel);                  break;
                case LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS: sel = ggml_sqrt(ctx, ggml_softplus(ctx, sel)); break;
                case LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX:       sel = ggml_soft_max(ctx, sel);                 break;
                default:                                                                                         break;
            }
            sel = ggml_add(ctx, sel, target->probs_bias);
        }
        ggml_tensor * top = ggml_argsort_top_k(ctx, sel, n_used); // [n_used, n_tokens]
        slot_ids = ggml_map_custom2(ctx, slot_ids, top, llama_empanel_guess_op, 1, &g);
        ggml_format_name(slot_ids, "ffn_moe_slots-%d-guess-%d", layer->il, target->il);
    }
    return slot_ids;
}

// CPU op: dst = a (top-k ids [n_used, n_tokens]) after the sidecar's substitution; b = the top
// n_used + n_alt choices, c = the selection scores [n_expert, n_tokens]
static void llama_empanel_subst_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, const ggml_tensor * c,
                             int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const llama_empanel_layer * layer = (const llama_empanel_layer *) userdata;
    for (int64_t t = 0; t < a->ne[1]; t++) { // dst contiguous [n_used, n_tokens]
        memcpy((char *) dst->data + t*dst->nb[1], (const char *) a->data + t*a->nb[1], a->ne[0]*sizeof(int32_t));
    }
    layer->hooks->subst(layer->hooks->user, layer->il, (int32_t *) dst->data, dst->nb[1]/sizeof(int32_t), (int32_t) a->ne[0],
                 (const int32_t *) b->data, b->nb[1]/sizeof(int32_t), (int32_t) b->ne[0],
                 (const float *) c->data, c->nb[1]/sizeof(float), (int32_t) a->ne[1]);
}

ggml_tensor * llama_empanel_build_subst(ggml_context * ctx, const ggml_tensor * w, ggml_tensor * scores,
                                        ggml_tensor * selected, int gating_op, int64_t n_used) {
    llama_empanel_layer * layer = llama_empanel_layer_of(w);
    // scores must be positive probabilities for "at least r x the missing one's"
    if (layer == nullptr || layer->pinned || layer->subst() == nullptr || gating_op == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT ||
        scores->type != GGML_TYPE_F32 || !ggml_is_contiguous(scores)) {
        return selected;
    }
    const int64_t n_cand = std::min<int64_t>(n_used + layer->hooks->subst_alt, scores->ne[0]);
    ggml_tensor * cand = ggml_argsort_top_k(ctx, scores, n_cand); // [n_cand, n_tokens]
    ggml_tensor * out  = ggml_map_custom3(ctx, selected, cand, scores, llama_empanel_subst_op, 1, layer);
    ggml_format_name(out, "ffn_moe_topk_subst-%d", layer->il);
    return out;
}

ggml_tensor * llama_empanel_build_remap(ggml_context * ctx, const ggml_tensor * w, ggml_tensor * ids) {
    llama_empanel_layer * layer = llama_empanel_layer_of(w);
    if (layer == nullptr || layer->pinned) {
        return ids; // pinned: the expert ids are the slot ids
    }
    GGML_ASSERT(ids->type == GGML_TYPE_I32 && ggml_n_dims(ids) <= 2 && ids->nb[0] == sizeof(int32_t));
    if (llama_empanel_n_waves(layer, ids->ne[1], ids->ne[0]) > 1) {
        return ids; // each pool's MUL_MAT_ID remaps its waves (llama_empanel_mul_mat_id)
    }
    ggml_tensor * slots = ggml_map_custom1(ctx, ids, llama_empanel_remap_op, 1, layer);
    ggml_format_name(slots, "ffn_moe_slots-%d", layer->il);
    return slots;
}

// the op a custom map node runs (the first field of its op params)
static void * llama_empanel_custom_fn(const ggml_tensor * t) {
    void * fn = nullptr;
    memcpy(&fn, t->op_params, sizeof(fn));
    return fn;
}

static bool llama_empanel_is_slot_ids(const ggml_tensor * t) {
    if (t == nullptr || (t->op != GGML_OP_MAP_CUSTOM1 && t->op != GGML_OP_MAP_CUSTOM2)) {
        return false;
    }
    void * fn = llama_empanel_custom_fn(t);
    return fn == (void *) llama_empanel_remap_op || fn == (void *) llama_empanel_wave_first_op || fn == (void *) llama_empanel_wave_next_op ||
           fn == (void *) llama_empanel_guess_op;
}

ggml_tensor * llama_empanel_expert_ids(ggml_tensor * ids) {
    while (ids != nullptr && ids->op == GGML_OP_MAP_CUSTOM2 && llama_empanel_custom_fn(ids) == (void *) llama_empanel_guess_op) {
        ids = ids->src[0]; // a guess passes the layer's slot ids through
    }
    return llama_empanel_is_slot_ids(ids) ? ids->src[0] : ids;
}

// one masked wave of pool w: its product times its mask, added to sum (the previous waves', NULL
// for the first); returns the new sum [ne1 of w, n_used, n_tokens]
static ggml_tensor * llama_empanel_masked_wave(ggml_context * ctx, ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids,
                                         llama_empanel_wave * wave, ggml_tensor * sum) {
    const int64_t n_used   = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];
    // the remap waits on one element of the previous sum (a device result: 4 bytes to the host)
    ggml_tensor * args[2] = { ids, sum == nullptr ? nullptr : ggml_view_1d(ctx, sum, 1, 0) };
    ggml_tensor * remap   = ggml_custom_4d(ctx, GGML_TYPE_I32, n_used, n_tokens, 2, 1, args, sum == nullptr ? 1 : 2,
                                           llama_empanel_wave_masked_op, 1, wave);
    ggml_tensor * slots   = ggml_view_2d(ctx, remap, n_used, n_tokens, remap->nb[1], 0);
    ggml_tensor * mask    = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, n_used, n_tokens, 1, &remap, 1,
                                           llama_empanel_wave_mask_op, 1, nullptr);
    ggml_format_name(remap, "ffn_moe_slots-%d.%d", wave->layer->il, wave->wave);
    // plain host pools: a view per wave, so that op offload copies this wave's slots (the
    // scheduler copies a weight to the device once per graph)
    ggml_tensor * src0 = w;
    if (ggml_backend_buffer_is_host(w->buffer)) {
        src0 = ggml_view_tensor(ctx, w);
        src0->buffer = w->buffer; // a weight, for the scheduler's choice of backend too
    }
    ggml_tensor * part = ggml_mul(ctx, ggml_mul_mat_id(ctx, src0, cur, slots), mask);
    return sum == nullptr ? part : ggml_add(ctx, sum, part);
}

// CPU op: dst = a (slot ids), once the experts the remap placed in pool `userdata->pool` hold their bytes
static void llama_empanel_ready_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    const auto * ready = (const llama_empanel_ready *) userdata;
    if (!llama_empanel_once_first(*ready->once, ith)) {
        return;
    }
    if (ready->layer->hooks->ready(ready->layer->hooks->user, ready->layer->il, ready->pool) == 0) {
        memcpy(dst->data, a->data, ggml_nbytes(a));
    } else {
        memset(dst->data, 0, ggml_nbytes(dst)); // slot 0; the sidecar's abort callback stops this graph
    }
    llama_empanel_once_done(*ready->once);
}

// one wave over pool w (ids: the layer's slot ids): in host memory, the MUL_MAT_ID first waits for
// the pool's reads (llama_empanel_set_ready), while the reads of the layer's other pools go on
static ggml_tensor * llama_empanel_ready_mul_mat_id(ggml_context * ctx, ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids) {
    llama_empanel_layer * layer = llama_empanel_layer_of(w);
    if (layer == nullptr || layer->ready() == nullptr || layer->pinned || layer->observe ||
        w->buffer == nullptr || !llama_empanel_buffer_in_host_memory(w->buffer)) {
        return ggml_mul_mat_id(ctx, w, cur, ids);
    }
    llama_empanel_ready * ready = llama_empanel_ready_of(layer, w);
    ggml_tensor * slots = ggml_map_custom1(ctx, ids, llama_empanel_ready_op, 1, ready);
    ggml_format_name(slots, "ffn_moe_slots-%d-ready", layer->il);
    return ggml_mul_mat_id(ctx, w, cur, slots);
}

ggml_tensor * llama_empanel_mul_mat_id(ggml_context * ctx, ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids) {
    if (llama_empanel_is_slot_ids(ids)) {
        return llama_empanel_ready_mul_mat_id(ctx, w, cur, ids);
    }
    llama_empanel_layer * layer = llama_empanel_layer_of(w);
    if (layer == nullptr || layer->observe || layer->pinned) {
        return ggml_mul_mat_id(ctx, w, cur, ids);
    }
    const int32_t n_waves = llama_empanel_n_waves(layer, ids->ne[1], ids->ne[0]);
    GGML_ASSERT(n_waves > 1); // one wave: ids are the layer's slot ids (llama_empanel_build_remap)

    const bool masked = layer->masked.count(w) > 0;
    GGML_ASSERT(ids->ne[0] <= layer->n_slots); // masked fillers take slots 0 .. n_used-1 (the plan has >= top-k)

    ggml_tensor * out = nullptr; // [ne1 of w, n_used, n_tokens]
    for (int32_t iw = 0; iw < n_waves; iw++) {
        llama_empanel_wave * wave = llama_empanel_wave_of(layer, w, iw, n_waves);
        if (masked) {
            out = llama_empanel_masked_wave(ctx, w, cur, ids, wave, out);
            continue;
        }
        // a later wave's remap waits on one element of the previous wave's product (on a device
        // pool: 4 bytes to the host)
        ggml_tensor * slots = out == nullptr
            ? ggml_map_custom1(ctx, ids, llama_empanel_wave_first_op, 1, wave)
            : ggml_map_custom2(ctx, ids, ggml_view_1d(ctx, out, 1, 0), llama_empanel_wave_next_op, 1, wave);
        ggml_format_name(slots, "ffn_moe_slots-%d.%d", layer->il, iw);

        if (out == nullptr) {
            out = ggml_mul_mat_id(ctx, w, cur, slots);
            continue;
        }
        // the same MUL_MAT_ID, written into the previous wave's output (src[3]): the CPU and
        // Vulkan kernels leave the rows of skipped pairs (slot id -1) as they are
        ggml_tensor * acc = ggml_view_tensor(ctx, out);
        acc->op     = GGML_OP_MUL_MAT_ID;
        acc->src[0] = w;
        acc->src[1] = cur;
        acc->src[2] = slots;
        acc->src[3] = out;
        out = acc;
    }
    return out;
}

void llama_empanel_each_mul_mat_id(ggml_tensor * res, const std::function<void(ggml_tensor *)> & fn) {
    while (res != nullptr) {
        if (res->op == GGML_OP_MUL_MAT_ID) {
            fn(res);
            res = res->src[3] != nullptr && res->src[3]->op == GGML_OP_MUL_MAT_ID ? res->src[3] : nullptr; // waves
            continue;
        }
        // masked waves: sum = ADD(sum, part) ... part = MUL(MUL_MAT_ID, mask)
        ggml_tensor * part = res->op == GGML_OP_ADD ? res->src[1] : res;
        const bool ours = part->op == GGML_OP_MUL && part->src[1]->op == GGML_OP_CUSTOM &&
                          llama_empanel_custom_fn(part->src[1]) == (void *) llama_empanel_wave_mask_op;
        if (!ours) {
            fn(res); // not built here: as stock
            return;
        }
        fn(part->src[0]);
        res = res->op == GGML_OP_ADD ? res->src[0] : nullptr;
    }
}

// graph nodes the waves, guesses and substitution of one layer add to a micro-batch of n_tokens
// (upper bound)
static uint32_t llama_empanel_layer_extra_nodes(const llama_empanel_layer & layer, uint32_t n_tokens) {
    if (layer.pinned) {
        return 0; // stock's graph
    }
    uint32_t n = 0;
    // per wave and pool a remap, a view and a MUL_MAT_ID (masked: also the mask, the mul and
    // the add); at most n_expert used per token (a warmup routes to all of them), and room for
    // the cb() names' views
    n += 8u * (uint32_t) (llama_empanel_n_waves(&layer, n_tokens, layer.n_expert) * layer.n_pools) + 2u;
    n += 8u * (uint32_t) layer.guesses.size(); // a guess: matmul, biases, gating, top-k, the op
    n += layer.subst() != nullptr ? 4u : 0u;   // substitution: top-k candidates and the op
    return n;
}

uint32_t llama_empanel_graph_extra_nodes(const llama_model * model, uint32_t n_tokens) {
    uint32_t n = 0;
    llama_empanel_each_layer(model, [&](const llama_empanel_layer & layer) {
        n += llama_empanel_layer_extra_nodes(layer, n_tokens);
    });
    return n;
}
