#pragma once

// trace.c: the routing trace (empanel_trace_enable, _take, _size in empanel.h): every remap call
// and guess appends its expert ids while it is on (struct empanel_trace, state.h)

#include "empanel.h"

#include <stdint.h>

struct empanel_pool;

// append a routing record [il, n_tokens, n_used, ids] to the trace; 0 or -1
int     empanel_trace_call(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                           int64_t ids_row_stride, int32_t n_used, int32_t n_tokens);
