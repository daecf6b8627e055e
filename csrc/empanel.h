#pragma once

// empanel sidecar: the C side of empanel-gguf. For every paged MoE layer it keeps which expert
// sits in which slot of the layer's pools, picks victims on a miss, and reads the missing experts'
// bytes from the GGUF file with pread on its own file descriptors.
//
// Python (empanel_gguf/_native.py, cffi in ABI mode) reads this header with preprocessor lines
// and comments removed: keep the declarations plain C.

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(EMPANEL_BUILD)
#    define EMPANEL_API __declspec(dllexport)
#elif defined(_WIN32)
#    define EMPANEL_API __declspec(dllimport)
#else
#    define EMPANEL_API __attribute__((visibility("default")))
#endif

#define EMPANEL_SIDECAR_VERSION 9

// one routed-expert tensor of one layer, as it lies in the GGUF file
struct empanel_tensor_desc {
    int32_t      layer;        // MoE layer index (blk.N)
    int32_t      file;         // index into the paths given to empanel_pool_init
    uint64_t     offset;       // bytes: where expert 0's slice starts in that file
    uint64_t     expert_size;  // bytes of one expert's slice (nb2)
    const char * name;         // GGUF tensor name, e.g. "blk.3.ffn_down_exps.weight"
};

// how the pool reads; zeros pick the defaults
struct empanel_pool_params {
    int32_t  n_threads;    // reader threads besides the caller (default 8)
    uint32_t chunk_bytes;  // bytes per read request (default 256 KiB; rounded to 4 KiB)
    int32_t  direct_io;    // 1: O_DIRECT (default), -1: buffered reads through the page cache
    int32_t  policy;       // enum empanel_policy
    uint64_t budget_bytes; // EMPANEL_POLICY_GLRU: bytes of resident experts over all layers
    int32_t  prefetch;     // paged layers ahead whose guessed misses are read (empanel_guess); 0: guesses
                           // only order eviction
    float    subst_ratio;  // routing substitution (empanel_subst): a resident stand-in needs at least this
                           // share of the missing expert's score; 0: off
    int32_t  verify;       // 1: hash every expert read (XXH3-64) and check it against its digest
                           // (empanel_pool_set_digests, else the digest of its first read)
};

// eviction policies (struct empanel_pool_params.policy); Python reads these names through cffi
enum empanel_policy {
    EMPANEL_POLICY_LRU       = 0, // per layer: evict the least recently used expert
    EMPANEL_POLICY_LFU_DECAY = 1, // per layer: evict the least frequently used, counts halving
                                  // every n_slots micro-batches of the layer
    EMPANEL_POLICY_GLRU      = 2  // one budget for all layers: evict the least recently used expert
                                  // of any layer; a layer's pool is its most, never-used slots take
                                  // no memory (host pools)
};

// the policy's name as users give it (moe_policy="lfu-decay"), NULL past the last policy
EMPANEL_API const char * empanel_policy_name(int32_t policy);

// counters of one layer; times in nanoseconds
struct empanel_layer_stats {
    uint64_t n_remaps;     // remap calls (one per micro-batch)
    uint64_t n_ids;        // (token, expert) pairs routed
    uint64_t hits;         // distinct experts of a micro-batch already resident
    uint64_t misses;       // distinct experts of a micro-batch read from the file
    uint64_t bytes_read;   // bytes of experts read from the file
    uint64_t io_bytes;     // bytes asked of the drive (bytes_read plus O_DIRECT alignment)
    uint64_t n_reads;      // read requests
    uint64_t read_ns;      // wall time of the read phases (all reader threads at work), including
                           // the conversion of experts into CPU_REPACK slots, done as they arrive
    uint64_t write_ns;     // wall time copying experts into device slots after the reads
    uint64_t copy_bytes;   // bytes copied host -> device into slots
    uint64_t remap_ns;     // time the graph waited in remap (lookups + reads + writes)
    uint64_t wait_ns;      // time the graph waited for reads (read_ns minus wait_ns: reads hidden
                           // behind compute, read while the previous wave computed)
    uint64_t n_waves;      // waves over all micro-batches (n_waves / n_remaps: waves per micro-batch)
    uint64_t preloaded;    // experts read by empanel_pool_preload (in bytes_read, not in misses)
    uint64_t guessed;      // distinct experts the gate-ahead guesses named for micro-batches of this layer
    uint64_t guess_routed; // distinct experts routed in the micro-batches that had a guess
    uint64_t guess_hits;   // of those, the ones the guess named (recall: guess_hits / guess_routed)
    uint64_t prefetched;   // experts read ahead from a guess (in bytes_read, not in misses)
    uint64_t prefetch_used;   // of those, the ones their micro-batch routed to
    uint64_t prefetch_wasted; // bytes read ahead for experts their micro-batch did not route to
    uint64_t substituted;  // (token, expert) pairs whose expert was not resident and got a stand-in
    uint64_t verified;     // expert tensors read whose bytes were checked against a digest
    uint64_t verify_ns;    // time the reader threads spent hashing them (summed over threads)
    uint64_t remote_by_hash; // expert tensors an RPC host wrote into its pool from its cache,
                             // asked by hash: nothing read here, a request of about 330 bytes
                             // sent instead of the expert (copy_bytes counts the experts sent)
    int32_t  n_slots;
    int32_t  n_resident;   // slots holding an expert
};

