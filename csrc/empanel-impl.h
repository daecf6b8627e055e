#pragma once

// internal structures of the sidecar, shared by every unit of csrc/ (pool.c: tables, memory; remap.c and ready.c:
// policy, waves, ready ops; guess.c: guesses, read-ahead; batch.c and reader.c: reads; files.c: the model files;
// host_cache.c, preload.c, rpc.c, plan_file.c, load.c, backend.c; util.c: errors, clock, digest)

#include "empanel.h"
#include "llama-empanel-shared.h" // what libllama and the sidecar share; only load.c calls libllama

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#define EMPANEL_MAX_TENSORS 4           // gate, up, down, gate_up
#define EMPANEL_ALIGN       LLAMA_EMPANEL_READ_ALIGN // O_DIRECT offset/length/buffer alignment, bytes
#define EMPANEL_STAGING     (8u << 20)  // bytes of staging for experts on their way to non-plain pools
#define EMPANEL_MAX_READ_THREADS 256      // reader threads of a pool at most (params.n_threads)
#define EMPANEL_MAX_CHUNK_BYTES  (1u << 30) // bytes of one read request at most (params.chunk_bytes)
#define EMPANEL_MAX_QUEUE_DEPTH  256      // io_uring: reads in flight at most (params.queue_depth)
#define EMPANEL_READ_IO_DEFAULT  EMPANEL_READ_IO_URING // read_io auto: io_uring where there is one (docs/performance.md, "Reads at depth")

// one routed-expert tensor of a layer: its experts in the file and its pool in memory
struct empanel_tensor {
    char     name[96];
    int32_t  file;          // index into pool->files
    uint64_t offset;        // bytes: expert 0 in the file
    uint64_t expert_size;   // bytes of one expert, in the file and in a slot
    void   * pool;          // ggml_tensor * [ne0, ne1, n_slots], set by empanel_pool_bind
    int      direct;        // slots are plain host memory: reads land in them directly
    int      masked;        // waves are masked: kernels read every slot while a wave computes
    uint8_t * host;         // the pool's host memory (any layout), or NULL (device memory)
    int32_t * held;         // [n_slots] expert whose bytes this tensor's slot holds, -1 if none
                            // (or being read); equals the layer's expert_in outside of waves
    uint64_t * digest;      // [n_expert] XXH3-64 of each expert's file bytes, 0: not known yet
                            // (taken at its first read); NULL: reads are not verified
    int        remote;      // the pool is on an RPC host (rpc.c): writes go by hash first
    int        remote_cache;   // its host keeps what it is sent (rpc-server -c): 1 yes or not known
                               // yet, 0 no (it refused a hash it was sent)
    uint64_t * remote_hash;    // [n_expert] FNV-1a of each expert's bytes as the host's cache
                               // names them, 0: not known yet; NULL unless remote
    uint8_t  * remote_sent;    // [n_expert] 1: sent to the host with the cache flag by this process
};

// Every field below is guarded by the pool's lock (struct empanel_pool.lock) and written by the
// unit named in its struct's comment; reader threads never read a layer's tables.

// the slot tables (slots.c; remap.c, guess.c, preload.c and batch.c change them only through it,
// or fill its scratch arrays)
struct empanel_tables {
    int32_t  * slot_of;     // [n_expert] slot holding the expert, or -1
    int32_t  * expert_in;   // [n_slots]  expert held by the slot, or -1
    uint64_t * last_use;    // [n_slots]  remap call that last used the slot (LRU)
    uint64_t * call_mark;   // [n_slots]  remap call that uses the slot now (never evicted in it)
    uint64_t * miss_mark;   // [n_expert] remap call that listed the expert as distinct
    uint32_t * uses;        // [n_slots]  LFU counts (halved every n_slots remaps)
    uint64_t   n_batches;   // micro-batches remapped: the LFU decay clock (stats resets leave it)
    uint64_t * slot_mark;   // [n_slots]  stamp that marked the slot: a wave's claim while planning, a
                            //            guess's resident experts, a read-ahead's routed ones
    uint64_t   mark_stamp;  // stamps so far
    // scratch of one call
    int32_t  * misses;      // [n_expert] the current call's misses
    int32_t  * victims;     // [n_expert] the slots they go to
    int32_t  * distinct;    // [n_expert] the micro-batch's distinct experts (or a guess's)
    uint64_t * order_key;   // [n_expert] misses by last use in the micro-batch, then id
};

// the waves of the current micro-batch (remap.c: remap calls with a pool tensor); the tables
// already say where every expert is at the end of it
struct empanel_waves {
    int        open;        // some tensor has waves of this plan still to run
    int32_t    n;           // waves the plan fills (the graph may run more, empty ones)
    int32_t    n_graph;     // waves the graph runs
    int32_t    next[EMPANEL_MAX_TENSORS]; // next wave of each tensor
    int32_t  * wave_of;     // [n_expert] wave of each expert of the micro-batch, else -1
    int32_t  * slot_of;     // [n_expert] the slot it is in during its wave
    int32_t  * order;       // [n_expert] the micro-batch's experts, wave by wave
    int32_t  * begin;       // [n_expert + 2] index in order of each wave's first
    int32_t  * ids;         // [ids_cap] the micro-batch's expert ids (its calls' key)
    int64_t    n_ids;
    int64_t    ids_cap;
};

