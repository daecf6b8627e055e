#pragma once

// what our own sources share (internal to them; llama.cpp's files include llama-empanel-impl.h):
// the sidecar's callbacks of a load, the state of a load on this thread, of a paged layer and of a
// loaded model, and the lookups between the files that keep them:
//   llama-empanel.cpp          the plan of the load on this thread (llama_empanel_this_load)
//   llama-empanel-pools.cpp    its pools allocated at the end of the load, the model's entry made
//   llama-empanel-registry.cpp the loaded models' entries, by model and by pool tensor
//   llama-empanel-graph.cpp    the ops built over a layer's pools (the op userdata below)

#include "llama-empanel-shared.h"

#include "ggml.h"
#include "ggml-cpp.h"

#include <array>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

// the sidecar's callbacks of one load (llama_empanel_set_plan, _set_guess, _set_subst,
// _set_ready): set on the plan, then held once by the model, each layer pointing at them
struct llama_empanel_hooks {
    llama_empanel_remap_fn remap       = nullptr;
    void                 * user        = nullptr; // the first argument of every callback
    llama_empanel_guess_fn guess       = nullptr;
    int32_t                guess_depth = 0;       // paged layers each one guesses (0: none)
    llama_empanel_subst_fn subst       = nullptr;
    int32_t                subst_alt   = 0;       // choices beyond top-k handed to subst
    llama_empanel_ready_fn ready       = nullptr;
};

struct llama_empanel_layer;

// an op that one thread runs (ith 0: a remap, a wait for reads) while ggml's other threads wait
// for it here, briefly spinning and then asleep, rather than spinning in ggml's barrier after
// the node, where a read-bound op would burn the cores the reads need
// (llama-empanel-graph.cpp, llama_empanel_once_first). Each op runs once per graph computation
#define LLAMA_EMPANEL_ONCE_THREADS 64 // threads ith < this wait asleep; the others spin as before
struct llama_empanel_once {
    std::atomic<uint32_t> done{0};     // runs thread 0 has finished
    std::atomic<int32_t>  sleepers{0}; // threads asleep on cv
    std::array<std::atomic<uint32_t>, LLAMA_EMPANEL_ONCE_THREADS> entered{}; // runs thread ith entered
    std::mutex              m;
    std::condition_variable cv;
};
using llama_empanel_once_ptr = std::unique_ptr<llama_empanel_once>;

// what the remap op of one wave of one pool calls (the op's userdata)
struct llama_empanel_wave {
    llama_empanel_layer  * layer;
    const ggml_tensor    * pool;
    int32_t                wave;
    int32_t                n_waves;
    llama_empanel_once_ptr once = std::make_unique<llama_empanel_once>();
};

// what the ready op of one pool calls (the op's userdata)
struct llama_empanel_ready {
    llama_empanel_layer  * layer;
    const ggml_tensor    * pool;
    llama_empanel_once_ptr once = std::make_unique<llama_empanel_once>();
};

// what the guess op of one paged layer for a later one calls (the op's userdata)
struct llama_empanel_guess {
    llama_empanel_layer  * target;   // the layer guessed
    int32_t                distance; // paged layers ahead
    llama_empanel_once_ptr once = std::make_unique<llama_empanel_once>();
};

// what the remap op of one paged layer calls
struct llama_empanel_layer {
    int32_t                il;
    const llama_empanel_hooks * hooks  = nullptr; // the model's callbacks (llama_empanel_model::hooks)
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

    // userdata of the wave remap ops built so far, by (pool, wave, n_waves); of the ready ops, by
    // pool (made under the registry's lock: llama_empanel_wave_of, llama_empanel_ready_of)
    std::map<std::tuple<const ggml_tensor *, int32_t, int32_t>, std::unique_ptr<llama_empanel_wave>> wave_ops;
    std::map<const ggml_tensor *, std::unique_ptr<llama_empanel_ready>>                              ready_ops;
    llama_empanel_once_ptr remap_once = std::make_unique<llama_empanel_once>(); // the remap op's

