// empanel hooks, the loader's side: the library's version, and the plan of the load running on
// this thread (llama_empanel_set_plan and the calls after it), which the loader asks which
// routed-expert tensors become pools, and in which context it makes them. At the end of the load
// llama-empanel-pools.cpp allocates the pools; llama-empanel-registry.cpp keeps them by model.

#include "llama-empanel.h"
#include "llama-empanel-impl.h"
#include "llama-empanel-state.h"

#include "llama-impl.h"

#include "ggml-backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

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
// the plan of the load on this thread
//

static thread_local std::unique_ptr<llama_empanel_load> g_load;

llama_empanel_load * llama_empanel_this_load() {
    return g_load.get();
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
    g_load->hooks.remap = remap;
    g_load->hooks.user  = user;
    // op offload may take plain host pools' MUL_MAT_IDs to a GPU. EMPANEL_WAVE_MASK=1 masks the
    // waves of device and plain host pools on any build (tests run masked waves on the CPU;
    // scripts/gpu_check.py --waves compares them on a GPU)
    const char * mask = getenv("EMPANEL_WAVE_MASK");
    g_load->mask_all = mask != nullptr && strcmp(mask, "1") == 0;
    g_load->gpu      = llama_empanel_offload_gpu();
}

void llama_empanel_set_guess(llama_empanel_guess_fn guess, int32_t depth) {
    if (g_load) {
        g_load->hooks.guess       = guess;
        g_load->hooks.guess_depth = guess != nullptr && depth > 0 ? depth : 0;
    }
}

void llama_empanel_set_subst(llama_empanel_subst_fn subst, int32_t n_alt) {
    if (g_load) {
        g_load->hooks.subst     = subst;
        g_load->hooks.subst_alt = subst != nullptr && n_alt > 0 ? n_alt : 0;
    }
}

void llama_empanel_set_ready(llama_empanel_ready_fn ready) {
    if (g_load) {
        g_load->hooks.ready = ready;
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

//
// the loader's questions: which tensors become pools, where they are made
//

// "blk.<il>.ffn_<gate|up|down|gate_up>_exps.weight" -> il, else -1
int32_t llama_empanel_expert_weight_layer(const char * name) {
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
    if (g_load->hooks.guess_depth > 0 && sscanf(ggml_get_name(t), "blk.%d.%31[a-z_.]%n", &rl, kind, &end) == 2 &&
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
