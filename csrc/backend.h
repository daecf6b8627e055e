#pragma once

// backend.c: pool tensors through ggml's public backend API (and libllama's struct sizes for
// empanel_struct_size, the devices for empanel_offload_devices / empanel_unified_devices,
// empanel_backend_slot_data: empanel.h)

#include "empanel.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

// the memory of a pool in host memory of any layout (plain or CPU_REPACK), else NULL; slot s takes
// bytes [s*nb[2], (s+1)*nb[2])
void *  empanel_backend_host_data(void * pool_tensor);
// host memory to stage reads bound for a device pool: pinned memory of its device (its host buffer
// type), or plain memory where it has none; *buffer gets the backend buffer to release. NULL if
// out of memory
void *  empanel_backend_host_buffer_alloc(void * pool_tensor, size_t size, void ** buffer);
void    empanel_backend_host_buffer_free(void * buffer);
// whether a pool in host memory (empanel_backend_host_data) can give pages back one by one: 1 in
// the CPU device's own buffers (our reserved range, CPU_REPACK); 0 in a GPU backend's pinned host
// buffer, where llama.cpp puts CPU layers when a GPU is present (pinned pages stay charged)
int     empanel_backend_host_gives_back(void * pool_tensor);
// give back the pages inside [ptr, ptr + size) (they read as zeros afterwards); with zero_edges
// also zero the bytes of the partial pages at both ends. 1 if the kernel took the pages back, 0
// if there were no whole pages, -1 if it refused them (pinned memory: zeroed instead, if asked)
int     empanel_backend_memory_release(uint8_t * ptr, uint64_t size, int zero_edges);
// one expert's bytes as stored in the GGUF (nb[2] bytes) into slot `slot`: copied, repacked
// (CPU_REPACK) or sent to the device; 0 on success
int32_t empanel_backend_slot_write(void * pool_tensor, int32_t slot, const void * data, size_t size);
// the same into a CPU_REPACK pool by the sidecar's own repack where it has one for the tensor's
// layout: the first expert of each tensor (*own 0) is repacked by ggml and by ours, compared, and
// *own set to 2 (equal: ours from now on) or 3 (ggml's always; set at bind by EMPANEL_REPACK=ggml).
// 0 on success, *by_own set where ours wrote the slot
int32_t empanel_backend_slot_repack(void * pool_tensor, int32_t slot, const void * data, size_t size,
                                    atomic_int * own, int * by_own);
