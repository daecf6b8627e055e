// The ready hook: a pool's MUL_MAT_ID waits for its own tensor's reads, posted by the layer's
// remap without waiting (remap.c, fill_slots_overlapped), so one tensor's experts compute while
// the next tensors' are read.

#include "ready.h"
#include "batch.h"
#include "guess.h"
#include "util.h"
#include "state.h"

int32_t empanel_ready(void * user, int32_t il, const void * pool_tensor) {
    struct empanel_pool * pool = user;
    pthread_mutex_lock(&pool->lock);
    struct empanel_layer * layer = il >= 0 && il < pool->n_layer ? &pool->layers[il] : NULL;
    const int32_t ti = layer != NULL ? empanel_tensor_index(layer, pool_tensor) : -1;
    int32_t rc = atomic_load(&pool->error.failed) ? -1 : 0; // (the graph is being stopped)
    if (ti >= 0 && rc == 0) {
        if ((layer->ready.seen & (1u << ti)) == 0) {
            layer->ready.seen       |= 1u << ti;
            layer->ready.rank[ti]    = layer->ready.next++;
        }
        // the layer's last tensor: its batch is accounted for here, nothing stays in flight
        const int last = empanel_ready_all_seen(layer) && empanel_batch_inflight(pool, EMPANEL_LANE_DEMAND, layer) &&
                         pool->reader.posted[EMPANEL_LANE_DEMAND].by_tensor;
        if (empanel_batch_wait_tensor(pool, layer, ti) != 0 ||
            (last && empanel_batch_finish_lane(pool, EMPANEL_LANE_DEMAND) != 0)) {
            empanel_batch_finish(pool); // nothing stays in flight after a failure
            if (!atomic_load(&pool->error.failed)) {
                empanel_util_set_error(pool, "reading the experts of layer %d failed", il);
            }
            rc = -1;
        } else if (last) {
            empanel_guess_post_deferred(pool); // the reader is free for a read-ahead again
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}
