#pragma once

// reader.c: the reader threads (struct empanel_reader, io.h): they and the calling thread share
// out the chunks of the posted batches, the demand lane's first; with io_uring one thread keeps
// `depth` chunks in flight in its ring. Started and stopped with the pool.

#include "io.h"

int      empanel_reader_start(struct empanel_pool * pool, int32_t n_threads, uint64_t chunk_bytes, int32_t read_io,
                              int32_t depth, char * err, size_t err_size);
void     empanel_reader_stop (struct empanel_pool * pool);
// io_uring stopped answering with reads in flight: buffers they may land in must never be freed
int      empanel_reader_lost (const struct empanel_pool * pool);
int32_t  empanel_reader_io   (const struct empanel_pool * pool); // EMPANEL_READ_IO_THREADS or _URING, now
// for batch.c: post a batch's chunks to the threads in a lane (enum empanel_lane); take
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