// the gate-ahead guess for this layer's next micro-batch and its read-ahead (guess.c; slots.c
// accounts for it when the remap spends it)
struct empanel_guess_state {
    uint64_t * mark;          // [n_expert] guess stamp that named the expert
    uint64_t   stamp;         // guesses so far
    int        live;          // a guess waits for the next remap (which evicts its experts last)
    int32_t    n;             // distinct experts the live guess names (in tables.distinct)
    uint64_t * prefetch_mark; // [n_slots] 1: read ahead for the next micro-batch, not yet accounted
    int        prefetch_open; // read-ahead slots whose tables are set before their bytes land
};

// reads that overlap the compute (ready.c, remap.c): the remap posts a micro-batch's misses and
// returns; each pool's MUL_MAT_ID waits for its own tensor's reads first
struct empanel_ready_state {
    uint32_t   seen;        // bit i: tensor i's ready call came since the layer's last remap
    int32_t    next;        // ready calls since then
    int32_t    rank[EMPANEL_MAX_TENSORS]; // order of the tensors' ready calls: the graph's
    int        armed;       // every tensor's MUL_MAT_ID waits for its reads (seen last time)
    int        reads_open;  // misses posted, tables set before their bytes land
};

// what preload takes first (preload.c: empanel_pool_preload_order)
struct empanel_preload {
    int32_t  * order;       // [n_order] experts, the first first
    uint32_t * uses;        // [n_order] their starting LFU counts, or NULL
    int32_t    n_order;
};

struct empanel_layer {
    int32_t  n_slots;       // 0: not paged
    int      observe;       // not paged, but its routing is traced
    int      device;        // a pool is not in this process's host memory (a GPU, an RPC host):
                            // each call from the graph waits for it (stats.device_syncs)
    int32_t  n_tensors;
    uint64_t expert_bytes;  // one expert over all tensors
    int32_t  lru_base;      // g-lru: entry of slot 0 in the pool's LRU list
    struct empanel_tensor tensors[EMPANEL_MAX_TENSORS];

    struct empanel_tables      tables;
    struct empanel_waves       waves;
    struct empanel_guess_state guess;
    struct empanel_ready_state ready;
    struct empanel_preload     preload;

    struct empanel_layer_stats stats;
};

// a plan, a read-ahead or overlapped reads of the layer left tables set before their bytes
// landed: the next remap of the layer (or a recovery) reconciles them with what the slots hold
static inline int empanel_layer_open(const struct empanel_layer * layer) {
    return layer->waves.open || layer->guess.prefetch_open || layer->ready.reads_open;
}

// a file of the model (one per shard), as it was when the pool was made
struct empanel_file {
    char   * path;
    int      fd;            // buffered reads, fstat
    int      fd_direct;     // O_DIRECT reads, or -1
    uint64_t size;          // bytes
    int64_t  mtime_ns;
    int64_t  ctime_ns;      // inode change time: no user can set it
    int      watch;         // inotify watch descriptor, or -1
};

// one expert tensor of one missing expert on its way into its slot
struct empanel_read_job {
    struct empanel_tensor * tensor;
    int32_t    expert;
    int32_t    slot;
    uint8_t  * dst;         // the slot itself (direct) or staging
    int        convert;     // 1: staging -> slot by the reader thread that reads the last chunk
                            //    (host pools: CPU_REPACK); 2: by the caller after the batch (device)
    int        tier;        // host-RAM tier (host_cache.c): 0 none; 1 read into its entry (dst);
                            // 2 its entry holds the bytes already: nothing to read (a host hit)
    atomic_int chunks_left;
    atomic_int dropped;     // a read-ahead its layer's remap did not route: chunks not yet taken are
                            // skipped (empanel_batch_drop)
    int        landed;      // every byte read (and checked, converted): set by the landing thread
    atomic_ullong skipped;  // payload bytes of its chunks skipped (dropped)
    uint64_t   verify_ns;   // time its thread took to hash it (moe_verify)
    uint64_t   remote_hash; // RPC pools: FNV-1a of the bytes read, taken by the thread landing them
};

// one read request: file bytes [offset, offset + length) of which [skip, skip + payload) go to
// job->dst + dst_offset. With O_DIRECT, an in-place chunk lands its whole window at
// job->dst + dst_offset - skip (an aligned address, the bytes around the payload being the job's
// own room); the others land in the thread's bounce buffer and their payload is copied.
struct empanel_chunk {
    int32_t  job;
    int32_t  file;
    uint64_t offset;
    uint64_t length;
    uint64_t skip;
    uint64_t payload;
    uint64_t dst_offset;
    int32_t  in_place;
};

