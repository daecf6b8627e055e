#pragma once

// Reads in flight, by concern: a read job (one expert tensor of one expert) and its chunks (read
// requests), the two lanes of batches (batch.c plans them: struct empanel_batch, staging), what
// a lane posts to the reader threads (struct empanel_posted) and the reader itself (reader.c,
// with its io_uring part and the test failpoints).

#include "common.h"

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
    uint64_t   repack_ns;   // time its thread took to repack it (convert 1: CPU_REPACK pools)
    int        repack_own;  // the sidecar's own repack wrote it (repack.c), not ggml's
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

struct empanel_ring;      // ring.c
struct empanel_ring_read; // ring.c
struct empanel_pool;      // state.h

// io_uring (reader.c, ring.c): the ring of reader thread 0, written by reader_start and the ring
// thread; ring NULL: the threads read
struct empanel_reader_uring {
    int32_t                    depth; // chunks in flight at most
    struct empanel_ring      * ring;  // the ring of reader thread 0; NULL: the threads read
    struct empanel_ring_read * ops;   // [depth] its reads, each with a bounce buffer
    atomic_int                 state; // written by the ring thread: RING_OK; RING_OFF: it broke with nothing
                                      // in flight, the thread preads; RING_LOST: the kernel kept reads (reader.c)
};

// reader threads: they and the calling thread share out the chunks of the posted batches, the
// demand lane's first (reader.c). With io_uring, one reader thread keeps up to `depth` chunks in
// flight in its ring, of both lanes, and lands them; the calling thread only waits
struct empanel_reader {
    struct empanel_reader_uring uring; // io_uring: the ring of reader thread 0 and its reads
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
                                  // read-ahead waits for the demand lane: the other way, to measure against)
    int             drop_ahead;   // read-ahead not routed is dropped (EMPANEL_READ_AHEAD_KEEP=1: read whole,
                                  // the other way, to measure against)
    struct empanel_pool * pool;

    pthread_mutex_t mutex;
    pthread_cond_t  cond_work;    // a batch is posted (or stop)
    pthread_cond_t  cond_done;    // a lane's last chunk finished, a tensor landed, a thread left a lane
    atomic_ullong   posts[EMPANEL_N_LANES];  // batches posted in each lane so far (under mutex)
    int             stop;
    struct empanel_posted posted[EMPANEL_N_LANES];
};

// failpoints for tests (reader.c): read requests from the after-th on fail with EIO (0: never),
// count of them (0: all); set from EMPANEL_FAULT_READ_AFTER / _COUNT at init
struct empanel_fault {
    int64_t      after;
    int64_t      count;
    int          short_reads; // EMPANEL_FAULT_SHORT_READS=1: every request first asks for half its
                              // bytes (a block multiple), as a short read returns them; the rest follows
    int64_t      delay_us;    // EMPANEL_FAULT_READ_DELAY_MS=N: every read request starts N ms late (a
                              // slow drive: tests of what must not wait for reads)
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
