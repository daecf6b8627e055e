// A ring of reads in flight (io_uring, through liburing): the reader's second path (reader.c).
// One thread queues up to `depth` reads, submits them in one system call and reaps them as they
// complete; nothing here knows about experts or pools. A read that completes short is queued
// again for its rest (as pread is called again), so a reaped read is whole, ended by the end of
// the file, or failed with an errno.
//
// Built without liburing (not found at build time, or not Linux), empanel_ring_init refuses with
// the reason, and the reader keeps its threads. Where the kernel refuses io_uring (a container's
// seccomp profile, kernel.io_uring_disabled), the same.

#include "ring.h"
#include "util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>

#if defined(EMPANEL_HAVE_URING)
#    include <liburing.h>

struct empanel_ring {
    struct io_uring uring;
    int32_t         depth;
    int32_t         in_flight;  // submitted, not yet reaped
    int             broken;     // errno of a submission or wait the kernel refused, 0: none
    int32_t         n_queued;   // prepared, not yet submitted: queued[0, n_queued)
    struct empanel_ring_read ** queued; // [depth]
    int32_t         n_failed;   // never submitted (the ring broke): failed[0, n_failed), reaped first
    struct empanel_ring_read ** failed; // [depth]
    // failpoints for tests: the n-th submission is refused with EPERM (as a seccomp profile
    // refuses io_uring_enter), the n-th wait fails with EFAULT while reads are in flight; 0: never
    int64_t         fault_submit;
    int64_t         fault_wait;
};

static int64_t env_count(const char * name) {
    const char * v = getenv(name);
    return v != NULL ? atoll(v) : 0;
}

int empanel_ring_init(struct empanel_ring ** out, int32_t depth, char * why, size_t why_size) {
    *out = NULL;
    struct empanel_ring * ring = calloc(1, sizeof(*ring));
    if (ring == NULL || (ring->queued = calloc((size_t) depth, sizeof(*ring->queued))) == NULL ||
        (ring->failed = calloc((size_t) depth, sizeof(*ring->failed))) == NULL) {
        if (ring != NULL) {
            free(ring->queued);
        }
        free(ring);
        empanel_util_format_err(why, why_size, "out of memory");
        return -1;
    }
    int rc = io_uring_queue_init((unsigned) depth, &ring->uring, 0);
    if (rc < 0) {
        empanel_util_format_err(why, why_size, "io_uring_queue_init(%d): %s", depth, strerror(-rc));
    } else {
        // IORING_OP_READ came with Linux 5.6; a ring of an older kernel sets up, then fails every read
        struct io_uring_probe * probe = io_uring_get_probe_ring(&ring->uring);
        if (probe == NULL || !io_uring_opcode_supported(probe, IORING_OP_READ)) {
            empanel_util_format_err(why, why_size, "this kernel's io_uring has no IORING_OP_READ (Linux 5.6)");
            io_uring_queue_exit(&ring->uring);
            rc = -1;
        }
        if (probe != NULL) {
            io_uring_free_probe(probe);
        }
    }
    if (rc < 0) {
        free(ring->queued);
        free(ring->failed);
        free(ring);
        return -1;
    }
    ring->depth        = depth;
    ring->fault_submit = env_count("EMPANEL_FAULT_URING_SUBMIT");
    ring->fault_wait   = env_count("EMPANEL_FAULT_URING_WAIT");
    *out = ring;
    return 0;
}

void empanel_ring_free(struct empanel_ring * ring) {
    if (ring != NULL) {
        io_uring_queue_exit(&ring->uring); // (only with nothing in flight: the kernel does not wait)
        free(ring->queued);
        free(ring->failed);
        free(ring);
    }
}

int32_t empanel_ring_room(const struct empanel_ring * ring) {
    return ring->depth - ring->n_queued - ring->in_flight - ring->n_failed;
}

int32_t empanel_ring_in_flight(const struct empanel_ring * ring) {
    return ring->n_queued + ring->in_flight + ring->n_failed;
}

// the rest of r, [done, length), into the submission queue; a ring that is broken (or, which the
// counts rule out, has no free entry) fails it instead
static void queue_rest(struct empanel_ring * ring, struct empanel_ring_read * r) {
    struct io_uring_sqe * sqe = ring->broken ? NULL : io_uring_get_sqe(&ring->uring);
    if (sqe == NULL) {
        ring->broken = ring->broken ? ring->broken : EBUSY;
        r->err = ring->broken;
        ring->failed[ring->n_failed++] = r;
        return;
    }
    const uint64_t n = r->done == 0 && r->first > 0 && r->first < r->length ? r->first : r->length - r->done;
    io_uring_prep_read(sqe, r->fd, r->buf + r->done, (unsigned) n, r->offset + r->done);
    io_uring_sqe_set_data(sqe, r);
    ring->queued[ring->n_queued++] = r;
}