// the host-RAM tier of device pools (host_cache.c): n_entries experts of entry_bytes each
struct empanel_host_cache {
    uint8_t  * raw;          // the allocation (pinned host memory where the device offers it)
    void     * buffer;       // its backend buffer, or NULL (malloc)
    uint8_t  * base;         // raw, aligned to EMPANEL_ALIGN
    uint64_t   entry_bytes;  // one expert: every tiered tensor's O_DIRECT window
    int32_t    n_entries;    // 0: no tier
    int32_t  * layer_of;     // [n_entries] layer of the expert the entry is for, -1: none
    int32_t  * expert_of;    // [n_entries]
    uint8_t  * held;         // [n_entries] bit per tensor of the layer: its bytes are in the entry
    uint64_t * batch;        // [n_entries] the read batch that last used the entry
    int32_t  * prev;         // [n_entries] recency list, least recent first
    int32_t  * next;         // [n_entries]
    int32_t    lru_head;
    int32_t    lru_tail;
    int32_t  * entry_of;     // [n_layer * n_expert] entry of (layer, expert), -1: none
};

// the lanes of reads in flight: a remap's own reads (its misses, a wave's, a preload's) and a
// read-ahead's. Each lane holds one batch at most; the reader takes the demand lane's chunks
// first, so a read-ahead queued behind a layer's reads never delays them (batch.c says when the
// two may be in flight at once)
enum empanel_lane {
    EMPANEL_LANE_DEMAND = 0,
    EMPANEL_LANE_AHEAD  = 1,
    EMPANEL_N_LANES     = 2,
};

// the batch posted to the reader threads in one lane (reader.c: written by empanel_reader_post
// under the reader's mutex while no thread is inside the lane, before the threads wake; by_tensor
// cleared by empanel_reader_finish once no thread is inside it). The threads read it; the atomics
// are what they write
struct empanel_posted {
    int                          by_tensor;    // its tensors are waited for one by one (empanel_ready)
    const struct empanel_tensor * tensors;     // its layer's tensors
    atomic_int                   tensor_left[EMPANEL_MAX_TENSORS];      // jobs of tensor i not landed
    int32_t                      tensor_chunk_end[EMPANEL_MAX_TENSORS]; // chunks up to tensor i's last
    struct empanel_read_job    * jobs;
    const struct empanel_chunk * chunks;
    int32_t                      n_chunks;
    atomic_int                   next;   // next chunk to take
    atomic_int                   done;   // chunks finished
    atomic_int                   busy;   // threads inside the lane (reading its fields)
    atomic_int                   waited; // the caller waits for the whole batch (a read-ahead it
                                         // needs now): the ring takes its chunks at full depth
    atomic_int                   batch_failed; // a chunk of this batch failed or was skipped
    atomic_ullong                cpu_ns; // CPU time the threads spent on this batch
    atomic_ullong                skipped_io;     // file bytes of dropped chunks not read (empanel_batch_drop)
    atomic_ullong                skipped_bounce; // payload of those that would have been copied
    uint64_t                     done_ns;        // when the last chunk of the batch finished (under mutex)
};

// one read in a ring (ring.c: io_uring): bytes [offset, offset + length) of fd into buf
struct empanel_ring_read {
    int       fd;
    uint8_t * buf;
    uint64_t  length;
    uint64_t  offset;
    uint64_t  first;    // bytes the first request asks for, 0: all (the short-read failpoint)
    uint64_t  done;     // bytes read (ring.c)
    int       err;      // errno of the failed read, 0: none (ring.c)
    int       retries;  // completions that asked to be tried again (EAGAIN, EINTR) (ring.c)
    int32_t   chunk;    // the caller's: the chunk it reads
    int32_t   lane;     // the caller's: the lane of that chunk
    uint8_t * bounce;   // the caller's: its bounce buffer (O_DIRECT windows not read in place)
};

struct empanel_ring; // ring.c

// a ring of at most depth reads, or -1 with why (no io_uring in this build or this kernel)
int  empanel_ring_init(struct empanel_ring ** out, int32_t depth, char * why, size_t why_size);
void empanel_ring_free(struct empanel_ring * ring);
int32_t empanel_ring_room(const struct empanel_ring * ring);      // reads that can be queued now
int32_t empanel_ring_in_flight(const struct empanel_ring * ring); // queued or submitted, not reaped
void empanel_ring_queue(struct empanel_ring * ring, struct empanel_ring_read * r); // submitted by reap
// submit what is queued and wait for one read to finish: whole (done == length), ended by the
// end of the file (done < length) or failed (err: also every read of a ring that broke before
// submitting it); NULL: nothing in flight, or the kernel stopped answering with reads in flight
// (they may still land: their buffers must never be reused or freed)
// empanel_ring_broken: the errno that broke the ring, 0 if none; a broken ring takes no more reads
struct empanel_ring_read * empanel_ring_reap(struct empanel_ring * ring);
int  empanel_ring_broken(const struct empanel_ring * ring);

