#include "llama-empanel.h"
#include "llama-empanel-impl.h"

#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#ifndef _WIN32
#include <sys/stat.h>
#endif

#ifndef EMPANEL_LLAMA_COMMIT
#define EMPANEL_LLAMA_COMMIT "unknown"
#endif

int32_t llama_empanel_api_version(void) {
    return LLAMA_EMPANEL_API_VERSION;
}

const char * llama_empanel_llama_commit(void) {
    return EMPANEL_LLAMA_COMMIT;
}

//
// expert slot pools
//

struct llama_empanel_layer;

// what the remap op of one wave of one pool calls (the op's userdata)
struct llama_empanel_wave {
    llama_empanel_layer * layer;
    const ggml_tensor   * pool;
    int32_t               wave;
    int32_t               n_waves;
};

// what the ready op of one pool calls (the op's userdata)
struct llama_empanel_ready {
    llama_empanel_layer * layer;
    const ggml_tensor   * pool;
};

// what the guess op of one paged layer for a later one calls (the op's userdata)
struct llama_empanel_guess {
    llama_empanel_layer * target;   // the layer guessed
    int32_t               distance; // paged layers ahead
};

// what the remap op of one paged layer calls
struct llama_empanel_layer {
    int32_t                il;
    llama_empanel_remap_fn remap;
    void                 * user;
    llama_empanel_guess_fn guess = nullptr;
    llama_empanel_subst_fn subst = nullptr;
    int32_t                subst_alt = 0;
    llama_empanel_ready_fn ready = nullptr;
    ggml_tensor          * router      = nullptr; // ffn_gate_inp.weight [n_embd, n_expert]
    ggml_tensor          * router_bias = nullptr; // ffn_gate_inp.bias, or NULL
    ggml_tensor          * probs_bias  = nullptr; // exp_probs_b.bias (selection bias), or NULL
    std::vector<llama_empanel_guess> guesses;     // the later layers this one guesses
    bool                   observe;  // no pool: remap sees the ids and returns them (traces)
    bool                   pinned = false; // expert e in slot e for good: stock's graph (llama_empanel_set_pinned)
    int32_t                n_slots  = 0;
    int32_t                n_expert = 0;
    int32_t                n_pools  = 0;
    bool                   waves    = false; // micro-batches larger than the pools run in waves
    std::set<const ggml_tensor *> masked;     // pools whose waves are masked (no kernel skip)

    // userdata of the wave remap ops built so far, by (pool, wave, n_waves); of the ready ops, by pool
    std::map<std::tuple<const ggml_tensor *, int32_t, int32_t>, std::unique_ptr<llama_empanel_wave>> wave_ops;
    std::map<const ggml_tensor *, std::unique_ptr<llama_empanel_ready>>                              ready_ops;
};

// the plan and the pools of the load running on this thread
struct llama_empanel_load {
    std::vector<int32_t>   n_slots; // [n_layer]
    int32_t                n_expert = 0;
    bool                   gpu      = false; // a GPU backend may compute on plain host pools
    bool                   mask_all = false; // EMPANEL_WAVE_MASK=1: device and plain host pools masked
    llama_empanel_remap_fn remap = nullptr;
    void                 * user  = nullptr;
    llama_empanel_guess_fn guess = nullptr;
    int32_t                guess_depth = 0;
    llama_empanel_subst_fn subst = nullptr;
    int32_t                subst_alt = 0;
    llama_empanel_ready_fn ready = nullptr;
    bool                   pinned    = false;
    std::map<int32_t, ggml_tensor *> routers, router_biases, probs_biases; // il -> tensor

    std::map<ggml_backend_buffer_type_t, ggml_context_ptr> pool_ctxs;
    std::map<std::string, size_t>                          phase;    // pool name -> its data's file offset
                                                                     // modulo LLAMA_EMPANEL_READ_ALIGN (bytes)
    std::vector<ggml_tensor *>                             observed; // resident weights of observed layers
};