struct empanel_pool;

// the pools of one model: n_layer entries of n_slots (0 = layer not paged, < 0 = not paged but
// observed: remap returns the expert ids and the trace records them), n_expert experts per
// layer, the expert tensors of all paged layers. Opens the files and starts the reader threads;
// NULL on failure, with the reason in err.
EMPANEL_API struct empanel_pool * empanel_pool_init(
        const struct empanel_pool_params * params,
        const char * const * paths,
        int32_t              n_paths,
        int32_t              n_layer,
        const int32_t      * n_slots,
        int32_t              n_expert,
        const struct empanel_tensor_desc * tensors,
        int32_t              n_tensors,
        char               * err,
        size_t               err_size);

EMPANEL_API void empanel_pool_free(struct empanel_pool * pool);

// after the model is loaded: the pool tensor (a ggml_tensor * of libllama) for each expert
// tensor, by the GGUF name given in its desc. Returns 0, or -1 (reason in empanel_pool_error).
EMPANEL_API int32_t empanel_pool_bind(struct empanel_pool * pool, const char * name, void * pool_tensor);

// the remap hook (llama_empanel_remap_fn): expert ids of one micro-batch -> slot ids, reading the
// missing experts first. pool_tensor NULL: for all the layer's pools at once (the micro-batch fits
// them); else wave `wave` of `n_waves` of that pool tensor: the micro-batch's distinct experts are
// split into waves that fit half the pool each (planned at the layer's first call for the
// micro-batch), pairs of other waves get -1, and the next wave's experts are read while this one
// computes. Each expert is read at most once per micro-batch. Returns 0, or -1 after recording
// the failure (see empanel_pool_failed).
EMPANEL_API int32_t empanel_remap(
        void          * pool,
        int32_t         il,
        const void    * pool_tensor,
        int32_t         wave,
        int32_t         n_waves,
        const int32_t * expert_ids,
        int64_t         ids_row_stride,
        int32_t       * slot_ids,
        int32_t         n_used,
        int32_t         n_tokens);

// the gate-ahead guess hook (llama_empanel_guess_fn): expert ids [n_tokens][n_used] that layer il's
// router picks for the FFN input of the paged layer `distance` layers before it, handed over while
// that layer computes. The guessed experts are evicted last by il's next remap; with
// params.prefetch >= distance the ones not resident are read into il's pool now (one batch in
// flight at a time: a guess finding the reader busy reads nothing). Always returns 0.
EMPANEL_API int32_t empanel_guess(
        void          * pool,
        int32_t         il,
        int32_t         distance,
        const int32_t * expert_ids,
        int64_t         ids_row_stride,
        int32_t         n_used,
        int32_t         n_tokens);

// the routing substitution hook (llama_empanel_subst_fn): for each token, a routed expert that is
// not resident is replaced in expert_ids by the first resident expert among candidates (the
// router's next choices, best first) not already routed for the token whose score is at least
// params.subst_ratio x the missing one's. Outputs change: opt-in only. Always returns 0.
EMPANEL_API int32_t empanel_subst(
        void          * pool,
        int32_t         il,
        int32_t       * expert_ids,
        int64_t         ids_row_stride,
        int32_t         n_used,
        const int32_t * candidates,
        int64_t         cand_row_stride,
        int32_t         n_cand,
        const float   * scores,
        int64_t         scores_row_stride,
        int32_t         n_tokens);