// reader threads: they and the calling thread share out the chunks of the posted batches, the
// demand lane's first (reader.c). With io_uring, one reader thread keeps up to `depth` chunks in
// flight in its ring, of both lanes, and lands them; the calling thread only waits
struct empanel_reader {
    int32_t         depth;        // io_uring: chunks in flight at most
    struct empanel_ring      * ring;     // io_uring: the ring of reader thread 0; NULL: the threads read
    struct empanel_ring_read * ring_ops; // [depth] its reads, each with a bounce buffer
    atomic_int      ring_state;   // written by the ring thread: RING_OK; RING_OFF: it broke with nothing in flight,
                                  // the thread preads; RING_LOST: the kernel kept reads (reader.c)
    pthread_t     * threads;      // [n_threads]
    int32_t         n_threads;
    uint8_t      ** bounce;       // [n_bounce] aligned chunk buffers (O_DIRECT), one per thread; last: caller's;
                                  // io_uring: one per read in the ring, then the caller's
    int32_t         n_bounce;     // n_threads + 1 (of the threads asked for: some may not have started);
                                  // io_uring: depth + 1
    uint64_t        chunk_bytes;
    int             direct;       // reads use O_DIRECT
    int             bounce_all;   // every chunk through the bounce buffer, none in place (EMPANEL_READ_BOUNCE=1:
                                  // the copies zero-copy reads save, measured side by side)
    int             beside;       // the two lanes may be in flight at once (EMPANEL_READ_AHEAD_BESIDE=0: a
                                  // read-ahead waits for the demand lane, as before, measured side by side)
    int             drop_ahead;   // read-ahead not routed is dropped (EMPANEL_READ_AHEAD_KEEP=1: read whole,
                                  // as before, measured side by side)
    struct empanel_pool * pool;

    pthread_mutex_t mutex;
    pthread_cond_t  cond_work;    // a batch is posted (or stop)
    pthread_cond_t  cond_done;    // a lane's last chunk finished, a tensor landed, a thread left a lane
    atomic_ullong   posts[EMPANEL_N_LANES];  // batches posted in each lane so far (under mutex)
    int             stop;
    struct empanel_posted posted[EMPANEL_N_LANES];
};
// g-lru (slots.c): every resident (layer, slot) in one list, least recently used first, and the
// budget of resident bytes over all layers. Guarded by the pool's lock
struct empanel_glru {
    uint64_t  budget_bytes;
    uint64_t  resident_bytes;
    int32_t   n_entries;     // slots of all layers
    int32_t * prev;          // [n_entries]
    int32_t * next;          // [n_entries]
    int32_t * entry_layer;   // [n_entries]
    int32_t   head;          // least recent, -1 if empty
    int32_t   tail;          // most recent
};

// the routing trace (trace.c, empanel_trace_enable): records [il, n_tokens, n_used, ids].
// Guarded by the pool's lock
struct empanel_trace {
    int       on;
    int32_t * records;       // [cap]
    uint64_t  len;
    uint64_t  cap;
};

// failpoints for tests (reader.c): read requests from the after-th on fail with EIO (0: never),
// count of them (0: all); set from EMPANEL_FAULT_READ_AFTER / _COUNT at init
struct empanel_fault {
    int64_t      after;
    int64_t      count;
    int          short_reads; // EMPANEL_FAULT_SHORT_READS=1: every request first asks for half its
                              // bytes (a block multiple), as a short read returns them; the rest follows
    atomic_llong n_requests;
};

// staging for experts on their way to non-direct pools (batch.c): one batch in flight uses it at
// most (a batch beside another one needs none). Guarded by the pool's lock
struct empanel_staging {
    uint8_t                 * data;          // [size] pinned host memory of a device pool's device, if any
    uint64_t                  size;
    void                    * owner;         // the device pool whose device pinned it, or NULL (malloc)
    void                    * buffer;        // the backend buffer of pinned staging
};

// the batch of reads in flight in one lane (batch.c; posted, not finished) and the scratch it is
// planned in. Guarded by the pool's lock; the reader threads read only what the reader's own
// struct holds (empanel_reader_post)
struct empanel_batch {
    struct empanel_read_job * jobs;          // [jobs_cap]
    int32_t                   jobs_cap;
    struct empanel_chunk    * chunks;        // [chunks_cap]
    int32_t                   chunks_cap;

    int                       inflight;      // a batch is posted and not finished
    int                       beside;        // it may be in flight beside the other lane's batch
                                             // (empanel_batch_beside: it stages nothing, and no
                                             // other layer's remap evicts its slots)
    int                       ahead;         // a read-ahead whose unrouted experts may be dropped
    int                       dropped;       // some of its read-ahead was dropped (empanel_batch_drop)
    struct empanel_layer    * layer;
    int32_t                   n_jobs;
    int32_t                   n_chunks;
    uint64_t                  payload;       // bytes of the experts it reads
    uint64_t                  io_bytes;      // bytes of the file it reads (O_DIRECT windows)
    uint64_t                  bounce_bytes;  // payload copied out of bounce buffers
    uint64_t                  t0;            // when it was posted (ns)
};

// one per model (pool.c makes and frees it). `lock` guards every field and every layer, except:
// failed / error_claimed / error (atomics, util.c: any thread, the first failure wins), the
// reader's posted batch (its own mutex, reader.c) and what is fixed after init (n_layer,
// n_expert, policy, verify, lab, prefetch, subst_ratio, the files' descriptors)
struct empanel_pool {
    pthread_mutex_t lock;   // one remap, guess, ready or API call at a time
    int32_t n_layer;
    int32_t n_expert;
    struct empanel_layer * layers; // [n_layer]

    int32_t n_files;               // files.c
    struct empanel_file * files;   // [n_files]
    int     watch_fd;              // inotify instance watching the files for writes, or -1
    int32_t changed_file;          // a file seen changed (for good), or -1
    char    changed_why[128];