// the pools of a loaded model
struct llama_empanel_model {
    std::map<std::string, ggml_tensor *>                    pools;    // GGUF tensor name -> pool
    std::vector<ggml_tensor *>                              observed; // weights of observed layers
    std::vector<std::unique_ptr<llama_empanel_layer>>      layers;   // userdata of the remap ops
    // held by a context's graph over the pools from the start of its computation to the end of
    // its last kernel (llama_empanel_graph_begin/end); NULL: every layer pinned, nothing shared
    std::unique_ptr<std::mutex>                             graph_lock;
    std::vector<std::pair<uint64_t, uint64_t>>              files;    // (st_dev, st_ino) of each file the loader read
};

static thread_local std::unique_ptr<llama_empanel_load> g_load;

static std::mutex                                            g_mutex;
static std::map<const llama_model *, llama_empanel_model>   g_models;
static std::map<const ggml_tensor *, llama_empanel_layer *> g_pool_layer; // pool tensor -> its layer

// the backends whose MUL_MAT_ID kernels skip pairs with slot id -1, as wave chains need: the CPU
// (patch 0005) and Vulkan (patch 0011). The others' pools run masked waves
static bool llama_empanel_backend_skips_pairs(ggml_backend_reg_t reg) {
    const char * name = reg != nullptr ? ggml_backend_reg_name(reg) : "";
    return strcmp(name, "CPU") == 0 || strcmp(name, "Vulkan") == 0;
}

// a GPU backend's device is registered (llama_empanel_device_is_gpu): op offload may take plain
// host pools' MUL_MAT_IDs to it
static bool llama_empanel_offload_gpu() {
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        if (llama_empanel_device_is_gpu(ggml_backend_dev_get(i))) {
            return true;
        }
    }
    return false;
}

void llama_empanel_set_plan(const int32_t * n_slots, int32_t n_layer, llama_empanel_remap_fn remap, void * user) {
    g_load = std::make_unique<llama_empanel_load>();
    g_load->n_slots.assign(n_slots, n_slots + n_layer);
    g_load->remap = remap;
    g_load->user  = user;
    // op offload may take plain host pools' MUL_MAT_IDs to a GPU. EMPANEL_WAVE_MASK=1 masks the
    // waves of device and plain host pools on any build (tests run masked waves on the CPU;
    // scripts/gpu_check.py --waves compares them on a GPU)
    const char * mask = getenv("EMPANEL_WAVE_MASK");
    g_load->mask_all = mask != nullptr && strcmp(mask, "1") == 0;
    g_load->gpu      = llama_empanel_offload_gpu();
}

void llama_empanel_set_guess(llama_empanel_guess_fn guess, int32_t depth) {
    if (g_load) {
        g_load->guess       = guess;
        g_load->guess_depth = guess != nullptr && depth > 0 ? depth : 0;
    }
}

void llama_empanel_set_subst(llama_empanel_subst_fn subst, int32_t n_alt) {
    if (g_load) {
        g_load->subst     = subst;
        g_load->subst_alt = subst != nullptr && n_alt > 0 ? n_alt : 0;
    }
}

void llama_empanel_set_ready(llama_empanel_ready_fn ready) {
    if (g_load) {
        g_load->ready = ready;
    }
}

void llama_empanel_set_pinned(bool pinned) {
    if (g_load) {
        g_load->pinned = pinned;
    }
}

void llama_empanel_clear_plan(void) {
    g_load.reset();
}

bool llama_empanel_plan_set() {
    return g_load != nullptr;
}

bool llama_empanel_plan_active() {
    if (g_load) {
        for (int32_t n : g_load->n_slots) {
            if (n > 0) {
                return true;
            }
        }
    }
    return false;
}

// "blk.<il>.ffn_<gate|up|down|gate_up>_exps.weight" -> il, else -1
static int32_t llama_empanel_expert_weight_layer(const char * name) {
    int il  = -1;
    int end = 0;
    char kind[16] = {0};
    if (sscanf(name, "blk.%d.ffn_%15[a-z_]%n", &il, kind, &end) != 2 || name[end] != '.') {
        return -1;
    }
    static const char * kinds[] = { "gate_exps", "up_exps", "down_exps", "gate_up_exps" };
    for (const char * k : kinds) {
        if (strcmp(kind, k) == 0 && strcmp(name + end, ".weight") == 0) {
            return il;
        }
    }
    return -1;
}

