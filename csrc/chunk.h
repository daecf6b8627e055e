#pragma once

// chunk.c: one read request (struct empanel_chunk) of a lane's posted batch: read with pread or
// prepared for and landed from the ring, checked (short reads, digests, the failpoints), and the
// expert landed once its last chunk is (hash check, repack, the waiters woken)

#include "io.h"

struct empanel_ring_read;

// one chunk of a lane's posted batch p
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