    int32_t   policy;       // enum empanel_policy
    int       verify;       // every expert read is hashed and checked against its digest
    int       lab;          // the policy lab (empanel_lab_init): no files, nothing is read
    int32_t   prefetch;     // paged layers ahead whose guessed misses are read
    float     subst_ratio;  // routing substitution: a stand-in's share of the missing expert's score; 0: off
    struct empanel_reader reader;
    struct empanel_host_cache host_cache;

    // a read-ahead that found a layer's overlapped reads in flight and may not go beside them
    // (empanel_batch_beside): posted once they are done (empanel_guess_post_deferred), dropped by
    // the next remap (guess.c)
    struct empanel_layer    * deferred_guess;  // its live guess (tables.distinct, guess.n) is read ahead

    struct empanel_batch      batch[EMPANEL_N_LANES];
    struct empanel_staging    staging;
    uint64_t                  n_batches;   // batches posted so far: the host tier's batch stamp

    char notice[256];

    uint64_t call;          // remap calls so far: the LRU clock

    struct empanel_glru  glru;   // slots.c
    struct empanel_trace trace;  // trace.c

    atomic_int failed;         // 1: error holds the first failure (set once it is written)
    atomic_int error_claimed;  // 1: a thread took the first failure and writes error (util.c)
    char       error[512];

    struct empanel_fault fault;  // reader.c
};

// util.c: errors, clock, digest (empanel_hash64 in empanel.h)
// the pool's first failure (later ones are dropped: the first is the cause); fails every later remap
void     empanel_set_error(struct empanel_pool * pool, const char * fmt, ...);
// the message into err [err_size] (nothing if err is NULL)
void     empanel_format_err(char * err, size_t err_size, const char * fmt, ...);
// CLOCK_MONOTONIC in nanoseconds
uint64_t empanel_now_ns(void);
uint64_t empanel_thread_cpu_ns(void); // CPU time of the calling thread

// pool.c: after the model is loaded, the pool tensor llama.cpp made for the expert tensor of
// GGUF name `name` (info NULL: it made none). 0, or -1 (reason in empanel_pool_error)
int32_t empanel_pool_bind(struct empanel_pool * pool, const char * name, const struct llama_empanel_pool_info * info);

// slots.c: the slot tables (no I/O)
// the slot in [begin, end) to evict, among those whose mark is not `taken` (-1 if none)
int32_t empanel_slots_pick_victim(const struct empanel_layer * layer, int32_t policy, int32_t begin, int32_t end,
                                  const uint64_t * mark, uint64_t taken);
// slot s is used by `call` (LRU clock, LFU count)
void    empanel_slots_note_use(struct empanel_layer * layer, int32_t s, uint64_t call);
// a hit: the expert in slot s stays where it is, and is used by `call`
void    empanel_slots_use_hit(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call);
// claim slot s for an expert that comes: its expert leaves (g-lru: an empty slot takes room in
// the budget from the least recent expert of any layer)
void    empanel_slots_claim(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call);
// expert e takes slot s (claimed for `call`): the tables say it is there from now on, its bytes
// come with the reads that follow
void    empanel_slots_place(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, int32_t e, uint64_t call);
// the tables say that experts tables.misses[0, n) are in slots tables.victims[0, n)
void    empanel_slots_hold_misses(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n);
// misses[0, n) -> victims[0, n) reordered by expert id (reads in file order)
void    empanel_slots_sort_file_order(struct empanel_layer * layer, int32_t n);
// one micro-batch done in n_waves waves: the decay clock ticks (the layer's own, not its statistics)
void    empanel_slots_end_batch(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n_waves);
// slot `slot` of the layer holds nothing: host pools give its pages back
void    empanel_slots_release(struct empanel_layer * layer, int32_t slot);
// slot s stops holding what a read-ahead put there before its micro-batch came: wasted bytes
void    empanel_slots_drop_prefetch(struct empanel_layer * layer, int32_t s);
// the live guess of a layer is spent by the remap of its n distinct experts (in tables.distinct)
// for `call`: recall and read-ahead accounted
void    empanel_slots_close_guess(struct empanel_layer * layer, int32_t n, uint64_t call);
// a plan, read-ahead or overlapped reads that did not run to their end (a failure, an aborted
// graph): slots whose tensors do not all hold the expert the tables say are emptied
void    empanel_slots_reconcile(struct empanel_pool * pool, struct empanel_layer * layer);
// g-lru: take expert entry e out of the recency list / put it at the recent end
void    empanel_lru_unlink(struct empanel_pool * pool, int32_t e);
void    empanel_lru_push_recent(struct empanel_pool * pool, int32_t e);
// g-lru: evict least recent experts of any layer (none that call `call` uses) until `need` more
// bytes fit in the budget
void    empanel_glru_make_room(struct empanel_pool * pool, uint64_t need, uint64_t call);
int     empanel_compare_uint64(const void * a, const void * b);

// trace.c: append a routing record [il, n_tokens, n_used, ids] to the trace; 0 or -1
int     empanel_trace_call(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                           int64_t ids_row_stride, int32_t n_used, int32_t n_tokens);

