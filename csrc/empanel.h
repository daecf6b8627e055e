#pragma once

// empanel sidecar: the C side of empanel-gguf. For every paged MoE layer it keeps which expert
// sits in which slot of the layer's pools, picks victims on a miss, and reads the missing experts'
// bytes from the GGUF file on its own file descriptors: with io_uring where the build and the
// kernel have it (the default, EMPANEL_READ_IO_DEFAULT), else with pread on reader threads.
//
// Python (empanel_gguf/engine/native.py, cffi in ABI mode) reads this header with preprocessor lines
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

#define EMPANEL_SIDECAR_VERSION 17

// the pool's read settings (struct empanel_pool_params): defaults and bounds, declared once here;
// Python (empanel_gguf's option table) reads them from this header
#define EMPANEL_DEFAULT_READ_THREADS 8          // params.n_threads: reader threads besides the caller
#define EMPANEL_MAX_READ_THREADS     256        // params.n_threads at most
#define EMPANEL_DEFAULT_CHUNK_KB     256        // params.chunk_bytes / 1024: KiB per read request
#define EMPANEL_MAX_CHUNK_KB         1048576    // params.chunk_bytes / 1024 at most (1 GiB)
#define EMPANEL_DEFAULT_QUEUE_DEPTH  32         // params.queue_depth: io_uring reads in flight
#define EMPANEL_MAX_QUEUE_DEPTH      256        // params.queue_depth at most

// the version of the plan file (empanel_gguf/planning/plan_file.py writes it, plan_file.c reads it)
#define EMPANEL_PLAN_VERSION 2

// one routed-expert tensor of one layer, as it lies in the GGUF file
struct empanel_tensor_desc {
    int32_t      layer;        // MoE layer index (blk.N)
    int32_t      file;         // index into the paths given to empanel_pool_init
    uint64_t     offset;       // bytes: where expert 0's slice starts in that file
    uint64_t     expert_size;  // bytes of one expert's slice (nb2)
    const char * name;         // GGUF tensor name, e.g. "blk.3.ffn_down_exps.weight"
};

// how the pool reads; zeros pick the defaults (but n_threads: 0 is no reader thread)
struct empanel_pool_params {
    int32_t  n_threads;    // reader threads besides the caller (0: the caller reads alone)
    uint32_t chunk_bytes;  // bytes per read request (default EMPANEL_DEFAULT_CHUNK_KB KiB; rounded to 4 KiB)
    int32_t  direct_io;    // 1: O_DIRECT (default), -1: buffered reads through the page cache
    int32_t  policy;       // enum empanel_policy
    uint64_t budget_bytes; // bytes of resident experts over all layers (g-lru's shared budget; the live
                           // budget's start, empanel_pool_set_budget); 0: every slot (capacity)
    int32_t  prefetch;     // paged layers ahead whose guessed misses are read (empanel_guess); 0: guesses
                           // only order eviction
    float    subst_ratio;  // routing substitution (empanel_subst): a resident stand-in needs at least this
                           // share of the missing expert's score; 0: off
    int32_t  verify;       // 1: hash every expert read (XXH3-64) and check it against its digest
                           // (empanel_pool_set_digests, else the digest of its first read)
    int32_t  read_io;      // enum empanel_read_io: how reads are issued (EMPANEL_READ_IO in the
                           // environment overrides it: "threads" or "uring")
    int32_t  queue_depth;  // io_uring: read requests in flight at most (default EMPANEL_DEFAULT_QUEUE_DEPTH)
    int32_t  prompt_ahead; // 1: while a prompt's waves compute a layer, the next paged layer's empty slots
                           // are read (remap.c, read_ahead_next_layer); 0: not
};

