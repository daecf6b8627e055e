#pragma once

// ring.c: io_uring rings (liburing), the reader's second path; in a build without liburing every
// ring refuses (empanel_ring_init -1 with why) and the reader threads read. empanel_uring_available
// (empanel.h) asks it.

#include "empanel.h"

#include <stddef.h>
#include <stdint.h>

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