// what the pool decided that a user should know (e.g. "O_DIRECT refused, buffered reads"), or ""
EMPANEL_API const char * empanel_pool_notice(struct empanel_pool * pool);

// abort callback for llama_set_abort_callback: true once a remap failed
EMPANEL_API _Bool empanel_pool_failed(void * pool);

// the first failure's message ("" if none), and forgetting it (the failed slots stay empty)
EMPANEL_API const char * empanel_pool_error(struct empanel_pool * pool);
EMPANEL_API void         empanel_pool_clear_error(struct empanel_pool * pool);

// routing trace: while on, every remap call (paged or observed layer) appends
// [layer, n_tokens, n_used, expert ids (n_tokens x n_used)] to the trace, as int32, and every
// gate-ahead guess the same with -(layer + 1) in place of the layer
EMPANEL_API void     empanel_trace_enable(struct empanel_pool * pool, int32_t on);
// copy up to max int32 of the trace into out and drop them from it; returns how many
EMPANEL_API uint64_t empanel_trace_take(struct empanel_pool * pool, int32_t * out, uint64_t max);
EMPANEL_API uint64_t empanel_trace_size(struct empanel_pool * pool);

// bytes of experts resident in all pools
EMPANEL_API uint64_t empanel_pool_resident_bytes(struct empanel_pool * pool);

// the expert each slot of layer il holds (-1: empty) into expert_in [max]; returns the layer's
// slots (0 for a layer that is not paged)
EMPANEL_API int32_t empanel_pool_slots(struct empanel_pool * pool, int32_t il, int32_t * expert_in, int32_t max);

// read experts into the empty slots of every paged layer, in expert id order, as far as the
// slots (and the g-lru budget) go: pools that hold every expert end up holding the whole layer,
// as a model loaded in full would. Call after every tensor is bound; returns the experts read,
// -1 on failure (the reason in empanel_pool_error; slots not yet read stay empty).
EMPANEL_API int64_t empanel_pool_preload(struct empanel_pool * pool);

// the order in which empanel_pool_preload fills layer il's empty slots: experts[0, n) first (e.g.
// the layer's most used experts from a calibration profile), then the others by id. The experts
// chosen are read in file order. uses [n] (or NULL): the LFU count each starts with (lfu-decay;
// a count halves every n_slots micro-batches like the others). n = 0 forgets the order. Returns
// 0, or -1 for a bad layer or id.
EMPANEL_API int32_t empanel_pool_preload_order(struct empanel_pool * pool, int32_t il, const int32_t * experts,
                                               const uint32_t * uses, int32_t n);

// counters of layer il (zeros for a layer that is not paged); reset all counters
EMPANEL_API void empanel_stats_get(struct empanel_pool * pool, int32_t il, struct empanel_layer_stats * out);
EMPANEL_API void empanel_stats_reset(struct empanel_pool * pool);

EMPANEL_API int32_t empanel_sidecar_version(void);

// devices llama.cpp can offload layers to (GPUs, and the devices of registered RPC servers)
EMPANEL_API int32_t empanel_offload_devices(void);

// ggml's RPC backend (csrc/rpc.c): 1 if this build has it
EMPANEL_API int32_t empanel_rpc_supported(void);
// register the devices of RPC servers "HOST:PORT,HOST:PORT,..." (ggml-rpc-server) before a model
// load, as llama.cpp's --rpc does; llama.cpp then places offloaded layers on them (and their
// pools). Each server is tried first, so an unreachable one is an error, not an abort. Returns
// the number of devices newly registered (an endpoint registered before counts 0), or -1 with
// the reason in err.
EMPANEL_API int32_t empanel_rpc_add_servers(const char * servers, char * err, size_t err_size);
// bytes this process sent to and received from RPC servers so far, and the commands it waited
// for an answer to (round trips: each costs the network's latency); 0 without RPC
EMPANEL_API void    empanel_rpc_wire_bytes(uint64_t * sent, uint64_t * received, uint64_t * round_trips);

