// Pools on RPC hosts (ggml-rpc with patch 0008): an expert's bytes go to the host by hash first.
// The host's cache (rpc-server -c) may hold them from an earlier run or an earlier send; only
// what it does not hold crosses the wire, and then with the cache flag so that it keeps them.
// The wire itself (connections, hashes, commands) is rpc.c's.

#include "remote.h"
#include "backend.h"
#include "layer.h"
#include "rpc.h"
#include "util.h"

#include <stdlib.h>

struct empanel_remote * empanel_remote_init(int32_t n_expert) {
    struct empanel_remote * remote = calloc(1, sizeof(*remote));
    if (remote == NULL) {
        return NULL;
    }
    remote->cache = 1;
    remote->hash  = calloc((size_t) n_expert, sizeof(uint64_t)); // [n_expert]
    remote->sent  = calloc((size_t) n_expert, sizeof(uint8_t));  // [n_expert]
    if (remote->hash == NULL || remote->sent == NULL) {
        empanel_remote_free(remote);
        return NULL;
    }
    return remote;
}

void empanel_remote_free(struct empanel_remote * remote) {
    if (remote == NULL) {
        return;
    }
    free(remote->hash);
    free(remote->sent);
    free(remote);
}

// writes by hash asked of the hosts at once, at most BY_HASH_MAX
#define BY_HASH_MAX 128
struct by_hash {
    int32_t  n;
    void *   pools[BY_HASH_MAX];
    int32_t  slots[BY_HASH_MAX];
    uint64_t hashes[BY_HASH_MAX];
    struct empanel_tensor * tensor[BY_HASH_MAX];
    int32_t  expert[BY_HASH_MAX];
    size_t   at[BY_HASH_MAX];     // index into written
};

// ok[k] from the hosts: 1 written, 0 not held, 2 not answered (the connection failed: its zeros
// are no answer, patch 0008)
static void by_hash_send(struct empanel_layer * layer, struct by_hash * q, uint8_t * written) {
    uint8_t ok[BY_HASH_MAX];
    empanel_rpc_write_by_hash_many(q->pools, q->slots, q->hashes, q->n, ok);
    for (int32_t k = 0; k < q->n; k++) {
        struct empanel_tensor * t = q->tensor[k];
        written[q->at[k]] = ok[k] == 1;
        layer->stats.remote_by_hash += ok[k] == 1;
        if (ok[k] == 0 && t->remote->sent[q->expert[k]]) {
            t->remote->cache = 0; // sent with the cache flag, yet not held: the host keeps no cache
        }
    }
    q->n = 0;
}

// expert -> slot of tensor t by its known hash, asked with the others of q (written[at] answers)
static void by_hash_add(struct empanel_layer * layer, struct by_hash * q, uint8_t * written, struct empanel_tensor * t,
                        int32_t expert, int32_t slot, size_t at) {
    q->pools[q->n]  = t->pool;
    q->slots[q->n]  = slot;
    q->hashes[q->n] = t->remote->hash[expert];
    q->tensor[q->n] = t;
    q->expert[q->n] = expert;
    q->at[q->n++]   = at;
    if (q->n == BY_HASH_MAX) {
        by_hash_send(layer, q, written);
    }
}

// a landed job's bytes, staging -> its slot on the RPC host, with the cache flag where the host
// keeps what it is sent; sent bytes count in copy_bytes. With moe_verify the very bytes checked
// here are sent. 0, or -1 with the error recorded
static int send_bytes(struct empanel_pool * pool, struct empanel_layer * layer, const struct empanel_read_job * job) {
    struct empanel_tensor * t = job->tensor;
    const int sent = t->remote->cache ? empanel_rpc_write_cached(t->pool, job->slot, job->dst, t->expert_size)
                                     : empanel_backend_slot_write(t->pool, job->slot, job->dst, t->expert_size);
    if (sent == 0) {
        t->remote->sent[job->expert] |= t->remote->cache;
        layer->stats.copy_bytes += t->expert_size;
        return 0;
    }
    empanel_util_set_error(pool, "%s: writing expert %d into slot %d on its RPC host failed", t->name, job->expert, job->slot);
    return -1;
}

static int remote_landed(const struct empanel_read_job * job) {
    return job->convert == 2 && job->landed && job->tensor->remote != NULL;
}

int empanel_remote_write_jobs(struct empanel_pool * pool, struct empanel_layer * layer,
                              const struct empanel_read_job * jobs, int32_t n_jobs) {
    int32_t n_remote = 0;
    for (int32_t j = 0; j < n_jobs; j++) {
        n_remote += remote_landed(&jobs[j]);
    }
    if (n_remote == 0) {
        return 0; // (host pools: nothing allocated on their path)
    }
    uint8_t * written = calloc((size_t) (n_jobs > 0 ? n_jobs : 1), 1); // [n_jobs]
    if (written == NULL) {
        empanel_util_set_error(pool, "writing a batch to its RPC host: out of memory");
        return -1;
    }
    struct by_hash q;
    q.n = 0;
    for (int32_t j = 0; j < n_jobs; j++) {
        const struct empanel_read_job * job = &jobs[j];
        if (remote_landed(job) && job->remote_hash != 0) { // hashed as it landed (not with moe_verify)
            job->tensor->remote->hash[job->expert] = job->remote_hash;
            by_hash_add(layer, &q, written, job->tensor, job->expert, job->slot, (size_t) j);
        }
    }
    by_hash_send(layer, &q, written);
    int rc = 0;
    for (int32_t j = 0; j < n_jobs && rc == 0; j++) {
        if (remote_landed(&jobs[j]) && !written[j]) {
            rc = send_bytes(pool, layer, &jobs[j]);
        }
    }
    free(written);
    return rc;
}

// misses on an RPC host's pools whose bytes the host may hold (sent before, or hashed at an
// earlier read): their writes by hash go back to back, one round trip per BY_HASH_MAX of them
void empanel_remote_by_hash(struct empanel_layer * layer, int32_t t0, int32_t t1, const int32_t * experts,
                            const int32_t * slots, int32_t n, uint8_t * written) {
    struct by_hash q;
    q.n = 0;
    for (int32_t i = t0; i < t1; i++) {
        const struct empanel_tensor * t = &layer->tensors[i];
        for (int32_t m = 0; m < n; m++) {
            const size_t j = (size_t) (i - t0) * (size_t) n + (size_t) m;
            written[j] = 0;
            if (t->remote == NULL || !t->remote->cache || t->remote->hash[experts[m]] == 0) { // (never known with moe_verify)
                continue;
            }
            by_hash_add(layer, &q, written, &layer->tensors[i], experts[m], slots[m], j);
        }
    }
    by_hash_send(layer, &q, written);
}
