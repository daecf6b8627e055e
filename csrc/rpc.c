// Pools on the hosts of ggml's RPC backend (ggml-rpc-server, llama.cpp's --rpc): registering the
// servers, and writing experts into remote slots by hash.
//
// A layer that llama.cpp places on an RPC device has its pools there (device memory of that host),
// and a miss is a SET_TENSOR of the expert's bytes over the wire. An rpc-server started with -c
// keeps what it is sent with the cache flag in files named by the bytes' FNV-1a hash, and writes
// them into a tensor when asked by hash (SET_TENSOR_HASH). ggml-rpc itself only does that for
// writes over 10 MiB; patch 0008 exports the three steps, so every expert goes by hash once its
// host has seen it:
//   - the first time, the expert is read here, hashed by the reader thread that lands it, offered
//     by hash (its host may hold it from an earlier run), else sent with the cache flag;
//   - from then on a miss on that expert is one SET_TENSOR_HASH: no read here, 8 bytes of hash
//     on the wire instead of the expert; the host reads it from its own drive.
// A host without a cache refuses a hash it was sent: its tensors then send bytes as ggml does.

#include "empanel.h"
#include "empanel-impl.h"

#include "ggml-backend.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RPC_CONNECT_TIMEOUT_MS 5000

// patch 0008's functions in ggml-rpc, found by name (ggml may load its backends dynamically)
typedef uint64_t (*rpc_hash_fn)      (const void * data, size_t size);
typedef _Bool    (*rpc_set_by_hash_fn)(struct ggml_tensor * t, size_t offset, uint64_t hash);
typedef _Bool    (*rpc_set_cached_fn)(struct ggml_tensor * t, const void * data, size_t offset, size_t size);
typedef void     (*rpc_wire_bytes_fn)(uint64_t * sent, uint64_t * received);

struct rpc_fns {
    int                found;
    ggml_backend_reg_t reg;
    rpc_hash_fn        hash;
    rpc_set_by_hash_fn set_by_hash;
    rpc_set_cached_fn  set_cached;
    rpc_wire_bytes_fn  wire_bytes;
};

static struct rpc_fns  g_rpc;
static pthread_once_t  g_rpc_once = PTHREAD_ONCE_INIT;

