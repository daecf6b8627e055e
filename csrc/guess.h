#pragma once

// guess.c: the gate-ahead guess hook (empanel_guess, empanel.h): guessed experts are evicted last
// by the layer's next remap and, with params.prefetch, read ahead in the read-ahead lane

#include "empanel.h"

struct empanel_pool;

// the read-ahead a guess deferred while overlapped reads were in flight, posted now if it
// still can be
void    empanel_guess_post_deferred(struct empanel_pool * pool);
