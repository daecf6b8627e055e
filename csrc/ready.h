#pragma once

// ready.c: the ready hook (empanel_ready, empanel.h): a pool's MUL_MAT_ID waits for its own
// tensor's reads, so a remap may post a layer's misses and return (overlapped reads)

#include "layer.h"

// every tensor of the layer called its ready op since the layer's last remap
static inline int empanel_ready_all_seen(const struct empanel_layer * layer) {
    return layer->ready.seen == (1u << layer->n_tensors) - 1;
}