static void rpc_find(void) {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    if (reg == NULL) {
        return;
    }
    g_rpc.reg         = reg;
    g_rpc.hash        = (rpc_hash_fn)        ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_hash");
    g_rpc.set_by_hash = (rpc_set_by_hash_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_set_by_hash");
    g_rpc.set_cached  = (rpc_set_cached_fn)  ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_set_cached");
    g_rpc.wire_bytes  = (rpc_wire_bytes_fn)  ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_wire_bytes");
    g_rpc.found = g_rpc.hash != NULL && g_rpc.set_by_hash != NULL && g_rpc.set_cached != NULL && g_rpc.wire_bytes != NULL;
}

static const struct rpc_fns * rpc(void) {
    pthread_once(&g_rpc_once, rpc_find);
    return &g_rpc;
}

int32_t empanel_rpc_supported(void) {
    return rpc()->reg != NULL;
}

int empanel_rpc_tensor(void * pool_tensor) {
    struct ggml_tensor * t = pool_tensor;
    if (t == NULL || t->buffer == NULL || !rpc()->found) {
        return 0;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    return dev != NULL && ggml_backend_dev_backend_reg(dev) == rpc()->reg;
}

uint64_t empanel_rpc_hash(const void * data, uint64_t size) {
    const uint64_t h = rpc()->hash(data, (size_t) size);
    return h + (h == 0); // 0 means "not known"
}

int empanel_rpc_write_by_hash(void * pool_tensor, int32_t slot, uint64_t hash) {
    struct ggml_tensor * t = pool_tensor;
    return rpc()->set_by_hash(t, (size_t) slot * t->nb[2], hash) ? 1 : 0;
}

int empanel_rpc_write_cached(void * pool_tensor, int32_t slot, const void * data, uint64_t size) {
    struct ggml_tensor * t = pool_tensor;
    return rpc()->set_cached(t, data, (size_t) slot * t->nb[2], (size_t) size) ? 0 : -1;
}

void empanel_rpc_wire_bytes(uint64_t * sent, uint64_t * received) {
    *sent     = 0;
    *received = 0;
    if (rpc()->found) {
        rpc()->wire_bytes(sent, received);
    }
}

// ------------------------------------------------------------------------------------------------
// registering servers

// ggml-rpc aborts the process when it cannot connect: try first, and say so instead
static int probe(const char * host, const char * port, char * err, size_t err_size) {
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo * addrs = NULL;
    const int rc = getaddrinfo(host, port, &hints, &addrs);
    if (rc != 0) {
        empanel_format_err(err, err_size, "RPC server %s:%s: cannot resolve %s: %s", host, port, host, gai_strerror(rc));
        return -1;
    }
    int why = ECONNREFUSED;
    for (struct addrinfo * a = addrs; a != NULL; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            why = errno;
            continue;
        }
        int ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        if (!ok && errno == EINPROGRESS) {
            struct pollfd p = { .fd = fd, .events = POLLOUT };
            int soerr = 0;
            socklen_t len = sizeof(soerr);
            const int n = poll(&p, 1, RPC_CONNECT_TIMEOUT_MS);
            if (n == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 && soerr == 0) {
                ok = 1;
            } else {
                why = n == 0 ? ETIMEDOUT : (soerr != 0 ? soerr : errno);
            }
        } else if (!ok) {
            why = errno;
        }
        close(fd);
        if (ok) {
            freeaddrinfo(addrs);
            return 0;
        }
    }
    freeaddrinfo(addrs);
    empanel_format_err(err, err_size, "RPC server %s:%s: cannot connect: %s (is ggml-rpc-server running there? "
                       "empanel-gguf rpc-server -H HOST -p PORT starts one)", host, port, strerror(why));
    return -1;
}

typedef ggml_backend_reg_t (*rpc_add_server_fn)(const char * endpoint);

int32_t empanel_rpc_add_servers(const char * servers, char * err, size_t err_size) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static char ** added   = NULL;  // endpoints registered so far (ggml_backend_register once each)
    static int32_t n_added = 0;

    if (err != NULL && err_size > 0) {
        err[0] = '\0';
    }
    if (rpc()->reg == NULL) {
        empanel_format_err(err, err_size, "RPC servers given, but this build has no RPC backend "
                           "(build with CMAKE_ARGS=\"-DGGML_RPC=ON\")");
        return -1;
    }
    rpc_add_server_fn add = (rpc_add_server_fn) ggml_backend_reg_get_proc_address(rpc()->reg, "ggml_backend_rpc_add_server");
    if (add == NULL) {
        empanel_format_err(err, err_size, "ggml's RPC backend has no ggml_backend_rpc_add_server");
        return -1;
    }
    char * list = strdup(servers != NULL ? servers : "");
    if (list == NULL) {
        empanel_format_err(err, err_size, "empanel: out of memory");
        return -1;
    }
    int32_t n_devices = 0;
    int     status    = 0;
    pthread_mutex_lock(&lock);
    char * save = NULL;
    int n_endpoints = 0;
    for (char * endpoint = strtok_r(list, ",", &save); endpoint != NULL; endpoint = strtok_r(NULL, ",", &save)) {
        while (*endpoint == ' ') {
            endpoint++;
        }
        n_endpoints++;
        char * colon = strrchr(endpoint, ':');
        if (colon == NULL || colon == endpoint || colon[1] == '\0' || strspn(colon + 1, "0123456789") != strlen(colon + 1)) {
            empanel_format_err(err, err_size, "RPC server '%s': expected HOST:PORT", endpoint);
            status = -1;
            break;
        }
        int seen = 0;
        for (int32_t i = 0; i < n_added; i++) {
            seen |= strcmp(added[i], endpoint) == 0;
        }
        if (seen) {
            continue;
        }
        *colon = '\0';
        const int reachable = probe(endpoint, colon + 1, err, err_size);
        *colon = ':';
        if (reachable != 0) {
            status = -1;
            break;
        }
        ggml_backend_reg_t reg = add(endpoint);
        if (reg == NULL) {
            empanel_format_err(err, err_size, "RPC server %s offers no devices", endpoint);
            status = -1;
            break;
        }
        ggml_backend_register(reg);
        n_devices += (int32_t) ggml_backend_reg_dev_count(reg);
        char ** grown = realloc(added, sizeof(char *) * (n_added + 1));
        if (grown == NULL || (grown[n_added] = strdup(endpoint)) == NULL) {
            added = grown != NULL ? grown : added;
            empanel_format_err(err, err_size, "empanel: out of memory");
            status = -1;
            break;
        }
        added = grown;
        n_added++;
    }
    pthread_mutex_unlock(&lock);
    free(list);
    if (status == 0 && n_endpoints == 0) {
        empanel_format_err(err, err_size, "no RPC servers given (expected HOST:PORT,...)");
        status = -1;
    }
    return status == 0 ? n_devices : -1;
}