// XXH3-64 of n bytes (the digest of verified reads), 1 where XXH3 gives 0: a digest is never 0
EMPANEL_API uint64_t empanel_hash64(const void * data, uint64_t n);

// the digests of every expert of expert tensor `name` (its GGUF name): digests [n_expert], XXH3-64
// of each expert's bytes in the file (0: not known, taken at its first read). Needs a pool made
// with verify = 1. Returns 0, or -1 (unknown tensor, or not verifying).
EMPANEL_API int32_t empanel_pool_set_digests(struct empanel_pool * pool, const char * name,
                                             const uint64_t * digests, int32_t n_expert);

// 1: the pool's files are watched for writes (inotify); 0: each check compares their size, mtime
// and ctime instead. Either way a file changed while loaded fails every later remap.
EMPANEL_API int32_t empanel_pool_watching(struct empanel_pool * pool);

// llama.cpp's programs (llama-server, llama-cli, llama-bench, llama-perplexity): `empanel-gguf
// llama-server ...` writes the plan to a file (empanel_gguf/program_plan.py; its records are
// described in csrc/plan.c) and runs the program with EMPANEL_PLAN=<that file>; libllama's
// program hook loads this library (the one next to it, or EMPANEL_SIDECAR) and calls these
// around each model load.
struct empanel_program;
struct llama_model;

// before a load of model_path: if the plan at plan_path is for this model (the same real path),
// make its pools and set the plan for the load on this thread (llama_empanel_set_plan and kin).
// NULL with err "": the plan is for another model (e.g. a draft model), which loads as usual;
// NULL with err set: the plan cannot be used (changed file, bad plan, pool init failure).
EMPANEL_API struct empanel_program * empanel_program_open(const char * plan_path, const char * model_path,
                                                          char * err, size_t err_size);

// after the load: bind the pools to the model's pool tensors, hand over the profile's preload
// order, preload if the plan says so. Returns 0, or -1 with the reason in err.
EMPANEL_API int32_t empanel_program_loaded(struct empanel_program * prog, const struct llama_model * model,
                                           char * err, size_t err_size);

// the program's pools (empanel_pool_failed, empanel_pool_error, empanel_pool_clear_error)
EMPANEL_API struct empanel_pool * empanel_program_pool(struct empanel_program * prog);

// the model is freed: append its counters to the plan's stats file (one JSON object per load),
// free the pools
EMPANEL_API void empanel_program_close(struct empanel_program * prog);

// Prometheus text (format 0.0.4) of every open program's pools into buf [size] (NUL-terminated,
// truncated if it does not fit); returns the length of the whole text
EMPANEL_API size_t empanel_program_metrics(char * buf, size_t size);

// sizeof() of a public struct of llama.h that the llama-cpp-python ctypes bindings mirror, by name
// ("llama_model_params", "llama_context_params", "llama_batch", ...), as this build compiled it;
// 0 if unknown. empanel-gguf compares these with ctypes.sizeof() at import.
EMPANEL_API size_t empanel_struct_size(const char * name);

// where slot `slot` of a pool tensor (a ggml_tensor *) can be written directly (plain host
// memory), else NULL
EMPANEL_API void * empanel_slot_data(void * pool_tensor, int32_t slot);

// the policy lab: a pool without files, tensors or reader threads, whose remap runs the very
// policy code of the engine's pools but reads nothing. expert_bytes [n_layer]: bytes of one
// expert of each layer (what g-lru's budget counts). Free it with empanel_pool_free.
EMPANEL_API struct empanel_pool * empanel_lab_init(
        int32_t          policy,
        int32_t          n_layer,
        const int32_t  * n_slots,
        int32_t          n_expert,
        const uint64_t * expert_bytes,
        uint64_t         budget_bytes,
        char           * err,
        size_t           err_size);

// one remap call of layer il over n_experts expert ids (one micro-batch's, any order and
// repeats): slot_ids [n_experts] gets each one's slot. Returns the distinct experts that missed
// (and were "loaded"), or -1 (the reason in empanel_pool_error; empanel_pool_clear_error goes on).
EMPANEL_API int32_t empanel_lab_access(
        struct empanel_pool * pool,
        int32_t               il,
        const int32_t       * experts,
        int32_t               n_experts,
        int32_t             * slot_ids);

#ifdef __cplusplus
}
#endif
