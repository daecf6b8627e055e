// One read request of a posted batch (a chunk: reader.c takes them, batch.c plans them): read with
// pread, or prepared for the ring (ring.c) and checked when it comes back; then landed: the thread
// finishing an expert's last chunk checks its digest (moe_verify), repacks it into a CPU_REPACK
// slot, and wakes whoever waits for its batch or its tensor.
//
// With O_DIRECT a read is an aligned window around the payload (GGUF data is only 32-byte
// aligned), and it lands in place, copied by no one, wherever its destination sits at the
// payload's file offset modulo EMPANEL_ALIGN:
// - staging: always; each expert gets room for its whole window at that phase;
// - a plain host pool's slot: when the hook placed the pool at its tensor's phase (llama-empanel
//   .cpp) and the expert size is a multiple of EMPANEL_ALIGN (then every expert of the tensor
//   sits at one phase). The window's first and last blocks hold a neighbouring slot's bytes, so
//   those two go through the bounce buffer (at most EMPANEL_ALIGN bytes of payload copied per
//   expert); the rest lands in the slot.
// Anything else lands in the thread's bounce buffer and its payload is copied (stats.bounce_bytes).
// Both read paths fail the same way: the same messages, the same failpoints.

#include "chunk.h"
#include "backend.h"
#include "remote.h"
#include "ring.h"
#include "rpc.h"
#include "util.h"
#include "state.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// the short-read failpoint: the first request of `length` bytes asks for half (a multiple of
// EMPANEL_ALIGN, for O_DIRECT), or all of it when that is a block or less
static uint64_t short_read_bytes(uint64_t length) {
    const uint64_t half = empanel_align_down(length / 2);
    return half > 0 ? half : length;
}