// backend.c: pool tensors through ggml's public backend API
// the memory of a pool in host memory of any layout (plain or CPU_REPACK), else NULL; slot s takes
// bytes [s*nb[2], (s+1)*nb[2])
void *  empanel_pool_host_data(void * pool_tensor);
// host memory to stage reads bound for a device pool: pinned memory of its device (its host buffer
// type), or plain memory where it has none; *buffer gets the backend buffer to release. NULL if
// out of memory
void *  empanel_host_buffer_alloc(void * pool_tensor, size_t size, void ** buffer);
void    empanel_host_buffer_free(void * buffer);
// give back the pages inside [ptr, ptr + size) (they read as zeros afterwards); with zero_edges
// also zero the bytes of the partial pages at both ends
void    empanel_memory_release(uint8_t * ptr, uint64_t size, int zero_edges);
// one expert's bytes as stored in the GGUF (nb[2] bytes) into slot `slot`: copied, repacked
// (CPU_REPACK) or sent to the device; 0 on success
int32_t empanel_slot_write(void * pool_tensor, int32_t slot, const void * data, size_t size);

// rpc.c: pools on RPC hosts (ggml-rpc with patch 0008)
// 1: the pool tensor lives in an RPC server's buffer
int      empanel_rpc_tensor(void * pool_tensor);
// the hash an rpc-server's cache names the bytes by (never 0)
uint64_t empanel_rpc_hash(const void * data, uint64_t size);
// slot `slot` from the host's cache: 1 it had the bytes of `hash` and wrote them, 0 it did not
int      empanel_rpc_write_by_hash(void * pool_tensor, int32_t slot, uint64_t hash);
// the bytes into slot `slot`, kept in the host's cache if it has one; 0 or -1
int      empanel_rpc_write_cached(void * pool_tensor, int32_t slot, const void * data, uint64_t size);

// preload.c: after the preload of a pinned plan, every pool that holds all the experts holds
// expert e in slot e; 0, or -1 with the reason in err
int empanel_pool_check_pinned(struct empanel_pool * pool, char * err, size_t err_size);

// guess.c: the read-ahead a guess deferred while overlapped reads were in flight, posted now if it
// still can be
void    empanel_guess_post_deferred(struct empanel_pool * pool);

// plan_file.c: a plan written down (empanel_gguf/planning/plan_file.py; records described in plan_file.c)
struct empanel_plan_order {
    int32_t    layer;
    int32_t    n;
    int32_t  * experts;  // [n]
    uint32_t * uses;     // [n] or NULL
};

struct empanel_plan_digests {
    char     * name;
    int32_t    n;
    uint64_t * digests;  // [n]
};

struct empanel_plan {
    char     model[PATH_MAX];       // real path of the first shard
    char     stats_path[PATH_MAX];  // where each load's counters go ("": nowhere)
    int32_t  n_layer;
    int32_t  n_expert;
    int32_t  n_expert_used;
    int32_t  guess_depth;
    int32_t  subst_alt;
    int      preload;
    int      pinned;    // pools that hold every expert run stock's graph (llama_empanel_set_pinned)
    uint64_t host_cache_bytes; // the host-RAM tier of device pools (host_cache.c), 0: none
    int32_t * n_slots;                          // [n_layer]
    char   ** paths;                            // [n_paths] the shards
    uint64_t * file_sizes;                      // [n_paths] their sizes (bytes), as the plan and the files say
    int32_t   n_paths;
    struct empanel_tensor_desc * tensors;       // [n_tensors], names in tensor_names
    char   ** tensor_names;                     // [n_tensors]
    int32_t   n_tensors;
    struct empanel_plan_order   * orders;       // [n_orders]
    int32_t                       n_orders;
    struct empanel_plan_digests * digests;      // [n_digests]
    int32_t                       n_digests;
    struct empanel_pool_params    params;
    int       seen;                             // records read (plan_file.c's enum plan_record)
};

// the plan at plan_path (a file) or in text (a NUL-terminated string) for a load of model_path: 1
// read into plan; 0 it is another model's (plan empty, err ""); -1 it cannot be used (err says
// why). Free a read plan with empanel_plan_free.
int  empanel_plan_read     (const char * plan_path, const char * model_path, struct empanel_plan * plan, char * err,
                            size_t err_size);
int  empanel_plan_read_text(const char * text, const char * model_path, struct empanel_plan * plan, char * err,
                            size_t err_size);
void empanel_plan_free(struct empanel_plan * plan);

// files.c
int      empanel_files_open  (struct empanel_pool * pool, const char * const * paths, int32_t n_paths, int direct_io, char * err, size_t err_size);
void     empanel_files_close (struct empanel_pool * pool);
int      empanel_files_check (struct empanel_pool * pool);
// file i of the pool is the one llama.cpp's loader read (its st_dev and st_ino); 0, or -1 with the
// reason in err (a file replaced at its path between the two opens)
int      empanel_file_is     (struct empanel_pool * pool, int32_t i, uint64_t dev, uint64_t ino, char * err,
                              size_t err_size);
// reader.c
int      empanel_reader_start(struct empanel_pool * pool, int32_t n_threads, uint64_t chunk_bytes, int32_t read_io,
                              int32_t depth, char * err, size_t err_size);