void empanel_ring_queue(struct empanel_ring * ring, struct empanel_ring_read * r) {
    r->done    = 0;
    r->err     = 0;
    r->retries = 0;
    queue_rest(ring, r);
}

// submit what is queued; a refusal that is not transient breaks the ring: its queued reads fail
// (their entries are never submitted: the ring is not used again, empanel_ring_broken)
static void submit(struct empanel_ring * ring) {
    for (int tries = 0; ring->n_queued > 0 && !ring->broken; tries++) {
        const int n = ring->fault_submit > 0 && --ring->fault_submit == 0 ? -EPERM : io_uring_submit(&ring->uring);
        if (n > 0) { // the kernel consumes the queue in order
            memmove(ring->queued, ring->queued + n, sizeof(*ring->queued) * (size_t) (ring->n_queued - n));
            ring->n_queued  -= n;
            ring->in_flight += n;
            continue;
        }
        const int transient = n == 0 || n == -EINTR || n == -EAGAIN || n == -EBUSY;
        if (transient && ring->in_flight > 0) {
            return; // room comes with the completions
        }
        if (!transient || tries >= 1000) {
            ring->broken = n < 0 ? -n : EIO;
        } else {
            sched_yield();
        }
    }
    while (ring->broken && ring->n_queued > 0) {
        struct empanel_ring_read * r = ring->queued[--ring->n_queued];
        r->err = ring->broken;
        ring->failed[ring->n_failed++] = r;
    }
}

struct empanel_ring_read * empanel_ring_reap(struct empanel_ring * ring) {
    for (;;) {
        submit(ring);
        if (ring->n_failed > 0) {
            return ring->failed[--ring->n_failed];
        }
        if (ring->in_flight == 0) {
            return NULL;
        }
        struct io_uring_cqe * cqe = NULL;
        const int rc = ring->fault_wait > 0 && --ring->fault_wait == 0 ? -EFAULT : io_uring_wait_cqe(&ring->uring, &cqe);
        if (rc == -EINTR || rc == -EAGAIN) {
            continue;
        }
        if (rc < 0) { // the reads in flight cannot be waited for, and may still land
            ring->broken = -rc;
            return NULL;
        }
        struct empanel_ring_read * r = io_uring_cqe_get_data(cqe);
        const int res = cqe->res;
        io_uring_cqe_seen(&ring->uring, cqe);
        ring->in_flight--;
        if ((res == -EINTR || res == -EAGAIN) && ++r->retries < 1000) {
            queue_rest(ring, r); // tried again, as pread is
            continue;
        }
        if (res < 0) {
            r->err = -res;
            return r;
        }
        r->done += (uint64_t) res;
        if (res > 0 && r->done < r->length) { // (one that asked for less: the same)
            queue_rest(ring, r); // short: the rest is read, as pread is called again
            continue;
        }
        return r; // whole, or ended by the end of the file (res 0)
    }
}

int empanel_ring_broken(const struct empanel_ring * ring) {
    return ring->broken;
}

#else // no liburing

struct empanel_ring {
    int32_t depth;
};

int empanel_ring_init(struct empanel_ring ** out, int32_t depth, char * why, size_t why_size) {
    *out = NULL;
    empanel_util_format_err(why, why_size, "this build has no io_uring (liburing was not found when it was built)");
    return -1;
}

void empanel_ring_free(struct empanel_ring * ring) {
    (void) ring;
}

int32_t empanel_ring_room(const struct empanel_ring * ring) {
    return 0;
}

int empanel_ring_broken(const struct empanel_ring * ring) {
    return ENOSYS;
}

void empanel_ring_queue(struct empanel_ring * ring, struct empanel_ring_read * r) {
    (void) ring;
    (void) r;
}

int32_t empanel_ring_in_flight(const struct empanel_ring * ring) {
    return 0;
}

struct empanel_ring_read * empanel_ring_reap(struct empanel_ring * ring) {
    return NULL;
}

#endif

int32_t empanel_uring_available(char * why, size_t why_size) {
    struct empanel_ring * ring = NULL;
    if (empanel_ring_init(&ring, 4, why, why_size) != 0) {
        return 0;
    }
    empanel_ring_free(ring);
    return 1;
}