    // the routing substitution (subst) and the ready waits apply to paged layers, never to
    // observed ones
    llama_empanel_subst_fn subst() const { return observe ? nullptr : hooks->subst; }
    llama_empanel_ready_fn ready() const { return observe ? nullptr : hooks->ready; }
};

// the plan and the pools of the load running on this thread
struct llama_empanel_load {
    std::vector<int32_t>   n_slots; // [n_layer]
    int32_t                n_expert = 0;
    bool                   gpu      = false; // a GPU backend may compute on plain host pools
    bool                   mask_all = false; // EMPANEL_WAVE_MASK=1: device and plain host pools masked
    llama_empanel_hooks    hooks;
    bool                   pinned   = false;
    std::map<int32_t, ggml_tensor *> routers, router_biases, probs_biases; // il -> tensor

    std::map<ggml_backend_buffer_type_t, ggml_context_ptr> pool_ctxs;
    std::map<std::string, size_t>                          phase;    // pool name -> its data's file offset
                                                                     // modulo LLAMA_EMPANEL_READ_ALIGN (bytes)
    std::vector<ggml_tensor *>                             observed; // resident weights of observed layers
};

// host pools reserved without commit (llama-empanel-pools.cpp): address space for every slot of
// the capacity, charged only as slots are filled; unmapped with the model's entry
struct llama_empanel_reserve {
    void * addr = nullptr;
    size_t size = 0; // bytes
    llama_empanel_reserve(void * addr, size_t size) : addr(addr), size(size) {}
    llama_empanel_reserve(const llama_empanel_reserve &) = delete;
    llama_empanel_reserve & operator=(const llama_empanel_reserve &) = delete;
    ~llama_empanel_reserve();
};

// the pools of a loaded model
struct llama_empanel_model {
    std::unique_ptr<llama_empanel_hooks>                    hooks;    // the load's, for every layer
    std::map<std::string, ggml_tensor *>                    pools;    // GGUF tensor name -> pool
    std::vector<ggml_tensor *>                              observed; // weights of observed layers
    std::vector<std::unique_ptr<llama_empanel_layer>>      layers;   // userdata of the remap ops
    // held by a context's graph over the pools from the start of its computation to the end of
    // its last kernel (llama_empanel_graph_begin/end); NULL: every layer pinned, nothing shared
    std::unique_ptr<std::mutex>                             graph_lock;
    std::vector<std::pair<uint64_t, uint64_t>>              files;    // (st_dev, st_ino) of each file the loader read
    std::vector<std::unique_ptr<llama_empanel_reserve>>     reserves; // the host pools' ranges (CPU buffers over them)
};

// llama-empanel.cpp: the plan of the load on this thread, nullptr without one
llama_empanel_load * llama_empanel_this_load();

// llama-empanel.cpp: "blk.<il>.ffn_<gate|up|down|gate_up>_exps.weight" -> il, else -1
int32_t llama_empanel_expert_weight_layer(const char * name);

// llama-empanel-registry.cpp: register a loaded model's entry; tensors: each pool and observed
// weight with the layer its ops call
void llama_empanel_model_add(const struct llama_model * model, llama_empanel_model && entry,
                             const std::vector<std::pair<const ggml_tensor *, llama_empanel_layer *>> & tensors);

// llama-empanel-registry.cpp: the layer of a pool tensor or observed weight, nullptr if w is neither
llama_empanel_layer * llama_empanel_layer_of(const ggml_tensor * w);

// llama-empanel-registry.cpp: the userdata of a layer's op, made on first use and kept with the
// layer: the remap of wave iw of n_waves over pool w; the ready wait of pool w
llama_empanel_wave  * llama_empanel_wave_of(llama_empanel_layer * layer, const ggml_tensor * w, int32_t iw, int32_t n_waves);
llama_empanel_ready * llama_empanel_ready_of(llama_empanel_layer * layer, const ggml_tensor * w);

// llama-empanel-registry.cpp: fn on each layer of a model's entry, under the registry's lock
// (nothing for a model without one)
void llama_empanel_each_layer(const struct llama_model * model, const std::function<void(const llama_empanel_layer &)> & fn);