// how a pool issues its reads (struct empanel_pool_params.read_io)
enum empanel_read_io {
    EMPANEL_READ_IO_AUTO    = 0, // the default of this build and machine (docs/performance.md)
    EMPANEL_READ_IO_THREADS = 1, // n_threads reader threads and the caller, pread each
    EMPANEL_READ_IO_URING   = 2, // one reader thread, io_uring at queue_depth; where the build or the
                                 // kernel has none: the threads, with a notice; n_threads 0: the
                                 // caller alone, pread
};
// what EMPANEL_READ_IO_AUTO takes: io_uring where there is one (docs/performance.md, "Fast drives and reads")
#define EMPANEL_READ_IO_DEFAULT EMPANEL_READ_IO_URING

// The eviction policies (struct empanel_pool_params.policy), declared once: the enum below,
// empanel_policy_name and the names Python accepts (empanel_gguf/abi/header.py) come from this list.
//   X(id, name as users give it)
//   LRU        per layer: evict the least recently used expert
//   LFU_DECAY  per layer: evict the least frequently used, counts halving every n_slots
//              micro-batches of the layer
//   GLRU       one budget for all layers: evict the least recently used expert of any layer; a
//              layer's pool is its most, never-used slots take no memory (host pools)
#define EMPANEL_POLICIES(X) \
    X(LRU,       "lru")       \
    X(LFU_DECAY, "lfu-decay") \
    X(GLRU,      "g-lru")

#define EMPANEL_POLICY_ENUM(id, name) EMPANEL_POLICY_##id,
enum empanel_policy {
    EMPANEL_POLICIES(EMPANEL_POLICY_ENUM)
};

// the policy's name as users give it (moe_policy="lfu-decay"), NULL past the last policy
EMPANEL_API const char * empanel_policy_name(int32_t policy);

// Every counter of a paged layer, declared once: the struct below, the stats JSON of llama.cpp's
// programs and the Prometheus text (metrics.c), and the Python names (empanel_gguf/abi/header.py reads
// this list from this header) are all made from it.
//   X(field, kind, metric, help)
//   field   member of struct empanel_layer_stats, uint64_t; *_ns in nanoseconds (Python and the
//           metrics report *_s, seconds)
//   kind    counter (only grows until a reset) or gauge (a level now)
//   metric  its Prometheus series, empanel_<metric>; "" for none
//   help    one line: what it counts
#define EMPANEL_LAYER_COUNTERS(X) \
    X(n_remaps,        counter, "remaps_total",          "Remap calls (one per micro-batch and layer).") \
    X(n_ids,           counter, "",                      "(token, expert) pairs routed.") \
    X(hits,            counter, "expert_hits_total",     "Distinct experts of a micro-batch found in a slot.") \
    X(misses,          counter, "expert_misses_total",   "Distinct experts of a micro-batch read from the model file.") \
    X(bytes_read,      counter, "read_bytes_total",      "Bytes of experts read from the model file.") \
    X(io_bytes,        counter, "",                      "Bytes asked of the drive (bytes_read plus O_DIRECT alignment).") \
    X(n_reads,         counter, "",                      "Read requests.") \
    X(read_ns,         counter, "read_seconds_total",    "Time spent reading experts.") \
    X(write_ns,        counter, "",                      "Time copying experts into device slots after the reads.") \
    X(copy_bytes,      counter, "",                      "Bytes copied host to device into slots.") \
    X(read_cpu_ns,     counter, "read_cpu_seconds_total", "CPU time of the reads: the reader threads' and the caller's while it reads with them (copies, repacks, hashes included).") \
    X(bounce_bytes,    counter, "",                      "Bytes the readers copied out of their O_DIRECT buffers (the rest landed in place).") \
    X(remap_ns,        counter, "remap_seconds_total",   "Time spent in the remap step.") \
    X(wait_ns,         counter, "",                      "Time the graph waited for reads (the rest of read time was hidden).") \
    X(overlapped,      counter, "",                      "Remaps whose misses were read while the layer computed (each pool waited for its own).") \
    X(ready_ns,        counter, "",                      "Time the pools' MUL_MAT_IDs waited for those reads (in wait_ns; not in remap_ns).") \
    X(n_waves,         counter, "",                      "Waves over all micro-batches (per micro-batch: n_waves / n_remaps).") \
    X(preloaded,       counter, "",                      "Experts read into empty slots at load (in bytes_read, not in misses).") \
    X(guessed,         counter, "",                      "Distinct experts the gate-ahead guesses named for this layer.") \
    X(guess_routed,    counter, "",                      "Distinct experts routed in micro-batches that had a guess.") \
    X(guess_hits,      counter, "",                      "Of those, the ones the guess named.") \
    X(prefetched,      counter, "",                      "Experts read ahead from a guess (in bytes_read, not in misses).") \
    X(prefetch_used,   counter, "",                      "Of those, the ones their micro-batch routed to.") \
    X(prefetch_wasted, counter, "",                      "Bytes read ahead for experts their micro-batch did not route to.") \
    X(prefetch_dropped, counter, "",                     "Read-ahead experts not routed whose reads were dropped before they landed.") \
    X(prefetch_beside, counter, "",                      "Read-ahead batches posted while another layer's reads were in flight (read after them).") \
    X(substituted,     counter, "",                      "(token, expert) pairs whose missing expert got a resident stand-in.") \
    X(verified,        counter, "",                      "Expert tensors read whose bytes were checked against a digest.") \
    X(verify_ns,       counter, "",                      "Time the reader threads spent hashing (summed over threads).") \
    X(repack_bytes,    counter, "",                      "Bytes of experts the reader threads repacked into CPU_REPACK slots (repacked pools).") \
    X(repack_ns,       counter, "",                      "Time the reader threads spent repacking them (summed over threads).") \
    X(repack_own_bytes, counter, "",                     "Of those, bytes the sidecar's own repack wrote (checked equal to ggml's on each tensor's first expert).") \
    X(remote_by_hash,  counter, "",                      "Expert tensors an RPC host wrote from its cache, asked by hash.") \
    X(host_hits,       counter, "host_hits_total",       "Expert tensors written into device slots from the host-RAM tier, not read from the drive.") \
    X(host_bytes,      counter, "",                      "Bytes of those.") \
    X(device_syncs,    counter, "device_syncs_total",    "Graph calls (remaps, guesses) that wait for a device or RPC host holding the pools.") \
    X(n_slots,         gauge,   "slots",                 "Expert slots of the layer's pool.") \
    X(n_resident,      gauge,   "slots_resident",        "Slots holding an expert.")