int32_t llama_empanel_n_slots(const char * name, const ggml_tensor * meta, size_t file_offset) {
    if (!g_load) {
        return 0;
    }
    const int32_t il = llama_empanel_expert_weight_layer(name);
    if (il < 0 || il >= (int32_t) g_load->n_slots.size() || g_load->n_slots[il] <= 0) {
        return 0;
    }
    if (ggml_n_dims(meta) != 3) {
        throw std::runtime_error(format("empanel: routed-expert tensor %s is not 3-D", name));
    }
    g_load->n_expert    = (int32_t) meta->ne[2];
    g_load->phase[name] = file_offset % LLAMA_EMPANEL_READ_ALIGN;
    return g_load->n_slots[il];
}

void llama_empanel_observe(ggml_tensor * t) {
    if (!g_load) {
        return;
    }
    // a paged layer's router and biases, for the gate-ahead guesses of the layers before it
    int  rl  = -1;
    int  end = 0;
    char kind[32] = {0};
    if (g_load->guess_depth > 0 && sscanf(ggml_get_name(t), "blk.%d.%31[a-z_.]%n", &rl, kind, &end) == 2 &&
        ggml_get_name(t)[end] == '\0' && rl >= 0 && rl < (int32_t) g_load->n_slots.size() && g_load->n_slots[rl] > 0) {
        if (strcmp(kind, "ffn_gate_inp.weight") == 0) { g_load->routers[rl]       = t; }
        if (strcmp(kind, "ffn_gate_inp.bias")   == 0) { g_load->router_biases[rl] = t; }
        if (strcmp(kind, "exp_probs_b.bias")    == 0) { g_load->probs_biases[rl]  = t; }
    }
    const int32_t il = llama_empanel_expert_weight_layer(ggml_get_name(t));
    if (il >= 0 && il < (int32_t) g_load->n_slots.size() && g_load->n_slots[il] < 0) {
        g_load->observed.push_back(t);
    }
}

ggml_context * llama_empanel_pool_ctx(ggml_backend_buffer_type_t buft) {
    GGML_ASSERT(g_load);
    auto it = g_load->pool_ctxs.find(buft);
    if (it != g_load->pool_ctxs.end()) {
        return it->second.get();
    }
    ggml_init_params params = {
        /*.mem_size   =*/ ggml_tensor_overhead()*4*g_load->n_slots.size(), // up to 4 kinds per layer
        /*.mem_buffer =*/ NULL,
        /*.no_alloc   =*/ true,
    };
    ggml_context * ctx = ggml_init(params);
    if (!ctx) {
        throw std::runtime_error("empanel: failed to create the pool context");
    }
    g_load->pool_ctxs.emplace(buft, ggml_context_ptr(ctx));
    return ctx;
}

// pools in plain host memory: each pool's data at its file offset modulo the O_DIRECT block, so
// that the sidecar's reads land in its slots with no copy (csrc/reader.c); a block more per pool
static ggml_backend_buffer_t llama_empanel_alloc_at_phase(ggml_context * ctx, ggml_backend_buffer_type_t buft) {
    const size_t block = LLAMA_EMPANEL_READ_ALIGN;
    const size_t align = ggml_backend_buft_get_alignment(buft);
    auto phase_of = [&](const ggml_tensor * t) {
        auto it = g_load->phase.find(ggml_get_name(t));
        return it != g_load->phase.end() && it->second % align == 0 ? it->second : 0;
    };
    size_t size = 0; // from the first block boundary of the buffer
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
        size = GGML_PAD(size, block) + phase_of(t) + ggml_backend_buft_get_alloc_size(buft, t);
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, size + block);
    if (buf == nullptr) {
        return nullptr;
    }
    char * base = (char *) ggml_backend_buffer_get_base(buf);
    char * at   = base;
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
        at = (char *) GGML_PAD((uintptr_t) at, block) + phase_of(t);
        if (ggml_backend_tensor_alloc(buf, t, at) != GGML_STATUS_SUCCESS) {
            ggml_backend_buffer_free(buf);
            return nullptr;
        }
        at += ggml_backend_buft_get_alloc_size(buft, t);
    }
    return buf;
}

