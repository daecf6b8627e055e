// empanel hooks, the model's side of a load: at its end, the pools of the plan (the pool tensors
// the loader made, llama-empanel.cpp) are allocated in their buffer types and zeroed, each layer's
// state is made (its slots, its masked pools, the later layers it guesses, the load's callbacks)
// and the model's entry is handed to the registry (llama-empanel-registry.cpp).

#include "llama-empanel.h"
#include "llama-empanel-impl.h"
#include "llama-empanel-state.h"

#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#ifndef _WIN32
#include <sys/mman.h>
#include <sys/stat.h>
#endif

// layers by il while a model's entry is made
using llama_empanel_layer_map = std::map<int32_t, llama_empanel_layer *>;

// the backends whose MUL_MAT_ID kernels skip pairs with slot id -1, as wave chains need: the CPU
// (patch 0005) and Vulkan (patch 0011). The others' pools run masked waves
static bool llama_empanel_backend_skips_pairs(ggml_backend_reg_t reg) {
    const char * name = reg != nullptr ? ggml_backend_reg_name(reg) : "";
    return strcmp(name, "CPU") == 0 || strcmp(name, "Vulkan") == 0;
}

llama_empanel_reserve::~llama_empanel_reserve() {
#ifndef _WIN32
    munmap(addr, size);
#endif
}

// a buffer over memory the caller owns: ggml_backend_cpu_buffer_from_ptr, or ggml-cpu's
// CPU_REPACK one (patch 0003)
typedef ggml_backend_buffer_t (*llama_empanel_from_ptr_fn)(void * ptr, size_t size);