void     empanel_reader_stop (struct empanel_pool * pool);
// io_uring stopped answering with reads in flight: buffers they may land in must never be freed
int      empanel_reader_lost (const struct empanel_pool * pool);
int32_t  empanel_reader_io   (const struct empanel_pool * pool); // EMPANEL_READ_IO_THREADS or _URING, now
// chunk.c: one chunk of a lane's posted batch p
// what became of a chunk taken from the posted batch
enum empanel_chunk_outcome {
    EMPANEL_CHUNK_READ,    // its bytes are where they go
    EMPANEL_CHUNK_SKIPPED, // its expert was dropped (a read-ahead not routed): not read
    EMPANEL_CHUNK_FAILED,  // its read failed, or the batch failed before it was read
};
// the outcome of chunk c before it is read: skipped or failed already, else EMPANEL_CHUNK_READ (to read)
enum empanel_chunk_outcome empanel_chunk_before_read(struct empanel_reader * reader, const struct empanel_posted * p,
                                                     const struct empanel_chunk * c);
// chunk i is done; the thread finishing a job's last chunk lands the expert (hash check, repack)
// and wakes the waiters (the batch's last chunk, a failure, a tensor's last expert)
void     empanel_chunk_land(struct empanel_reader * reader, struct empanel_posted * p, int i,
                            enum empanel_chunk_outcome outcome);
// read chunk i with pread (through `bounce` where it does not land in place) and land it
void     empanel_chunk_read(struct empanel_reader * reader, struct empanel_posted * p, int i, uint8_t * bounce);
// chunk i of a lane into a free read r of the ring, as pread would read it; 0, or -1 if it is not
// to be read (the failpoint). A read the ring reaped: checked as pread's, payload out of its bounce
int      empanel_chunk_ring_prepare(struct empanel_reader * reader, int32_t lane, int i, struct empanel_ring_read * r);
enum empanel_chunk_outcome empanel_chunk_ring_landed(struct empanel_reader * reader, const struct empanel_ring_read * r);
// staging -> slot (repack, or a copy to the device): 0, or -1 with the error recorded
int      empanel_chunk_convert(struct empanel_pool * pool, const struct empanel_read_job * job);
// reader.c, for batch.c: post a batch's chunks to the threads in a lane (enum empanel_lane); take
// the lane's chunks alongside them until every chunk is done; wait until tensor ti's experts
// have landed (demand batches waited for tensor by tensor; 0, or -1 if a read of the batch
// failed)
// (by_tensor: tensor i of the layer's jobs that land through the threads are n_landing[i], its
// chunks end at chunk_end[i])
void     empanel_reader_post       (struct empanel_pool * pool, int32_t lane, struct empanel_read_job * jobs,
                                    const struct empanel_chunk * chunks, int32_t n_chunks,
                                    const struct empanel_layer * layer, int by_tensor, const int32_t * n_landing,
                                    const int32_t * chunk_end);
void     empanel_reader_finish     (struct empanel_pool * pool, int32_t lane);
int      empanel_reader_wait_tensor(struct empanel_pool * pool, int32_t ti);
// read n_misses experts of a layer into their slots (misses[i] -> slots[i]), every tensor of the
// layer; 0, or -1 with the error recorded
int      empanel_batch_read(struct empanel_pool * pool, struct empanel_layer * layer,
                              const int32_t * misses, const int32_t * slots, int32_t n_misses);
// start reading n experts of one tensor (index in layer->tensors) into their slots and return;
// the batch is in flight until empanel_batch_finish. 0, or -1 with the error recorded
int      empanel_batch_post   (struct empanel_pool * pool, struct empanel_layer * layer, int32_t tensor,
                              const int32_t * experts, const int32_t * slots, int32_t n);
// start reading n experts of every tensor of a layer into their slots and return (as
// empanel_batch_post, all tensors at once); order: the tensors' indices in the order to read them,
// each to be waited for on its own (empanel_batch_wait_tensor), or NULL
int      empanel_batch_post_layer(struct empanel_pool * pool, struct empanel_layer * layer,
                                 const int32_t * experts, const int32_t * slots, int32_t n,
                                 const int32_t * order);
// start reading ahead n guessed experts of a layer (experts[i] -> slots[i], every tensor) in the
// read-ahead lane: expert after expert in the order given (the likeliest first), so that
// empanel_batch_drop finds the unlikeliest ones not yet read. The lane must be free, and the
// demand lane too unless empanel_batch_beside says the read-ahead may go beside it
int      empanel_batch_post_ahead(struct empanel_pool * pool, struct empanel_layer * layer,
                                 const int32_t * experts, const int32_t * slots, int32_t n);
// the read-ahead in flight (empanel_batch_post_ahead) is of `layer`, whose remap routes to
// the experts in the slots with slot_mark[s] == stamp: the other experts' chunks not yet taken are
// skipped, and empanel_batch_finish leaves their slots marked as holding nothing (reconcile empties
// them). Bytes skipped count nowhere; bytes already read count as read and wasted; the experts
// not landed whole count in stats.prefetch_dropped
void     empanel_batch_drop(struct empanel_pool * pool, struct empanel_layer * layer, const uint64_t * slot_mark,
                           uint64_t stamp);