// a token's experts must fit a layer's pools at once (MUL_MAT_ID's slot ids, and the masked
// waves' fillers): a plan with fewer slots is refused here, not asserted in the graph
static void llama_empanel_check_top_k(const llama_model * model) {
    for (uint32_t il = 0; il < g_load->n_slots.size() && il < model->hparams.n_layer_all; il++) {
        const int32_t  n    = g_load->n_slots[il];
        const uint32_t topk = model->hparams.n_expert_used(il);
        if (n > 0 && (uint32_t) n < topk) {
            throw std::runtime_error(format("empanel: layer %u has %d slots, fewer than the %u experts a token "
                    "uses: plan at least top-k slots per layer", il, n, topk));
        }
    }
}

// (st_dev, st_ino) of each file the loader read, (0, 0) where fstat fails
static std::vector<std::pair<uint64_t, uint64_t>> llama_empanel_file_ids(const llama_files & files) {
    std::vector<std::pair<uint64_t, uint64_t>> ids;
#ifndef _WIN32
    for (const auto & file : files) {
        struct stat st;
        const bool ok = fstat(file->file_id(), &st) == 0;
        ids.emplace_back(ok ? (uint64_t) st.st_dev : 0, ok ? (uint64_t) st.st_ino : 0);
    }
#else
    GGML_UNUSED(files);
#endif
    return ids;
}

// whether the waves of pools in buf are masked. The CPU and Vulkan kernels skip other waves'
// pairs; pools another backend's kernel may compute on (its device memory; plain host memory
// that op offload may copy, since the scheduler copies a weight to the device once per graph)
// mask them instead. CPU_REPACK pools are never offloaded (their buffer is not plain host memory)
static bool llama_empanel_masks_waves(ggml_backend_buffer_t buf) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
    const bool device_masks  = !llama_empanel_buffer_in_host_memory(buf) && (g_load->mask_all || dev == nullptr ||
                               !llama_empanel_backend_skips_pairs(ggml_backend_dev_backend_reg(dev)));
    const bool offload_masks = ggml_backend_buffer_is_host(buf) && (g_load->gpu || g_load->mask_all);
    return device_masks || offload_masks;
}

// gate-ahead guesses: each paged layer guesses the next guess_depth paged layers with a router
static void llama_empanel_wire_guesses(const std::map<int32_t, llama_empanel_layer *> & layer_of) {
    std::vector<llama_empanel_layer *> paged; // ascending il
    for (auto & [il, layer] : layer_of) {
        if (!layer->observe && !layer->pinned && g_load->routers.count(il)) {
            layer->router      = g_load->routers[il];
            layer->router_bias = g_load->router_biases.count(il) ? g_load->router_biases[il] : nullptr;
            layer->probs_bias  = g_load->probs_biases.count(il)  ? g_load->probs_biases[il]  : nullptr;
            layer->guess       = g_load->guess;
            paged.push_back(layer);
        }
    }
    for (size_t i = 0; i < paged.size(); i++) {
        for (int32_t d = 1; d <= g_load->guess_depth && i + d < paged.size(); d++) {
            paged[i]->guesses.push_back({ paged[i + d], d });
        }
    }
}

