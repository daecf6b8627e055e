// empanel hooks, the registry of loaded models: each model's entry (its pools by GGUF name, its
// layers, the load's callbacks, the files its loader read, its graph lock) and the layer of each
// pool tensor and observed weight, which the graph builder looks up (llama-empanel-graph.cpp;
// the registry calls nothing of it); what the sidecar asks of a loaded model (llama_empanel_n_pools, _pool_info, _model_file); and
// the graph lock a context holds while its graph computes over the pools.

#include "llama-empanel.h"
#include "llama-empanel-impl.h"
#include "llama-empanel-state.h"

#include "ggml-backend.h"

#include <functional>
#include <map>
#include <mutex>

static std::mutex                                            g_mutex;
static std::map<const llama_model *, llama_empanel_model>   g_models;
static std::map<const ggml_tensor *, llama_empanel_layer *> g_pool_layer; // pool tensor -> its layer

void llama_empanel_model_add(const llama_model * model, llama_empanel_model && entry,
                             const std::vector<std::pair<const ggml_tensor *, llama_empanel_layer *>> & tensors) {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto & [t, layer] : tensors) {
        g_pool_layer[t] = layer;
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

llama_empanel_layer * llama_empanel_layer_of(const ggml_tensor * w) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_pool_layer.find(w);
    return it == g_pool_layer.end() ? nullptr : it->second;
}

llama_empanel_wave * llama_empanel_wave_of(llama_empanel_layer * layer, const ggml_tensor * w, int32_t iw, int32_t n_waves) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto & op = layer->wave_ops[std::make_tuple(w, iw, n_waves)];
    if (!op) {
        op = std::make_unique<llama_empanel_wave>(llama_empanel_wave { layer, w, iw, n_waves });
    }
    return op.get();
}

llama_empanel_ready * llama_empanel_ready_of(llama_empanel_layer * layer, const ggml_tensor * w) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto & op = layer->ready_ops[w];
    if (!op) {
        op = std::make_unique<llama_empanel_ready>(llama_empanel_ready { layer, w });
    }
    return op.get();
}

bool llama_empanel_is_pool(const ggml_tensor * w) {
    if (w == nullptr) {
        return false;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_pool_layer.find(w);
    return it != g_pool_layer.end() && !it->second->observe && !it->second->pinned;
}

//
// what the sidecar asks of a loaded model
//

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

//
// what a context asks of a loaded model
//

void llama_empanel_each_layer(const llama_model * model, const std::function<void(const llama_empanel_layer &)> & fn) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_models.find(model);
    if (it == g_models.end()) {
        return;
    }
    for (const auto & layer : it->second.layers) {
        fn(*layer);
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