// wait until the layer's batch in flight (empanel_batch_post_layer with an order) has landed
// the experts of one tensor, reading alongside the threads; 0 (also if no such batch is in
// flight), or -1 if a read of the batch failed
int      empanel_batch_wait_tensor(struct empanel_pool * pool, struct empanel_layer * layer, int32_t tensor);
// wait for the batch in flight in a lane (reading alongside the threads) and account for it; 0 if
// there is none or it succeeded, -1 if a read failed (its slots then hold nothing)
int      empanel_batch_finish_lane(struct empanel_pool * pool, int32_t lane);
// the same for both lanes: nothing is in flight afterwards; 0, or -1 if a read of either failed
int      empanel_batch_finish (struct empanel_pool * pool);
// reads of `layer` may be in flight in one lane beside the other lane's (if that one's may too):
// the layer's pools are plain host memory that reads land in (nothing staged, no host tier, no
// RPC host) and no other layer's remap evicts its slots (not g-lru)
int      empanel_batch_beside(const struct empanel_pool * pool, const struct empanel_layer * layer);
// a batch of `layer` may be posted in `lane` now: the lane is free, and the other one is free or
// both may be in flight at once (empanel_batch_beside, another layer's)
int      empanel_batch_can_post(const struct empanel_pool * pool, int32_t lane, const struct empanel_layer * layer);
// the batch in a lane is in flight (of `layer`, if not NULL)
static inline int empanel_batch_inflight(const struct empanel_pool * pool, int32_t lane,
                                         const struct empanel_layer * layer) {
    return pool->batch[lane].inflight && (layer == NULL || pool->batch[lane].layer == layer);
}
// read experts tables.misses[0, n) into the claimed, empty slots tables.victims[0, n) and make
// them resident; if a read fails the slots stay empty (g-lru: their bytes leave the budget)
int      empanel_batch_fill_slots(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n);
// a read-ahead of this layer still in flight reads none of the guessed experts that the
// micro-batch's expert ids [n_used, n_tokens] do not route to (empanel_batch_drop)
void     empanel_batch_drop_unrouted(struct empanel_pool * pool, struct empanel_layer * layer, const int32_t * expert_ids,
                                     int64_t ids_row_stride, int32_t n_used, int32_t n_tokens);
void     empanel_batch_staging_free(struct empanel_pool * pool);
// host_cache.c
// the tier of moe_host_cache bytes for the pools in device memory (after every pool is bound); 0, or
// -1 with the reason in err
int      empanel_host_cache_init(struct empanel_pool * pool, uint64_t bytes, char * err, size_t err_size);
void     empanel_host_cache_free(struct empanel_pool * pool);
// where tensor ti of (layer, expert) sits in the tier, taking an entry for it if it has none
// (the least recently used one, not taken by this read batch); *hit: its bytes are there. NULL:
// no tier for the tensor, or no entry free for this batch
uint8_t * empanel_host_cache_get(struct empanel_pool * pool, struct empanel_layer * layer, int32_t ti,
                                 int32_t expert, uint64_t batch, int * hit);
// the read of tensor ti of (layer, expert) into its entry succeeded (ok) or failed
void     empanel_host_cache_landed(struct empanel_pool * pool, const struct empanel_layer * layer, int32_t ti,
                                   int32_t expert, int ok);
// the reads of a finished batch into tier entries: held there if it succeeded (ok), else not
void     empanel_host_cache_batch_landed(struct empanel_pool * pool, const struct empanel_batch * batch, int ok);
// the index in layer->tensors of the tensor whose slot pool is pool_tensor, or -1
static inline int32_t empanel_tensor_index(const struct empanel_layer * layer, const void * pool_tensor) {
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        if (layer->tensors[i].pool == pool_tensor) {
            return i;
        }
    }
    return -1;
}
// every tensor of the layer called its ready op since the layer's last remap
static inline int empanel_ready_all_seen(const struct empanel_layer * layer) {
    return layer->ready.seen == (1u << layer->n_tensors) - 1;
}
static inline uint64_t empanel_align_down(uint64_t x) { return x / EMPANEL_ALIGN * EMPANEL_ALIGN; }
static inline uint64_t empanel_align_up  (uint64_t x) { return (x + EMPANEL_ALIGN - 1) / EMPANEL_ALIGN * EMPANEL_ALIGN; }
// where expert e's bytes of tensor t start in its file
static inline uint64_t empanel_expert_begin(const struct empanel_tensor * t, int32_t e) {
    return t->offset + (uint64_t) e * t->expert_size;
}
// room for one expert's whole O_DIRECT window of tensor t (bytes), so that it lands in place
static inline uint64_t empanel_window_bytes(const struct empanel_tensor * t) {
    return (t->expert_size + EMPANEL_ALIGN - 1) / EMPANEL_ALIGN * EMPANEL_ALIGN + EMPANEL_ALIGN;
}
// where expert's payload sits in such room (aligned): at its file offset modulo EMPANEL_ALIGN
static inline uint8_t * empanel_window_payload(uint8_t * room, const struct empanel_tensor * t, int32_t expert) {
    return room + empanel_expert_begin(t, expert) % EMPANEL_ALIGN;
}
// bytes of staging one expert of the tensor takes on its way to its slot: its window's room
// (0 for plain host pools)
uint64_t empanel_batch_staged_bytes(const struct empanel_tensor * t);
