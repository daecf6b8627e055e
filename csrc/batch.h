#pragma once

// batch.c: batches of expert reads in two lanes (struct empanel_lanes, state.h): a remap's
// misses, a wave's, a read-ahead's or a preload's planned as jobs (expert x tensor) cut into
// chunks, posted to the reader (reader.c), waited for and accounted for

#include "state.h"

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
// flight), or -1 if a read of the batch failed. Called with the pool's lock held, it lets go of
// the lock while it waits: the controller gives memory back meanwhile (slots of other layers; this
// layer's are not evictable while its batch is in flight, slots.c)
int      empanel_batch_wait_tensor(struct empanel_pool * pool, struct empanel_layer * layer, int32_t tensor);
// wait for the batch in flight in a lane (reading alongside the threads) and account for it; 0 if
// there is none or it succeeded, -1 if a read failed (its slots then hold nothing). Called with
// the pool's lock held, it lets go of it while it waits, as empanel_batch_wait_tensor does
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
    return pool->lanes.batch[lane].inflight && (layer == NULL || pool->lanes.batch[lane].layer == layer);
}
// read experts tables.misses[0, n) into the claimed, empty slots tables.victims[0, n) and make
// them resident; if a read fails the slots stay empty (their bytes leave the budget)
int      empanel_batch_fill_slots(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n);
// a read-ahead of this layer still in flight reads none of the guessed experts that the
// micro-batch's expert ids [n_used, n_tokens] do not route to (empanel_batch_drop)
void     empanel_batch_drop_unrouted(struct empanel_pool * pool, struct empanel_layer * layer, const int32_t * expert_ids,
                                     int64_t ids_row_stride, int32_t n_used, int32_t n_tokens);
void     empanel_batch_staging_free(struct empanel_pool * pool);
// bytes of staging one expert of the tensor takes on its way to its slot: its window's room
// (0 for plain host pools)
uint64_t empanel_batch_staged_bytes(const struct empanel_tensor * t);
// read ahead the experts of layer->tables.distinct[0, n) (a guess, likeliest first) that are not
// resident, in the read-ahead lane; the tables say where they will be, and the layer's next
// remap drops the reads of those it does not route to and finishes the others (guess.c, remap.c)
void     empanel_batch_read_ahead(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n);
