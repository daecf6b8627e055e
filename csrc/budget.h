#pragma once

// budget.c: the live budget of resident expert bytes over all layers (empanel_pool_set_budget,
// empanel_pool_budget, empanel.h), moved at run time by the app or the controller (pressure.c); a
// lower one gives slots back at once, their pages to the kernel.

#include "empanel.h"

struct empanel_pool;

// after the pools are bound (load.c): the floor (the top-k experts of every paged layer, n_used
// per token) and whether the budget can move at all (not for pinned pools, nor device memory)
void empanel_budget_settle(struct empanel_pool * pool, int32_t n_used, int pinned);
// 0 if the budget can move, else -1 with why in err (pinned pools, device memory)
int  empanel_budget_movable(const struct empanel_pool * pool, char * err, size_t err_size);
// the budget becomes budget_bytes, clamped to [floor, capacity] (the pool's lock held); a lower
// one empties slots at once (empanel_slots_shrink)
void empanel_budget_set_locked(struct empanel_pool * pool, uint64_t budget_bytes);
