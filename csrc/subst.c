// Routing substitution (opt-in, inexact): a routed expert that is not resident is replaced by a
// resident one among the router's next choices whose score is close enough (params.subst_ratio),
// so the micro-batch reads nothing for it. Outputs change; counted in stats.substituted.

#include "subst.h"
#include "state.h"

int32_t empanel_subst(void * user, int32_t il, int32_t * expert_ids, int64_t ids_row_stride, int32_t n_used,
                      const int32_t * candidates, int64_t cand_row_stride, int32_t n_cand,
                      const float * scores, int64_t scores_row_stride, int32_t n_tokens) {
    struct empanel_pool * pool = user;
    pthread_mutex_lock(&pool->lock);
    struct empanel_layer * layer = il >= 0 && il < pool->n_layer ? &pool->layers[il] : NULL;
    if (layer == NULL || layer->n_slots <= 0 || layer->observe || pool->config.subst_ratio <= 0 || atomic_load(&pool->error.failed)) {
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        int32_t       * ids   = expert_ids + (int64_t) t * ids_row_stride;
        const int32_t * cand  = candidates + (int64_t) t * cand_row_stride;
        const float   * score = scores + (int64_t) t * scores_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = ids[j];
            if (e < 0 || e >= pool->n_expert || layer->tables.slot_of[e] >= 0) {
                continue; // resident: kept
            }
            for (int32_t c = 0; c < n_cand; c++) {
                const int32_t alt = cand[c];
                if (alt < 0 || alt >= pool->n_expert || layer->tables.slot_of[alt] < 0 ||
                    !(score[alt] >= pool->config.subst_ratio * score[e])) {
                    continue;
                }
                int taken = 0;
                for (int32_t k = 0; k < n_used && !taken; k++) {
                    taken = ids[k] == alt;
                }
                if (!taken) {
                    ids[j] = alt;
                    layer->stats.substituted++;
                    break;
                }
            }
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return 0;
}
