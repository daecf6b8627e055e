#pragma once

// slots.c: the slot tables of a layer (struct empanel_tables, layer.h) and the recency list over
// all layers that g-lru and the budget evict from (struct empanel_budget, state.h): victims, hits, claims, reconciling with what the slots
// hold. No I/O; remap.c, guess.c, preload.c and batch.c change the tables only through it.

#include <stdint.h>

struct empanel_layer;
struct empanel_pool;

// the slot in [begin, end) to evict, among those whose mark is not `taken` (-1 if none)
int32_t empanel_slots_pick_victim(const struct empanel_layer * layer, int32_t policy, int32_t begin, int32_t end,
                                  const uint64_t * mark, uint64_t taken);
// slot s is used by `call` (LRU clock, LFU count)
void    empanel_slots_note_use(struct empanel_layer * layer, int32_t s, uint64_t call);
// a hit: the expert in slot s stays where it is, and is used by `call`
void    empanel_slots_use_hit(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call);
// claim slot s for an expert that comes: its expert leaves (an empty slot takes room in the
// budget from the least recent expert of any layer, where the budget is full)
void    empanel_slots_claim(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call);
// expert e takes slot s (claimed for `call`): the tables say it is there from now on, its bytes
// come with the reads that follow
void    empanel_slots_place(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, int32_t e, uint64_t call);
// the tables say that experts tables.misses[0, n) are in slots tables.victims[0, n)
void    empanel_slots_hold_misses(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n);
// misses[0, n) -> victims[0, n) reordered by expert id (reads in file order)
void    empanel_slots_sort_file_order(struct empanel_layer * layer, int32_t n);
// one micro-batch done in n_waves waves: the decay clock ticks (the layer's own, not its statistics)
void    empanel_slots_end_batch(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n_waves);
// slot `slot` of the layer holds nothing: host pools give its pages back; -1 if the kernel refused
// them (pinned memory), else 0
int     empanel_slots_release(struct empanel_layer * layer, int32_t slot);
// slot s stops holding what a read-ahead put there before its micro-batch came: wasted bytes
void    empanel_slots_drop_prefetch(struct empanel_layer * layer, int32_t s);
// the live guess of a layer is spent by the remap of its n distinct experts (in tables.distinct)
// routed: recall accounted, read-ahead not routed wasted
void    empanel_slots_close_guess(struct empanel_layer * layer, int32_t n);
// a plan, read-ahead or overlapped reads that did not run to their end (a failure, an aborted
// graph): slots whose tensors do not all hold the expert the tables say are emptied
void    empanel_slots_reconcile(struct empanel_pool * pool, struct empanel_layer * layer);
// take entry e (layer->lru_base + slot) out of the recency list / put it at the recent end
void    empanel_slots_recent_unlink(struct empanel_pool * pool, int32_t e);
void    empanel_slots_recent_push(struct empanel_pool * pool, int32_t e);
// evict least recent experts of any layer (none that call `call` or the layer computing now
// uses, none of a layer whose waves run or whose reads are in flight) until `need` more bytes fit
// in the budget; the budget yields where none may go
void    empanel_slots_make_room(struct empanel_pool * pool, uint64_t need, uint64_t call);
// the budget went down: least recent experts of any layer go at once, down to it, but for those
// make_room keeps (the layer computing now, waves running, reads in flight: the remaps that
// follow take those back). Bytes emptied
uint64_t empanel_slots_shrink(struct empanel_pool * pool);