// read at least `need` bytes of [offset, offset + length) into dst; a read may end early only at
// the end of the file, which holds no payload
static int pread_chunk(struct empanel_pool * pool, const struct empanel_file * f, int fd, uint8_t * dst,
                       uint64_t length, uint64_t offset, uint64_t need) {
    uint64_t done = 0;
    while (done < length) {
        const uint64_t ask = done == 0 && pool->fault.short_reads ? short_read_bytes(length) : length - done;
        const ssize_t n = pread(fd, dst + done, ask, (off_t) (offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            empanel_util_set_error(pool, "%s: read of %llu bytes at offset %llu failed: %s", f->path,
                                   (unsigned long long) (length - done), (unsigned long long) (offset + done), strerror(errno));
            return -1;
        }
        if (n == 0) {
            break;
        }
        done += (uint64_t) n;
    }
    if (done < need) {
        empanel_util_set_error(pool, "%s: short read at offset %llu (%llu of %llu bytes): file truncated?",
                               f->path, (unsigned long long) offset, (unsigned long long) done, (unsigned long long) need);
        return -1;
    }
    return 0;
}

// moe_verify: the expert's bytes, all landed in job->dst (the slot, or staging before the
// conversion), against its digest; an unknown digest is taken from this first read
static int verify_job(struct empanel_pool * pool, struct empanel_read_job * job) {
    const uint64_t t0 = empanel_util_now_ns();
    const uint64_t h = empanel_hash64(job->dst, job->tensor->expert_size);
    uint64_t * want = &job->tensor->digest[job->expert];
    job->verify_ns = empanel_util_now_ns() - t0;
    if (*want == 0) {
        *want = h;
        return 0;
    }
    if (h != *want) {
        empanel_util_set_error(pool,
            "%s: expert %d read from %s does not match its digest (XXH3-64 %016llx, expected %016llx): "
            "the file changed or the drive returned other bytes; reload the model, and check the file "
            "with empanel-gguf verify", job->tensor->name, job->expert, pool->files.list[job->tensor->file].path,
            (unsigned long long) h, (unsigned long long) *want);
        return -1;
    }
    return 0;
}

// staging -> slot (repack, or a copy to the device)
int empanel_chunk_convert(struct empanel_pool * pool, const struct empanel_read_job * job) {
    if (empanel_backend_slot_write(job->tensor->pool, job->slot, job->dst, job->tensor->expert_size) != 0) {
        empanel_util_set_error(pool, "%s: writing expert %d into slot %d failed", job->tensor->name, job->expert, job->slot);
        return -1;
    }
    return 0;
}

// staging -> a CPU_REPACK slot by the reader thread that landed the expert (the sidecar's own
// repack where backend.c has one for the tensor), timed (repack_ns)
static int repack_job(struct empanel_pool * pool, struct empanel_read_job * job) {
    const uint64_t t0 = empanel_util_now_ns();
    struct empanel_tensor * t = job->tensor;
    if (empanel_backend_slot_repack(t->pool, job->slot, job->dst, t->expert_size, &t->repack_own, &job->repack_own) != 0) {
        empanel_util_set_error(pool, "%s: repacking expert %d into slot %d failed", t->name, job->expert, job->slot);
        return -1;
    }
    job->repack_ns = empanel_util_now_ns() - t0;
    return 0;
}

// the test failpoints (EMPANEL_FAULT_READ_AFTER / _COUNT): -1 if this read request is to fail;
// EMPANEL_FAULT_READ_DELAY_MS: it starts that late
static int read_fault(struct empanel_pool * pool, const struct empanel_chunk * c) {
    if (pool->fault.delay_us > 0) {
        usleep((useconds_t) pool->fault.delay_us);
    }
    const int64_t request = pool->fault.after > 0 ? atomic_fetch_add(&pool->fault.n_requests, 1) + 1 : 0;
    if (pool->fault.after > 0 && request >= pool->fault.after &&
        (pool->fault.count <= 0 || request < pool->fault.after + pool->fault.count)) {
        empanel_util_set_error(pool, "%s: read of %llu bytes at offset %llu failed: %s (EMPANEL_FAULT_READ_AFTER)",
                               pool->files.list[c->file].path, (unsigned long long) c->length, (unsigned long long) c->offset,
                               strerror(EIO));
        return -1;
    }
    return 0;
}

static int read_chunk(struct empanel_reader * reader, const struct empanel_posted * p, const struct empanel_chunk * c,
                      uint8_t * bounce) {
    struct empanel_pool * pool = reader->pool;
    const struct empanel_file * f = &pool->files.list[c->file];
    if (read_fault(pool, c) != 0) {
        return -1;
    }
    uint8_t * dst = p->jobs[c->job].dst + c->dst_offset;
    if (reader->direct && f->fd_direct >= 0) {
        if (c->in_place) { // the whole window, at an aligned address of the job's own
            return pread_chunk(pool, f, f->fd_direct, dst - c->skip, c->length, c->offset, c->skip + c->payload);
        }
        if (pread_chunk(pool, f, f->fd_direct, bounce, c->length, c->offset, c->skip + c->payload) != 0) {
            return -1;
        }
        memcpy(dst, bounce + c->skip, c->payload);
        return 0;
    }
    return pread_chunk(pool, f, f->fd, dst, c->payload, c->offset + c->skip, c->payload);
}

// the outcome of chunk c before it is read: skipped or failed already, else EMPANEL_CHUNK_READ
enum empanel_chunk_outcome empanel_chunk_before_read(struct empanel_reader * reader, const struct empanel_posted * p,
                                                     const struct empanel_chunk * c) {
    if (atomic_load(&p->jobs[c->job].dropped)) {
        return EMPANEL_CHUNK_SKIPPED;
    }
    return atomic_load(&reader->pool->error.failed) ? EMPANEL_CHUNK_FAILED : EMPANEL_CHUNK_READ;
}

// chunk i of a lane's posted batch is done; the thread finishing a job's last chunk lands the
// expert (hash check, repack). Waiters are woken by the batch's last chunk, a failure, and
// (batches waited for tensor by tensor) a tensor's last expert landed
void empanel_chunk_land(struct empanel_reader * reader, struct empanel_posted * p, int i,
                        enum empanel_chunk_outcome outcome) {
    struct empanel_pool        * pool = reader->pool;
    const struct empanel_chunk * c    = &p->chunks[i];
    struct empanel_read_job    * job  = &p->jobs[c->job];
    int failed = 0;
    int landed = 0; // the last expert of its tensor in this batch
    if (outcome == EMPANEL_CHUNK_SKIPPED) { // a read-ahead not routed: the expert never lands
        atomic_fetch_add(&job->skipped, c->payload);
        atomic_fetch_add(&p->skipped_io, c->length);
        atomic_fetch_add(&p->skipped_bounce, reader->direct && !c->in_place ? c->payload : 0);
    } else if (outcome == EMPANEL_CHUNK_FAILED) {
        failed = 1; // skipped or failed: the batch is incomplete
    } else if (atomic_fetch_sub(&job->chunks_left, 1) == 1) { // the expert is complete
        const struct empanel_remote * remote = job->tensor->remote;
        if (remote != NULL && remote->cache && job->tensor->digest == NULL) {
            job->remote_hash = empanel_rpc_hash(job->dst, job->tensor->expert_size); // its name on the host
        }
        if ((job->tensor->digest != NULL && verify_job(pool, job) != 0) ||
            (job->convert == 1 && repack_job(pool, job) != 0)) { // repack it now
            failed = 1;
        } else {
            job->landed = 1;
            if (p->by_tensor) {
                const int32_t ti = (int32_t) (job->tensor - p->tensors);
                landed = atomic_fetch_sub(&p->tensor_left[ti], 1) == 1;
            }
        }
    }
    if (failed) {
        atomic_store(&p->batch_failed, 1);
    }
    const int last = atomic_fetch_add(&p->done, 1) + 1 == p->n_chunks;
    if (last || failed || landed) {
        pthread_mutex_lock(&reader->mutex);
        if (last) {
            p->done_ns = empanel_util_now_ns();
        }
        pthread_cond_broadcast(&reader->cond_done);
        pthread_mutex_unlock(&reader->mutex);
    }
}

// read chunk i of a lane's posted batch (threads: pread) and land it
void empanel_chunk_read(struct empanel_reader * reader, struct empanel_posted * p, int i, uint8_t * bounce) {
    const struct empanel_chunk * c = &p->chunks[i];
    enum empanel_chunk_outcome outcome = empanel_chunk_before_read(reader, p, c);
    if (outcome == EMPANEL_CHUNK_READ && read_chunk(reader, p, c, bounce) != 0) {
        outcome = EMPANEL_CHUNK_FAILED;
    }
    empanel_chunk_land(reader, p, i, outcome);
}

// chunk i of a lane into a free read r of the ring (as read_chunk would read it); 0, or -1 if it
// is not to be read (the failpoint)
int empanel_chunk_ring_prepare(struct empanel_reader * reader, int32_t lane, int i, struct empanel_ring_read * r) {
    struct empanel_pool        * pool = reader->pool;
    const struct empanel_chunk * c    = &reader->posted[lane].chunks[i];
    const struct empanel_file  * f    = &pool->files.list[c->file];
    if (read_fault(pool, c) != 0) {
        return -1;
    }
    uint8_t * dst = reader->posted[lane].jobs[c->job].dst + c->dst_offset;
    r->chunk = i;
    r->lane  = lane;
    if (reader->direct && f->fd_direct >= 0) {
        r->fd     = f->fd_direct;
        r->buf    = c->in_place ? dst - c->skip : r->bounce;
        r->length = c->length;
        r->offset = c->offset;
    } else {
        r->fd     = f->fd;
        r->buf    = dst;
        r->length = c->payload;
        r->offset = c->offset + c->skip;
    }
    r->first = pool->fault.short_reads ? short_read_bytes(r->length) : 0;
    return 0;
}

// a read the ring reaped: checked as pread_chunk checks, the payload out of the bounce buffer
enum empanel_chunk_outcome empanel_chunk_ring_landed(struct empanel_reader * reader,
                                                     const struct empanel_ring_read * r) {
    struct empanel_pool        * pool = reader->pool;
    const struct empanel_posted * p   = &reader->posted[r->lane];
    const struct empanel_chunk * c    = &p->chunks[r->chunk];
    const struct empanel_file  * f    = &pool->files.list[c->file];
    const int      windowed = reader->direct && f->fd_direct >= 0;
    const uint64_t need     = windowed ? c->skip + c->payload : c->payload;
    if (r->err != 0) { // (a ring that broke: its later batches are read with pread)
        empanel_util_set_error(pool, "%s: read of %llu bytes at offset %llu failed: %s (io_uring)", f->path,
                               (unsigned long long) (r->length - r->done), (unsigned long long) (r->offset + r->done),
                               strerror(r->err));
        return EMPANEL_CHUNK_FAILED;
    }
    if (r->done < need) {
        empanel_util_set_error(pool, "%s: short read at offset %llu (%llu of %llu bytes): file truncated?",
                               f->path, (unsigned long long) r->offset, (unsigned long long) r->done, (unsigned long long) need);
        return EMPANEL_CHUNK_FAILED;
    }
    if (windowed && !c->in_place) {
        memcpy(p->jobs[c->job].dst + c->dst_offset, r->bounce + c->skip, c->payload);
    }
    return EMPANEL_CHUNK_READ;
}