void llama_empanel_alloc_pools(const llama_model * model, bool no_alloc, llama_empanel_ctxs_bufs & ctxs_bufs,
                               const llama_files & files) {
    if (!g_load || (g_load->pool_ctxs.empty() && g_load->observed.empty())) {
        return;
    }
    llama_empanel_check_top_k(model);
    llama_empanel_model entry;
    entry.files = llama_empanel_file_ids(files);
    std::map<int32_t, llama_empanel_layer *> layer_of; // il -> its remap state
    auto layer_for = [&](int32_t il, bool observe) {
        if (layer_of.find(il) == layer_of.end()) {
            auto layer = std::make_unique<llama_empanel_layer>();
            layer->il       = il;
            layer->remap    = g_load->remap;
            layer->user     = g_load->user;
            layer->subst    = observe ? nullptr : g_load->subst;
            layer->subst_alt = g_load->subst_alt;
            layer->ready    = observe ? nullptr : g_load->ready;
            layer->observe  = observe;
            layer->n_slots  = observe ? 0 : g_load->n_slots[il];
            layer->n_expert = g_load->n_expert;
            layer->waves    = !observe && !no_alloc;
            layer->pinned   = !observe && g_load->pinned && layer->n_slots >= layer->n_expert;
            entry.layers.push_back(std::move(layer));
            layer_of[il] = entry.layers.back().get();
        }
        return layer_of[il];
    };

    for (auto & [buft, ctx_ptr] : g_load->pool_ctxs) {
        ggml_context * ctx = ctx_ptr.get();
        ggml_backend_buffer_t buf;
        if (no_alloc) {
            buf = ggml_backend_buft_alloc_buffer(buft, 0); // dummy buffer, as for the other weights
            for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
                t->buffer = buf;
            }
        } else {
            buf = ggml_backend_buft_is_host(buft) ? llama_empanel_alloc_at_phase(ctx, buft)
                                                  : ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
            if (buf == nullptr) {
                throw std::runtime_error(format("empanel: unable to allocate the %s slot pools", ggml_backend_buft_name(buft)));
            }
            // never-loaded slots hold zeros, never NaN garbage. Host pools are zeroed by the
            // sidecar page by page instead (csrc/backend.c), so that slots that
            // hold no expert take no memory.
            if (!llama_empanel_buffer_in_host_memory(buf)) {
                ggml_backend_buffer_clear(buf, 0);
            }
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        LLAMA_LOG_INFO("%s: %12s slot pools size = %8.2f MiB\n", __func__,
                ggml_backend_buffer_name(buf), ggml_backend_buffer_get_size(buf)/1024.0/1024.0);

        for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
            llama_empanel_layer * layer = layer_for(llama_empanel_expert_weight_layer(ggml_get_name(t)), false);
            layer->n_pools++;
            if (llama_empanel_masks_waves(buf)) {
                layer->masked.insert(t);
            }
            entry.pools[ggml_get_name(t)] = t;
        }
        std::vector<ggml_backend_buffer_ptr> bufs;
        bufs.emplace_back(buf);
        ctxs_bufs.emplace_back(std::move(ctx_ptr), std::move(bufs));
    }
    g_load->pool_ctxs.clear();

    llama_empanel_wire_guesses(layer_of);
    entry.observed = std::move(g_load->observed);
    g_load->observed.clear();
    if (std::any_of(entry.layers.begin(), entry.layers.end(), [](const auto & layer) { return !layer->pinned; })) {
        entry.graph_lock = std::make_unique<std::mutex>();
    }

    std::lock_guard<std::mutex> lock(g_mutex);
    for (auto & [name, t] : entry.pools) {
        g_pool_layer[t] = layer_of.at(llama_empanel_expert_weight_layer(name.c_str()));
    }
    for (ggml_tensor * t : entry.observed) {
        g_pool_layer[t] = layer_for(llama_empanel_expert_weight_layer(ggml_get_name(t)), true);
    }
    g_models[model] = std::move(entry);
}

void llama_empanel_model_free(const llama_model * model) {
    llama_empanel_program_close(model);
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_models.find(model);
    if (it == g_models.end()) {
        return;
    }
    for (auto & [name, t] : it->second.pools) {
        GGML_UNUSED(name);
        g_pool_layer.erase(t);
    }
    for (ggml_tensor * t : it->second.observed) {
        g_pool_layer.erase(t);
    }
    g_models.erase(it);
}

int32_t llama_empanel_n_pools(const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_models.find(model);
    return it == g_models.end() ? 0 : (int32_t) it->second.pools.size();
}

bool llama_empanel_pool_info(const llama_model * model, const char * name, struct llama_empanel_pool_info * info) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_models.find(model);
    if (it == g_models.end()) {
        return false;
    }
    auto jt = it->second.pools.find(name);
    if (jt == it->second.pools.end()) {
        return false;
    }
    ggml_tensor * t = jt->second;
    info->tensor     = t;
    info->n_slots    = ggml_n_dims(t) <= 3 && t->ne[3] == 1 ? t->ne[2] : -1;
    info->slot_bytes = (uint64_t) t->nb[2];
    auto lt = g_pool_layer.find(t);
    info->masked     = lt != g_pool_layer.end() && lt->second->masked.count(t) > 0;
    return true;
}

