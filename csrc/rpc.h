#pragma once

// rpc.c: ggml's RPC backend (patch 0008): servers registered and checked (empanel_rpc_* in
// empanel.h), and the wire commands a pool on an RPC host sends (by hash, cached); remote.c
// decides which

#include "empanel.h"

#include <stdint.h>

// 1: the pool tensor lives in an RPC server's buffer
int      empanel_rpc_tensor(void * pool_tensor);
// the hash an rpc-server's cache names the bytes by (never 0)
uint64_t empanel_rpc_hash(const void * data, uint64_t size);
// slot `slot` from the host's cache: 1 it had the bytes of `hash` and wrote them, 0 it did not
int      empanel_rpc_write_by_hash(void * pool_tensor, int32_t slot, uint64_t hash);
// n such writes (pool_tensors[j], slots[j], hashes[j]) in one round trip per server: their
// requests go back to back, the answers are read after; ok[j] 1 written, 0 not held, 2 not
// answered (the host's connection failed). Returns how many wrote
int32_t  empanel_rpc_write_by_hash_many(void ** pool_tensors, const int32_t * slots, const uint64_t * hashes, int32_t n,
                                        uint8_t * ok);
// the bytes into slot `slot`, kept in the host's cache if it has one; 0 or -1
int      empanel_rpc_write_cached(void * pool_tensor, int32_t slot, const void * data, uint64_t size);
