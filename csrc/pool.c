// Expert slot pools: which expert of a layer sits in which slot, what to evict, what to read.

#include "empanel.h"

int32_t empanel_sidecar_version(void) {
    return EMPANEL_SIDECAR_VERSION;
}