// how a buffer of type buft is made over reserved memory: the CPU's own and CPU_REPACK (found by
// its proc address), nullptr for the others
static llama_empanel_from_ptr_fn llama_empanel_from_ptr_of(ggml_backend_buffer_type_t buft) {
    if (buft == ggml_backend_cpu_buffer_type()) {
        return ggml_backend_cpu_buffer_from_ptr;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    ggml_backend_reg_t reg = dev != nullptr ? ggml_backend_dev_backend_reg(dev) : nullptr;
    if (reg == nullptr || strcmp(ggml_backend_buft_name(buft), "CPU_REPACK") != 0) {
        return nullptr;
    }
    return (llama_empanel_from_ptr_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_repack_buffer_from_ptr");
}

// a buffer of size bytes (from_ptr makes it) over address space reserved without commit: a
// capacity of slots larger than memory (and swap) is not refused by the kernel's overcommit
// heuristic, as one malloc of it would be, and untouched slots cost nothing. The range is the
// entry's (reserves), unmapped with it; nullptr where there is no such mapping (the buffer type's
// own allocation then)
static ggml_backend_buffer_t llama_empanel_reserve_buffer(size_t size, llama_empanel_from_ptr_fn from_ptr,
                                                          std::vector<std::unique_ptr<llama_empanel_reserve>> & reserves) {
#if !defined(_WIN32) && defined(MAP_ANONYMOUS)
#ifdef MAP_NORESERVE
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
#else
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#endif
    void * addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (addr == MAP_FAILED) {
        return nullptr;
    }
    auto reserve = std::make_unique<llama_empanel_reserve>(addr, size);
    ggml_backend_buffer_t buf = from_ptr(addr, size);
    if (buf != nullptr) {
        reserves.push_back(std::move(reserve));
    }
    return buf;
#else
    GGML_UNUSED(size);
    GGML_UNUSED(from_ptr);
    GGML_UNUSED(reserves);
    return nullptr;
#endif
}

// pools in host memory: each pool's data at its file offset modulo the O_DIRECT block, so that
// the sidecar's reads land in plain slots with no copy (csrc/reader.c); a block more per pool.
// Pools of the CPU's own buffer type and of CPU_REPACK are reserved without commit
// (llama_empanel_reserve_buffer)
static ggml_backend_buffer_t llama_empanel_alloc_at_phase(const llama_empanel_load & load, ggml_context * ctx,
                                                          ggml_backend_buffer_type_t buft,
                                                          std::vector<std::unique_ptr<llama_empanel_reserve>> & reserves) {
    const size_t block = LLAMA_EMPANEL_READ_ALIGN;
    const size_t align = ggml_backend_buft_get_alignment(buft);
    auto phase_of = [&](const ggml_tensor * t) {
        auto it = load.phase.find(ggml_get_name(t));
        return it != load.phase.end() && it->second % align == 0 ? it->second : 0;
    };
    size_t size = 0; // from the first block boundary of the buffer
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
        size = GGML_PAD(size, block) + phase_of(t) + ggml_backend_buft_get_alloc_size(buft, t);
    }
    llama_empanel_from_ptr_fn from_ptr = llama_empanel_from_ptr_of(buft);
    ggml_backend_buffer_t buf = from_ptr != nullptr ? llama_empanel_reserve_buffer(size + block, from_ptr, reserves) : nullptr;
    if (buf == nullptr) {
        buf = ggml_backend_buft_alloc_buffer(buft, size + block);
    }
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

// the buffer of the pools in ctx (buffer type buft), zeroed where it is device memory; a no_alloc
// load (a program sizing its memory) gets a dummy buffer, as for the other weights
static ggml_backend_buffer_t llama_empanel_alloc_pool_buffer(const llama_empanel_load & load, ggml_context * ctx,
                                                             ggml_backend_buffer_type_t buft, bool no_alloc,
                                                             std::vector<std::unique_ptr<llama_empanel_reserve>> & reserves) {
    ggml_backend_buffer_t buf;
    if (no_alloc) {
        buf = ggml_backend_buft_alloc_buffer(buft, 0);
        for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
            t->buffer = buf;
        }
    } else {
        buf = ggml_backend_buft_is_host(buft) || llama_empanel_from_ptr_of(buft) != nullptr
            ? llama_empanel_alloc_at_phase(load, ctx, buft, reserves)
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
    return buf;
}

// a token's experts must fit a layer's pools at once (MUL_MAT_ID's slot ids, and the masked
// waves' fillers): a plan with fewer slots is refused here, not asserted in the graph
static void llama_empanel_check_top_k(const llama_empanel_load & load, const llama_model * model) {
    for (uint32_t il = 0; il < load.n_slots.size() && il < model->hparams.n_layer_all; il++) {
        const int32_t  n    = load.n_slots[il];
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
static bool llama_empanel_masks_waves(const llama_empanel_load & load, ggml_backend_buffer_t buf) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
    const bool device_masks  = !llama_empanel_buffer_in_host_memory(buf) && (load.mask_all || dev == nullptr ||
                               !llama_empanel_backend_skips_pairs(ggml_backend_dev_backend_reg(dev)));
    const bool offload_masks = ggml_backend_buffer_is_host(buf) && (load.gpu || load.mask_all);
    return device_masks || offload_masks;
}

// layer il of the model's entry, made on first use: paged (its pools' slots), or observed (no
// pool: the remap sees its expert ids)
static llama_empanel_layer * llama_empanel_layer_for(const llama_empanel_load & load, llama_empanel_model & entry,
                                                     llama_empanel_layer_map & layer_of, int32_t il, bool observe,
                                                     bool no_alloc) {
    if (layer_of.find(il) == layer_of.end()) {
        auto layer = std::make_unique<llama_empanel_layer>();
        layer->il       = il;
        layer->hooks    = entry.hooks.get();
        layer->observe  = observe;
        layer->n_slots  = observe ? 0 : load.n_slots[il];
        layer->n_expert = load.n_expert;
        layer->waves    = !observe && !no_alloc;
        layer->pinned   = !observe && load.pinned && layer->n_slots >= layer->n_expert;
        entry.layers.push_back(std::move(layer));
        layer_of[il] = entry.layers.back().get();
    }
    return layer_of[il];
}

// the pool tensors of one buffer into the entry: each counted in its layer, masked or not
static void llama_empanel_add_pools(const llama_empanel_load & load, llama_empanel_model & entry,
                                    llama_empanel_layer_map & layer_of, ggml_context * ctx, ggml_backend_buffer_t buf,
                                    bool no_alloc) {
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
        const int32_t il = llama_empanel_expert_weight_layer(ggml_get_name(t));
        llama_empanel_layer * layer = llama_empanel_layer_for(load, entry, layer_of, il, false, no_alloc);
        layer->n_pools++;
        if (llama_empanel_masks_waves(load, buf)) {
            layer->masked.insert(t);
        }
        entry.pools[ggml_get_name(t)] = t;
    }
}

// gate-ahead guesses: each paged layer guesses the next guess_depth paged layers with a router
static void llama_empanel_wire_guesses(const llama_empanel_load & load, const llama_empanel_layer_map & layer_of) {
    std::vector<llama_empanel_layer *> paged; // ascending il
    for (auto & [il, layer] : layer_of) {
        if (!layer->observe && !layer->pinned && load.routers.count(il)) {
            layer->router      = load.routers.at(il);
            layer->router_bias = load.router_biases.count(il) ? load.router_biases.at(il) : nullptr;
            layer->probs_bias  = load.probs_biases.count(il)  ? load.probs_biases.at(il)  : nullptr;
            paged.push_back(layer);
        }
    }
    for (size_t i = 0; i < paged.size(); i++) {
        for (int32_t d = 1; d <= load.hooks.guess_depth && i + d < paged.size(); d++) {
            paged[i]->guesses.push_back({ paged[i + d], d });
        }
    }
}

// each pool and observed weight with the layer its ops call (observed layers made here, after
// the paged ones)
static std::vector<std::pair<const ggml_tensor *, llama_empanel_layer *>> llama_empanel_tensor_layers(
        const llama_empanel_load & load, llama_empanel_model & entry, llama_empanel_layer_map & layer_of, bool no_alloc) {
    std::vector<std::pair<const ggml_tensor *, llama_empanel_layer *>> tensors;
    for (auto & [name, t] : entry.pools) {
        tensors.emplace_back(t, layer_of.at(llama_empanel_expert_weight_layer(name.c_str())));
    }
    for (ggml_tensor * t : entry.observed) {
        const int32_t il = llama_empanel_expert_weight_layer(ggml_get_name(t));
        tensors.emplace_back(t, llama_empanel_layer_for(load, entry, layer_of, il, true, no_alloc));
    }
    return tensors;
}

void llama_empanel_alloc_pools(const llama_model * model, bool no_alloc, llama_empanel_ctxs_bufs & ctxs_bufs,
                               const llama_files & files) {
    llama_empanel_load * load = llama_empanel_this_load();
    if (!load || (load->pool_ctxs.empty() && load->observed.empty())) {
        return;
    }
    llama_empanel_check_top_k(*load, model);
    llama_empanel_model entry;
    entry.hooks = std::make_unique<llama_empanel_hooks>(load->hooks);
    entry.files = llama_empanel_file_ids(files);
    llama_empanel_layer_map layer_of; // il -> its remap state

    for (auto & [buft, ctx_ptr] : load->pool_ctxs) {
        ggml_context * ctx = ctx_ptr.get();
        ggml_backend_buffer_t buf = llama_empanel_alloc_pool_buffer(*load, ctx, buft, no_alloc, entry.reserves);
        LLAMA_LOG_INFO("%s: %12s slot pools size = %8.2f MiB\n", __func__,
                ggml_backend_buft_name(buft), ggml_backend_buffer_get_size(buf)/1024.0/1024.0);
        llama_empanel_add_pools(*load, entry, layer_of, ctx, buf, no_alloc);

        std::vector<ggml_backend_buffer_ptr> bufs;
        bufs.emplace_back(buf);
        ctxs_bufs.emplace_back(std::move(ctx_ptr), std::move(bufs));
    }
    load->pool_ctxs.clear();

    llama_empanel_wire_guesses(*load, layer_of);
    entry.observed = std::move(load->observed);
    load->observed.clear();
    if (std::any_of(entry.layers.begin(), entry.layers.end(), [](const auto & layer) { return !layer->pinned; })) {
        entry.graph_lock = std::make_unique<std::mutex>();
    }
    const auto tensors = llama_empanel_tensor_layers(*load, entry, layer_of, no_alloc);
    llama_empanel_model_add(model, std::move(entry), tensors);
}