//
// graph
//

int32_t llama_empanel_model_file(const llama_model * model, int32_t i, uint64_t * dev, uint64_t * ino) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_models.find(model);
    if (it == g_models.end()) {
        return 0;
    }
    const auto & files = it->second.files;
    if (i >= 0 && i < (int32_t) files.size()) {
        *dev = files[i].first;
        *ino = files[i].second;
    }
    return (int32_t) files.size();
}

bool llama_empanel_is_pool(const ggml_tensor * w) {
    if (w == nullptr) {
        return false;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_pool_layer.find(w);
    return it != g_pool_layer.end() && !it->second->observe && !it->second->pinned;
}

// the sidecar's remap: slot_ids [n_used, n_tokens] (contiguous) for a = expert ids [n_used,
// n_tokens] of one wave of one pool (wave == NULL: all the layer's pools, one wave); 0 on success
static int32_t llama_empanel_call_remap(const llama_empanel_layer * layer, const llama_empanel_wave * wave,
                                  const ggml_tensor * a, int32_t * slot_ids) {
    return layer->remap(layer->user, layer->il,
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
    if (ith == 0) {
        llama_empanel_run_remap(dst, a, (const llama_empanel_layer *) userdata, nullptr);
    }
}

// the first wave of a pool: a = expert ids
static void llama_empanel_wave_first_op(ggml_tensor * dst, const ggml_tensor * a, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith == 0) {
        const auto * wave = (const llama_empanel_wave *) userdata;
        llama_empanel_run_remap(dst, a, wave->layer, wave);
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

static llama_empanel_layer * llama_empanel_layer_of(const ggml_tensor * w) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_pool_layer.find(w);
    return it == g_pool_layer.end() ? nullptr : it->second;
}

// CPU op: dst = a (this layer's slot ids), and the guess b (expert ids [n_used, n_tokens] of a
// later layer) handed to the sidecar: after this layer's remap, before its experts compute
static void llama_empanel_guess_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    memcpy(dst->data, a->data, ggml_nbytes(a));
    const llama_empanel_guess * g = (const llama_empanel_guess *) userdata;
    g->target->guess(g->target->user, g->target->il, g->distance, (const int32_t *) b->data,
                     b->nb[1]/sizeof(int32_t), (int32_t) b->ne[0], (int32_t) b->ne[1]);
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
    layer->subst(layer->user, layer->il, (int32_t *) dst->data, dst->nb[1]/sizeof(int32_t), (int32_t) a->ne[0],
                 (const int32_t *) b->data, b->nb[1]/sizeof(int32_t), (int32_t) b->ne[0],
                 (const float *) c->data, c->nb[1]/sizeof(float), (int32_t) a->ne[1]);
}

ggml_tensor * llama_empanel_build_subst(ggml_context * ctx, const ggml_tensor * w, ggml_tensor * scores,
                                        ggml_tensor * selected, int gating_op, int64_t n_used) {
    llama_empanel_layer * layer = llama_empanel_layer_of(w);
    // scores must be positive probabilities for "at least r x the missing one's"
    if (layer == nullptr || layer->pinned || layer->subst == nullptr || gating_op == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT ||
        scores->type != GGML_TYPE_F32 || !ggml_is_contiguous(scores)) {
        return selected;
    }
    const int64_t n_cand = std::min<int64_t>(n_used + layer->subst_alt, scores->ne[0]);
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
    if (ith != 0) {
        return;
    }
    const auto * ready = (const llama_empanel_ready *) userdata;
    if (ready->layer->ready(ready->layer->user, ready->layer->il, ready->pool) == 0) {
        memcpy(dst->data, a->data, ggml_nbytes(a));
    } else {
        memset(dst->data, 0, ggml_nbytes(dst)); // slot 0; the sidecar's abort callback stops this graph
    }
}

// one wave over pool w (ids: the layer's slot ids): in host memory, the MUL_MAT_ID first waits for
// the pool's reads (llama_empanel_set_ready), while the reads of the layer's other pools go on
static ggml_tensor * llama_empanel_ready_mul_mat_id(ggml_context * ctx, ggml_tensor * w, ggml_tensor * cur, ggml_tensor * ids) {
    llama_empanel_layer * layer = llama_empanel_layer_of(w);
    if (layer == nullptr || layer->ready == nullptr || layer->pinned || layer->observe ||
        w->buffer == nullptr || !llama_empanel_buffer_in_host_memory(w->buffer)) {
        return ggml_mul_mat_id(ctx, w, cur, ids);
    }
    llama_empanel_ready * ready;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto & op = layer->ready_ops[w];
        if (!op) {
            op = std::make_unique<llama_empanel_ready>(llama_empanel_ready { layer, w });
        }
        ready = op.get();
    }
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
        llama_empanel_wave * wave;
        {
            std::lock_guard<std::mutex> lock(g_mutex);
            auto & op = layer->wave_ops[std::make_tuple(w, iw, n_waves)];
            if (!op) {
                op = std::make_unique<llama_empanel_wave>(llama_empanel_wave { layer, w, iw, n_waves });
            }
            wave = op.get();
        }
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

// Two contexts on one model share its pools: the slots one context's remap fills are read by
// that context's MUL_MAT_IDs later in its graph, and its waves, read-ahead and the read batch in
// flight span several ops of that graph. So one graph at a time computes over a model's pools
// (paged or observed; pinned pools never change): a second context's graph waits for the first
// one's to end, and each sees the pools as if it were alone, which is what stock gives.
void * llama_empanel_graph_begin(const llama_model * model) {
    std::mutex * graph_lock = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_models.find(model);
        graph_lock = it != g_models.end() ? it->second.graph_lock.get() : nullptr;
    }
    if (graph_lock != nullptr) {
        graph_lock->lock(); // the model outlives its contexts' computations: the lock stays
    }
    return graph_lock;
}