#define EMPANEL_COUNTER_FIELD(field, kind, metric, help) uint64_t field;

// the counters of one layer (EMPANEL_LAYER_COUNTERS)
struct empanel_layer_stats {
    EMPANEL_LAYER_COUNTERS(EMPANEL_COUNTER_FIELD)
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
// params.prefetch >= distance the ones not resident are read into il's pool now, behind the reads
// of the layer computing now where both lanes may be in flight at once (plain host pools, not
// g-lru), else once those are done; one read-ahead in flight at a time (a guess finding one
// reads nothing). Always returns 0.
EMPANEL_API int32_t empanel_guess(
        void          * pool,
        int32_t         il,
        int32_t         distance,
        const int32_t * expert_ids,
        int64_t         ids_row_stride,
        int32_t         n_used,
        int32_t         n_tokens);

// the ready hook (llama_empanel_ready_fn): before pool tensor `pool_tensor` of layer il computes
// the layer's micro-batch, waits until the experts its remap placed in that pool's slots have
// landed. A remap whose layer's MUL_MAT_IDs all called it last time posts its misses and returns
// without waiting (host pools only), so one tensor's reads go on while another's experts compute;
// the tensors are read in the order of these calls. Returns 0, or -1 after recording the failure.
// EMPANEL_READ_SYNC=1 at load time registers none (every remap waits for its reads).
EMPANEL_API int32_t empanel_ready(
        void       * pool,
        int32_t      il,
        const void * pool_tensor);

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

// the read path the pool takes now (EMPANEL_READ_IO_THREADS or _URING; the threads once a
// ring the kernel broke fell back to them)
EMPANEL_API int32_t empanel_pool_read_io(struct empanel_pool * pool);
// 1 if this build and kernel read with io_uring; 0 with the reason in why
EMPANEL_API int32_t empanel_uring_available(char * why, size_t why_size);

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

// the live budget of resident expert bytes over all layers (budget.c), and the controller that
// moves it with the memory the machine has (pressure.c), as they moved
struct empanel_budget_stats {
    uint64_t budget_bytes;     // now
    uint64_t capacity_bytes;   // every slot full: the highest budget that means anything
    uint64_t floor_bytes;      // the lowest budget taken: the top-k experts of every paged layer
    uint64_t resident_bytes;   // experts' bytes in the slots now (above the budget only while the
                               // layer computing now, waves or reads in flight hold them)
    uint64_t lowest_bytes;     // the lowest budget since the pool was made
    uint64_t n_changes;        // budget changes (by the app or the controller)
    uint64_t given_back_bytes; // bytes of experts emptied while over the budget, pages returned
    int32_t  elastic;          // 1: the controller moves the budget (empanel_pool_watch_memory)
    int32_t  fixed;            // 1: this pool's budget cannot move (empanel_pool_set_budget says why)
    uint64_t n_shrinks;        // the controller's moves down (the memory left fell below the reserve)
    uint64_t n_grows;          // and up (memory free again)
    uint64_t available_bytes;  // memory left as the controller last read it (UINT64_MAX: unknown)
    uint64_t reserve_bytes;    // the memory it keeps free
    double   last_shrink_ms;   // from reading low memory to the pages given back, last time
    double   max_shrink_ms;    // and at most
    uint64_t ceiling_bytes;    // the most the controller grows to: the budget the app set, else the capacity
    uint64_t n_events;         // polls that heard the kernel reclaim in vain in a watched cgroup
    uint64_t n_unread;         // readings of a memory source that failed (said once on stderr)
    int32_t  hears_kernel;     // 1: the kernel's reclaim events are heard (cgroup v1 memory.pressure_level)
    double   max_lock_wait_ms; // of max_shrink_ms: the longest wait for the pool's lock (remaps, reads, preload)
    uint64_t max_over_bytes;   // the most resident_bytes exceeded the budget: at most the pools of the
                               // layer computing now and of the layers with reads in flight
};
// move the budget while the pools run (bytes, clamped to [floor, capacity]): a lower one empties
// the least recently used slots of any layer at once, their pages back to the kernel, but those
// the graph may read now, which the next remaps empty before any read lands; a higher one admits
// experts again as they are read. Outputs do not change. 0, or -1 with why in err (below the
// floor; pools that cannot give memory back: pinned, or in device memory)
EMPANEL_API int32_t empanel_pool_set_budget(struct empanel_pool * pool, uint64_t budget_bytes, char * err,
                                            size_t err_size);
// the budget's figures into out; 0
EMPANEL_API int32_t empanel_pool_budget(struct empanel_pool * pool, struct empanel_budget_stats * out);

// the controller (pressure.c): a thread that reads the memory the binding limits leave every
// interval_ms and moves the budget: down at once when less than reserve_bytes is left (by what is
// missing and half the reserve again) or when the kernel reclaims in vain in a watched cgroup (by
// the reserve, then 1.5 times the last step at each further event within 1 s); up slowly when
// more than 1.75 reserves would stay free (2 s after the last move down, then at most every
// 0.5 s, to leave 1.5 reserves free; never above a budget empanel_pool_set_budget set). Sources,
// each a file read whole at every poll (up to EMPANEL_MAX_MEMORY_SOURCES):
//   limit_path, high_path, usage_path, stat_path + stat_key: a memory cgroup: left = the lower
//     limit - usage + the stat's key (page cache the kernel reclaims first); a limit of "max" or
//     of EMPANEL_MEMORY_NO_LIMIT and above: none (a limit set later is read at the next poll);
//     events_path: its memory.pressure_level (v1), where critical reclaim is heard
//   available_path + available_key: a "Key: value [kB]" file (/proc/meminfo, MemAvailable)
// Unused paths are NULL or "". The least any source leaves counts; a source that cannot be opened
// or read is left out (said on stderr, counted in n_unread). 0, or -1 with why in err (none could
// be opened; a reserve of 0 or above EMPANEL_MAX_RESERVE_BYTES).
#define EMPANEL_MAX_MEMORY_SOURCES 8
#define EMPANEL_MEMORY_NO_LIMIT 1152921504606846976 // 2^60 bytes or more: no limit (v1 writes 2^63 - 4096)
#define EMPANEL_MAX_RESERVE_BYTES 1125899906842624  // 2^50: the most a controller keeps free
struct empanel_memory_source {
    const char * limit_path;
    const char * high_path;       // cgroup v2 memory.high: a second limit, the lower binds (or NULL)
    const char * usage_path;
    const char * stat_path;
    const char * stat_key;
    const char * events_path;     // cgroup v1 memory.pressure_level: the kernel's reclaim heard (or NULL)
    const char * available_path;
    const char * available_key;
};
EMPANEL_API int32_t empanel_pool_watch_memory(struct empanel_pool * pool, const struct empanel_memory_source * sources,
                                              int32_t n_sources, uint64_t reserve_bytes, int32_t interval_ms,
                                              char * err, size_t err_size);
// the memory the sources leave now (bytes; UINT64_MAX: none could be read): what the controller
// reads, for tests and the planner
EMPANEL_API uint64_t empanel_memory_available(const struct empanel_memory_source * sources, int32_t n_sources);

// the expert each slot of layer il holds (-1: empty) into expert_in [max]; returns the layer's
// slots (0 for a layer that is not paged)
EMPANEL_API int32_t empanel_pool_slots(struct empanel_pool * pool, int32_t il, int32_t * expert_in, int32_t max);

// read experts into the empty slots of every paged layer, in expert id order, as far as the
// slots (and the g-lru budget) go: pools that hold every expert end up holding the whole layer,
// as a model loaded in full would. Call after every tensor is bound; returns the experts read,
// -1 on failure (the reason in empanel_pool_error; slots not yet read stay empty).
EMPANEL_API int64_t empanel_preload(struct empanel_pool * pool);

// the order in which empanel_preload fills layer il's empty slots: experts[0, n) first (e.g.
// the layer's most used experts from a calibration profile), then the others by id. The experts
// chosen are read in file order. uses [n] (or NULL): the LFU count each starts with (lfu-decay;
// a count halves every n_slots micro-batches like the others). n = 0 forgets the order. Returns
// 0, or -1 for a bad layer or id.
EMPANEL_API int32_t empanel_preload_order(struct empanel_pool * pool, int32_t il, const int32_t * experts,
                                          const uint32_t * uses, int32_t n);

// counters of layer il (zeros for a layer that is not paged); reset all counters
EMPANEL_API void empanel_stats_get(struct empanel_pool * pool, int32_t il, struct empanel_layer_stats * out);
EMPANEL_API void empanel_stats_reset(struct empanel_pool * pool);

EMPANEL_API int32_t empanel_sidecar_version(void);

// devices llama.cpp can offload layers to: GPUs (llama_empanel_device_is_gpu) and the devices of
// registered RPC servers
EMPANEL_API int32_t empanel_offload_devices(void);
// of those, the ones that share host memory (integrated GPUs, Apple's Metal): moe_host_cache's rule
EMPANEL_API int32_t empanel_unified_devices(void);
// of those, the devices of registered RPC servers: moe_guess's rule
EMPANEL_API int32_t empanel_rpc_devices(void);

// ggml's RPC backend (csrc/rpc.c): 1 if this build has it
EMPANEL_API int32_t empanel_rpc_supported(void);
// register the devices of RPC servers "HOST:PORT,HOST:PORT,..." (ggml-rpc-server) before a model
// load, as llama.cpp's --rpc does; llama.cpp then places offloaded layers on them (and their
// pools). Each server is tried first, so an unreachable one is an error, not an abort. Returns
// the number of devices newly registered (an endpoint registered before counts 0), or -1 with
// the reason in err.
EMPANEL_API int32_t empanel_rpc_add_servers(const char * servers, char * err, size_t err_size);
// every RPC server registered in this process is usable (llama.cpp offers each one's devices to
// every load): its connection open and sound, or none open and the server answering. 0, or -1
// with the reason in err. empanel_rpc_add_servers checks this too.
EMPANEL_API int32_t empanel_rpc_check_servers(char * err, size_t err_size);
// the registered RPC servers whose connection failed (lost, or a wait timed out:
// EMPANEL_RPC_WAIT_TIMEOUT), comma-separated into endpoints [size]; their number
EMPANEL_API int32_t empanel_rpc_lost(char * endpoints, size_t size);
// 1 when every endpoint of "HOST:PORT,..." (hosts whose connection was lost) answers a handshake
// again: the caller then loads the model anew, since a restarted server holds nothing of the old
// connection. Probes each endpoint once a second at most (within that second its last answer
// stands, for every caller), each probe waiting 1 s at most.
EMPANEL_API int32_t  empanel_rpc_hosts_back(const char * endpoints);
// how many times empanel_rpc_hosts_back said 1 in this process (a reload each)
EMPANEL_API uint64_t empanel_rpc_hosts_back_count(void);
// bytes this process sent to and received from RPC servers so far, and the commands it waited
// for an answer to (round trips: each costs the network's latency); 0 without RPC
EMPANEL_API void    empanel_rpc_wire_bytes(uint64_t * sent, uint64_t * received, uint64_t * round_trips);
// those round trips by ggml-rpc's command (enum rpc_cmd of the pinned llama.cpp) into out[n];
// returns the number of commands (RPC_CMD_COUNT), 0 without RPC
EMPANEL_API int32_t empanel_rpc_round_trips_by_command(uint64_t * out, int32_t n);

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

// A load on slot pools from its plan (load.c): the same steps for a load in the Python process
// (empanel_gguf/engine/pools.py) and for llama.cpp's own programs. The plan is what empanel-gguf decided
// before the load, written down (empanel_gguf/planning/plan_file.py; the records are described in
// csrc/plan_file.c).
struct empanel_load;
struct llama_model;

// read the plan (plan_text, a NUL-terminated string; else the file at plan_path) for a load of
// model_path, make its pools and hand over its digests. NULL with err "": the plan is for another
// model (e.g. a draft model), which loads as usual; NULL with err set: the plan cannot be used
// (changed file, bad plan, pool init failure).
EMPANEL_API struct empanel_load * empanel_load_open(const char * plan_text, const char * plan_path,
                                                    const char * model_path, char * err, size_t err_size);
// set the plan for the model load that follows on this thread (llama_empanel_set_plan and kin;
// libllama clears it after that load, llama_empanel_clear_plan if it never starts)
EMPANEL_API void    empanel_load_begin(struct empanel_load * load);
// after the load: bind the pools to the model's pool tensors and hand over the warm start's
// preload order. Returns 0, or -1 with the reason in err.
EMPANEL_API int32_t empanel_load_bind(struct empanel_load * load, const struct llama_model * model, char * err,
                                      size_t err_size);
// fill the empty slots if the plan says so: the experts read (0 if it does not), or -1 with the
// reason in err (the pool's error is cleared; slots not read stay empty)
EMPANEL_API int64_t empanel_load_preload(struct empanel_load * load, char * err, size_t err_size);
// the load's pools (stats, errors, trace) and how many of them run masked waves
EMPANEL_API struct empanel_pool * empanel_load_pool(struct empanel_load * load);
EMPANEL_API int32_t empanel_load_masked(struct empanel_load * load);
// the model is about to be freed: the reads in flight (read-ahead included) land now, so that none
// lands in a slot after the model's buffers are gone (Llama.close, before llama.cpp's frees)
EMPANEL_API void    empanel_pool_settle(struct empanel_pool * pool);
// the model is freed: append the counters to the plan's stats file (one JSON object per load,
// if the plan names one), free the pools
EMPANEL_API void    empanel_load_close(struct empanel_load * load);

// llama.cpp's programs (llama-server, llama-cli, llama-bench, llama-perplexity): `empanel-gguf
// llama-server ...` writes the plan to a file and runs the program with EMPANEL_PLAN=<that file>;
// libllama's program hook loads this library (the one next to it, or EMPANEL_SIDECAR) and calls
// these around each model load (and empanel_load_pool): the steps above, with the notices on
// stderr.
// open: empanel_load_open of the file, then empanel_load_begin
EMPANEL_API struct empanel_load * empanel_program_open(const char * plan_path, const char * model_path,
                                                       char * err, size_t err_size);
// loaded: empanel_load_bind, then empanel_load_preload (reported on stderr). 0, or -1 (err)
EMPANEL_API int32_t empanel_program_loaded(struct empanel_load * load, const struct llama_model * model,
                                           char * err, size_t err_size);
// close: empanel_load_close, when the model is freed
EMPANEL_API void    empanel_program_close(struct empanel_load * load);

// Prometheus text (format 0.0.4) of every open load's pools into buf [size] (NUL-terminated,
// truncated if it does not fit); returns the length of the whole text
EMPANEL_API size_t empanel_program_metrics(char * buf, size_t size);

// Prometheus text (format 0.0.4), written by the sidecar alone for every face (llama.cpp's
// programs above, `empanel-gguf serve`): empanel_slot_pools of each model (pools[i] NULL: a model
// without pools, 0), the per-layer families of EMPANEL_LAYER_COUNTERS that name a metric (a series
// per paged layer) and the budget's series, empanel_hit_rate, empanel_rpc_reloads_total; labeled
// model=models[i] (escaped as empanel_metrics_label does), into buf [size] as above; returns the
// length of the whole text
EMPANEL_API size_t empanel_metrics_pools(struct empanel_pool * const * pools, const char * const * models,
                                         int32_t n, char * buf, size_t size);
// a label value escaped as the text format wants it (backslash, double quote and newline as
// backslash-backslash, backslash-quote, backslash-n) into buf [size] (NUL-terminated, truncated);
// returns the length of the whole escaped value
EMPANEL_API size_t empanel_metrics_label(const char * value, char * buf, size_t size);

// sizeof() of a public struct of llama.h that the llama-cpp-python ctypes bindings mirror, by name
// ("llama_model_params", "llama_context_params", "llama_batch", ...), as this build compiled it;
// 0 if unknown. empanel-gguf compares these with ctypes.sizeof() at import.
EMPANEL_API size_t empanel_struct_size(const char * name);

// where slot `slot` of a pool tensor (a ggml_tensor *) can be written directly (plain host
// memory), else NULL
EMPANEL_API void * empanel_backend_slot_data(void * pool_tensor, int32_t slot);

// the policy lab: a pool without files, tensors or reader threads, whose remap runs the very
// policy code of the engine's pools but reads nothing. expert_bytes [n_layer]: bytes of one
// expert of each layer (what g-lru's budget counts). Free it with empanel_lab_free.
EMPANEL_API struct empanel_pool * empanel_lab_init(
        int32_t          policy,
        int32_t          n_layer,
        const int32_t  * n_slots,
        int32_t          n_expert,
        const uint64_t * expert_bytes,
        uint64_t         budget_bytes,
        char           * err,
        size_t           err_size);
EMPANEL_API void empanel_lab_free(struct empanel_pool * pool);

// one remap call of layer il over a micro-batch's expert ids, expert_ids [n_tokens, n_used] (any
// order and repeats), as the engine makes it: distinct experts beyond the layer's slots run in
// waves, as a wave graph runs them (remap.c, plan_waves). Returns the distinct experts that
// missed (and were "loaded"), or -1 (the reason in empanel_pool_error; empanel_pool_clear_error
// goes on).
EMPANEL_API int32_t empanel_lab_access(
        struct empanel_pool * pool,
        int32_t               il,
        const int32_t       * expert_ids,
        int32_t               n_used,
        int32_t               n_tokens);

#ifdef __cplusplus
}
#endif
