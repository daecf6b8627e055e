#pragma once

// subst.c: the routing substitution hook (empanel_subst, empanel.h): a missing expert routed to
// gets a resident stand-in among the router's next choices (opt-in, outputs change)

#include "empanel.h"