void llama_empanel_graph_end(void * graph, ggml_backend_sched_t sched) {
    if (graph == nullptr) {
        return;
    }
    // the last kernels may still run on a device (the computation is asynchronous), reading slots
    // that the next context's remap may overwrite
    ggml_backend_sched_synchronize(sched);
    static_cast<std::mutex *>(graph)->unlock();
}

uint32_t llama_empanel_graph_extra_nodes(const llama_model * model, uint32_t n_tokens) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_models.find(model);
    if (it == g_models.end()) {
        return 0;
    }
    uint32_t n = 0;
    for (const auto & layer : it->second.layers) {
        if (layer->pinned) {
            continue; // stock's graph
        }
        // per wave and pool a remap, a view and a MUL_MAT_ID (masked: also the mask, the mul and
        // the add); at most n_expert used per token (a warmup routes to all of them), and room for
        // the cb() names' views
        n += 8u * (uint32_t) (llama_empanel_n_waves(layer.get(), n_tokens, layer->n_expert) * layer->n_pools) + 2u;
        n += 8u * (uint32_t) layer->guesses.size(); // a guess: matmul, biases, gating, top-k, the op
        n += layer->subst != nullptr ? 4u : 0u;     // substitution: top-k candidates and the op
    }
    return n;
}

// ------------------------------------------------------------------------------------------------
// RPC hosts

typedef bool (*llama_empanel_rpc_backend_failed_fn)(ggml_backend_t backend);

bool llama_empanel_hosts_ok(ggml_backend_sched_t sched) {
    // called after every decode: looked up once (ggml registers its built-in backends at start;
    // RPC servers add devices to the RPC registry, not registries of their own to look for)
    static const ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    static const auto failed = reg == nullptr ? nullptr :
        (llama_empanel_rpc_backend_failed_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_backend_failed");
    if (failed == nullptr) {
        return true;
    }
    bool synced = false;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        if (dev == nullptr || ggml_backend_dev_backend_reg(dev) != reg) {
            continue; // not on an RPC host
        }
        if (!synced) { // the batch's last commands (its outputs among them) may still be under way
            ggml_backend_sched_synchronize(sched);
            synced = true;
        }
        if (failed(backend)) {
            return false;
        }
    }
    return true;
}
