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
//   - from then on a miss on that expert is one SET_TENSOR_HASH: no read here, a request of
//     about 330 bytes (the slot's tensor description and the hash) instead of the expert; the
//     host reads it from its own drive, and uses it only if its size is the slot's.
// A host without a cache refuses a hash it was sent: its tensors then send bytes as ggml does.
// With moe_verify the bytes must be read and checked here, so nothing goes by hash.

#include "rpc.h"
#include "util.h"

#include "ggml-backend.h"
#include "ggml-rpc.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RPC_TIMEOUT_MS 10000 // connect and handshake, each; EMPANEL_RPC_TIMEOUT (seconds) overrides

static int timeout_ms(void) {
    const char * text = getenv("EMPANEL_RPC_TIMEOUT");
    const double s = text != NULL ? atof(text) : 0.0;
    return s > 0.0 ? (int) (s * 1000.0) : RPC_TIMEOUT_MS;
}

// patch 0008's functions in ggml-rpc, found by name (ggml may load its backends dynamically)
typedef uint64_t (*rpc_hash_fn)      (const void * data, size_t size);
typedef int      (*rpc_set_many_by_hash_fn)(struct ggml_tensor ** t, const int32_t * slots, const uint64_t * hash, int n,
                                            uint8_t * ok);
typedef _Bool    (*rpc_set_cached_fn)(struct ggml_tensor * t, const void * data, size_t offset, size_t size);
typedef void     (*rpc_wire_bytes_fn)(uint64_t * sent, uint64_t * received, uint64_t * round_trips);
typedef int      (*rpc_round_trips_by_cmd_fn)(uint64_t * out, int n);
typedef void     (*rpc_hello_sizes_fn)(size_t * request, size_t * response);
typedef int      (*rpc_endpoint_state_fn)(const char * endpoint); // 0 no connection, 1 open, 2 failed

struct rpc_fns {
    int                   found;
    ggml_backend_reg_t    reg;
    rpc_hash_fn           hash;
    rpc_set_many_by_hash_fn set_many_by_hash;
    rpc_set_cached_fn     set_cached;
    rpc_wire_bytes_fn     wire_bytes;
    rpc_hello_sizes_fn    hello_sizes;
    rpc_endpoint_state_fn endpoint_state;
    rpc_round_trips_by_cmd_fn round_trips_by_cmd;
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
    g_rpc.set_many_by_hash = (rpc_set_many_by_hash_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_set_slices_by_hash");
    g_rpc.set_cached  = (rpc_set_cached_fn)  ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_set_cached");
    g_rpc.wire_bytes  = (rpc_wire_bytes_fn)  ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_wire_bytes");
    g_rpc.hello_sizes = (rpc_hello_sizes_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_hello_sizes");
    g_rpc.endpoint_state = (rpc_endpoint_state_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_endpoint_state");
    g_rpc.round_trips_by_cmd = (rpc_round_trips_by_cmd_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_empanel_round_trips_by_cmd");
    g_rpc.found = g_rpc.hash != NULL && g_rpc.set_many_by_hash != NULL && g_rpc.set_cached != NULL && g_rpc.wire_bytes != NULL &&
                  g_rpc.hello_sizes != NULL && g_rpc.endpoint_state != NULL && g_rpc.round_trips_by_cmd != NULL;
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
    uint8_t ok = 0;
    return empanel_rpc_write_by_hash_many(&pool_tensor, &slot, &hash, 1, &ok) == 1 ? 1 : 0;
}

int32_t empanel_rpc_write_by_hash_many(void ** pool_tensors, const int32_t * slots, const uint64_t * hashes, int32_t n,
                                       uint8_t * ok) {
    return n > 0 ? rpc()->set_many_by_hash((struct ggml_tensor **) pool_tensors, slots, hashes, n, ok) : 0;
}

int empanel_rpc_write_cached(void * pool_tensor, int32_t slot, const void * data, uint64_t size) {
    struct ggml_tensor * t = pool_tensor;
    return rpc()->set_cached(t, data, (size_t) slot * t->nb[2], (size_t) size) ? 0 : -1;
}

void empanel_rpc_wire_bytes(uint64_t * sent, uint64_t * received, uint64_t * round_trips) {
    *sent        = 0;
    *received    = 0;
    *round_trips = 0;
    if (rpc()->found) {
        rpc()->wire_bytes(sent, received, round_trips);
    }
}

int32_t empanel_rpc_round_trips_by_command(uint64_t * out, int32_t n) {
    return rpc()->found ? rpc()->round_trips_by_cmd(out, n) : 0;
}

// ------------------------------------------------------------------------------------------------
// registering servers

// all of n bytes over a non-blocking socket, waiting at most wait_ms for each part (send: dir =
// POLLOUT); 0, or an errno
static int transfer(int fd, uint8_t * buf, size_t n, short dir, int wait_ms) {
    size_t done = 0;
    while (done < n) {
        struct pollfd p = { .fd = fd, .events = dir };
        const int ready = poll(&p, 1, wait_ms);
        if (ready == 0) {
            return ETIMEDOUT;
        }
        if (ready < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno;
        }
        const ssize_t k = dir == POLLOUT ? send(fd, buf + done, n - done, MSG_NOSIGNAL) : recv(fd, buf + done, n - done, 0);
        if (k == 0) {
            return ECONNRESET; // the server closed the connection
        }
        if (k < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) {
                continue;
            }
            return errno;
        }
        done += (size_t) k;
    }
    return 0;
}

// connect within wait_ms; the socket, or -1 with *why set
static int connect_to(const struct addrinfo * a, int wait_ms, int * why) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
        *why = errno;
        return -1;
    }
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        return fd;
    }
    if (errno == EINPROGRESS) {
        struct pollfd p = { .fd = fd, .events = POLLOUT };
        int soerr = 0;
        socklen_t len = sizeof(soerr);
        const int n = poll(&p, 1, wait_ms);
        if (n == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 && soerr == 0) {
            return fd;
        }
        *why = n == 0 ? ETIMEDOUT : (soerr != 0 ? soerr : errno);
    } else {
        *why = errno;
    }
    close(fd);
    return -1;
}

// ggml-rpc aborts the process when it cannot connect or the handshake fails, and waits forever
// for a server that is serving another client (one at a time): connect and shake hands here
// first, waiting at most wait_ms for each step, and say what is wrong instead
static int probe(const char * host, const char * port, int wait_ms, char * err, size_t err_size) {
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo * addrs = NULL;
    const int rc = getaddrinfo(host, port, &hints, &addrs);
    if (rc != 0) {
        empanel_util_format_err(err, err_size, "RPC server %s:%s: cannot resolve %s: %s", host, port, host, gai_strerror(rc));
        return -1;
    }
    int why = ECONNREFUSED;
    int fd  = -1;
    for (struct addrinfo * a = addrs; a != NULL && fd < 0; a = a->ai_next) {
        fd = connect_to(a, wait_ms, &why);
    }
    freeaddrinfo(addrs);
    if (fd < 0) {
        empanel_util_format_err(err, err_size, "RPC server %s:%s: cannot connect: %s (is ggml-rpc-server running there? "
                                "empanel-gguf rpc-server -H HOST -p PORT starts one)", host, port, strerror(why));
        return -1;
    }
    // HELLO: | cmd 14 (1 byte) | request size (8 bytes) | request | -> | response size (8 bytes) | response |
    size_t req_size = 0, rsp_size = 0;
    rpc()->hello_sizes(&req_size, &rsp_size);
    uint8_t request[1 + 8 + 256] = { 14 };
    uint8_t response[8 + 256];
    const uint64_t n_req = req_size;
    memcpy(request + 1, &n_req, sizeof(n_req));
    int status = req_size <= 256 && rsp_size <= 256 && rsp_size >= 1 ? 0 : EPROTO;
    if (status == 0) {
        status = transfer(fd, request, 1 + 8 + req_size, POLLOUT, wait_ms);
    }
    if (status == 0) {
        status = transfer(fd, response, 8 + rsp_size, POLLIN, wait_ms);
    }
    close(fd);
    uint64_t got = 0;
    memcpy(&got, response, sizeof(got));
    if (status == ETIMEDOUT) {
        empanel_util_format_err(err, err_size, "RPC server %s:%s: no answer to the handshake in %.1f s: it serves one "
                                "client at a time (another client, or the same server listed twice?); "
                                "EMPANEL_RPC_TIMEOUT=SECONDS waits longer", host, port, wait_ms / 1000.0);
        return -1;
    }
    if (status != 0 || got != rsp_size) {
        empanel_util_format_err(err, err_size, "RPC server %s:%s: the handshake failed (%s): not a ggml-rpc-server of "
                                "this protocol version?", host, port, status != 0 ? strerror(status) : "unexpected answer");
        return -1;
    }
    if (response[8] != RPC_PROTO_MAJOR_VERSION) {
        empanel_util_format_err(err, err_size, "RPC server %s:%s speaks RPC protocol %d, this build %d: run the same "
                                "llama.cpp version on both", host, port, response[8], RPC_PROTO_MAJOR_VERSION);
        return -1;
    }
    return 0;
}

typedef ggml_backend_reg_t (*rpc_add_server_fn)(const char * endpoint);

static pthread_mutex_t g_added_lock = PTHREAD_MUTEX_INITIALIZER;
static char **         g_added      = NULL; // endpoints registered so far (ggml_backend_register once each)
static int32_t         g_added_n    = 0;

// probe an endpoint "HOST:PORT" (a copy is cut at its last colon)
static int probe_endpoint(const char * endpoint, int wait_ms, char * err, size_t err_size) {
    char copy[512];
    snprintf(copy, sizeof(copy), "%s", endpoint);
    char * colon = strrchr(copy, ':');
    if (colon == NULL) {
        empanel_util_format_err(err, err_size, "RPC server '%s': expected HOST:PORT", endpoint);
        return -1;
    }
    *colon = '\0';
    return probe(copy, colon + 1, wait_ms, err, err_size);
}

// llama.cpp offers the devices of every registered server to every load of the process, and
// ggml-rpc aborts a process that cannot connect to one: each is usable (its connection open and
// sound, or none open and the server answering), else an error that names it. Called locked.
static int check_registered(char * err, size_t err_size) {
    for (int32_t i = 0; i < g_added_n; i++) {
        const int state = rpc()->endpoint_state(g_added[i]);
        if (state == 2) {
            empanel_util_format_err(err, err_size, "RPC server %s: its connection was lost during an earlier run, and "
                                    "what used it (a Llama) is still open: it loads anew by itself once the host answers, "
                                    "or close it and load again", g_added[i]);
            return -1;
        }
        if (state == 0 && probe_endpoint(g_added[i], timeout_ms(), err, err_size) != 0) {
            const size_t n = err != NULL ? strlen(err) : 0;
            if (err != NULL && n + 1 < err_size) {
                snprintf(err + n, err_size - n, " (registered by an earlier load of this process: llama.cpp offers "
                         "its devices to every load; start it again there, or run in a new process)");
            }
            return -1;
        }
    }
    return 0;
}

int32_t empanel_rpc_check_servers(char * err, size_t err_size) {
    if (err != NULL && err_size > 0) {
        err[0] = '\0';
    }
    if (rpc()->reg == NULL || !rpc()->found) {
        return 0;
    }
    pthread_mutex_lock(&g_added_lock);
    const int status = check_registered(err, err_size);
    pthread_mutex_unlock(&g_added_lock);
    return status;
}

int32_t empanel_rpc_lost(char * endpoints, size_t size) {
    int32_t n = 0;
    size_t  used = 0;
    if (endpoints != NULL && size > 0) {
        endpoints[0] = '\0';
    }
    if (rpc()->reg == NULL || !rpc()->found) {
        return 0;
    }
    pthread_mutex_lock(&g_added_lock);
    for (int32_t i = 0; i < g_added_n; i++) {
        if (rpc()->endpoint_state(g_added[i]) != 2) {
            continue;
        }
        if (endpoints != NULL && used < size) {
            used += (size_t) snprintf(endpoints + used, size - used, "%s%s", n > 0 ? "," : "", g_added[i]);
        }
        n++;
    }
    pthread_mutex_unlock(&g_added_lock);
    return n;
}

// A lost host taken back: a restarted ggml-rpc-server holds nothing of the old connection, so the
// caller (llama-server's hook, patch 0014; Llama in Python) loads the model anew once every host
// it lost answers a handshake again. Asked before each request while a host is lost, so each
// endpoint is probed once a second at most (each probe bounded by RPC_BACK_WAIT_MS), and what it
// answered counts for that second: a second model asking within it gets the same answer, not a 0
// for having asked too soon.
#define RPC_BACK_WAIT_MS     1000
#define RPC_BACK_INTERVAL_NS 1000000000ull
#define RPC_BACK_MAX         64 // endpoints remembered (the least recently probed makes room)

struct rpc_back {
    char     endpoint[256];
    uint64_t probed_ns; // when it was last probed (0: never)
    int      up;        // what that probe found
};

static pthread_mutex_t      g_back_lock = PTHREAD_MUTEX_INITIALIZER;
static struct rpc_back      g_back[RPC_BACK_MAX];
static atomic_uint_fast64_t g_back_n = 0; // answers that every host was back (a reload each)

// whether endpoint answers a handshake: probed now, or as probed within the last second
static int endpoint_back(const char * endpoint) {
    pthread_mutex_lock(&g_back_lock);
    const uint64_t now = empanel_util_now_ns();
    struct rpc_back * entry = &g_back[0];
    for (int i = 0; i < RPC_BACK_MAX; i++) {
        if (strcmp(g_back[i].endpoint, endpoint) == 0) {
            entry = &g_back[i];
            break;
        }
        entry = g_back[i].probed_ns < entry->probed_ns ? &g_back[i] : entry;
    }
    if (strcmp(entry->endpoint, endpoint) == 0 && entry->probed_ns != 0 && now - entry->probed_ns < RPC_BACK_INTERVAL_NS) {
        const int up = entry->up;
        pthread_mutex_unlock(&g_back_lock);
        return up;
    }
    snprintf(entry->endpoint, sizeof(entry->endpoint), "%s", endpoint);
    entry->probed_ns = now;
    entry->up        = 0;
    pthread_mutex_unlock(&g_back_lock);
    char err[512];
    const int up = probe_endpoint(endpoint, RPC_BACK_WAIT_MS, err, sizeof(err)) == 0;
    pthread_mutex_lock(&g_back_lock);
    if (strcmp(entry->endpoint, endpoint) == 0) {
        entry->up = up;
    }
    pthread_mutex_unlock(&g_back_lock);
    return up;
}

int32_t empanel_rpc_hosts_back(const char * endpoints) {
    if (endpoints == NULL || *endpoints == '\0' || rpc()->reg == NULL || !rpc()->found) {
        return 0;
    }
    char list[4096];
    snprintf(list, sizeof(list), "%s", endpoints);
    char * save = NULL;
    for (char * endpoint = strtok_r(list, ",", &save); endpoint != NULL; endpoint = strtok_r(NULL, ",", &save)) {
        if (!endpoint_back(endpoint)) {
            return 0;
        }
    }
    atomic_fetch_add(&g_back_n, 1);
    return 1;
}

uint64_t empanel_rpc_hosts_back_count(void) {
    return (uint64_t) atomic_load(&g_back_n);
}

// the endpoints of list "HOST:PORT,..." (cut in place) not registered yet, each probed, into
// todo [n_todo] (once each); *n_endpoints: endpoints given. 0, or -1 with the reason in err.
// Under g_added_lock
static int probe_list(char * list, char ** todo, int * n_todo, int * n_endpoints, char * err, size_t err_size) {
    int status = 0;
    char * save = NULL;
    for (char * endpoint = strtok_r(list, ",", &save); endpoint != NULL && status == 0;
         endpoint = strtok_r(NULL, ",", &save)) {
        while (*endpoint == ' ') {
            endpoint++;
        }
        (*n_endpoints)++;
        char * colon = strrchr(endpoint, ':');
        if (colon == NULL || colon == endpoint || colon[1] == '\0' || strspn(colon + 1, "0123456789") != strlen(colon + 1)) {
            empanel_util_format_err(err, err_size, "RPC server '%s': expected HOST:PORT", endpoint);
            status = -1;
            break;
        }
        int seen = 0;
        for (int32_t i = 0; i < g_added_n; i++) {
            seen |= strcmp(g_added[i], endpoint) == 0;
        }
        for (int i = 0; i < *n_todo; i++) {
            seen |= strcmp(todo[i], endpoint) == 0;
        }
        if (seen) {
            continue;
        }
        *colon = '\0';
        status = probe(endpoint, colon + 1, timeout_ms(), err, err_size);
        *colon = ':';
        todo[(*n_todo)++] = endpoint;
    }
    return status;
}

// register the probed endpoints todo [n_todo] with ggml (add: ggml_backend_rpc_add_server) and
// list them in g_added; *n_devices: the devices they offer. Everything that can fail comes first
// (each endpoint's backend, the list's memory), so a failure registers none of them: 0, or -1 with
// the reason in err. Under g_added_lock
static int register_list(rpc_add_server_fn add, char ** todo, int n_todo, int32_t * n_devices, char * err,
                         size_t err_size) {
    ggml_backend_reg_t * regs  = calloc((size_t) n_todo + 1, sizeof(ggml_backend_reg_t));
    char **              names = calloc((size_t) n_todo + 1, sizeof(char *));
    char **              grown = realloc(g_added, sizeof(char *) * (size_t) (g_added_n + n_todo + 1));
    int status = regs != NULL && names != NULL && grown != NULL ? 0 : -1;
    g_added = grown != NULL ? grown : g_added;
    if (status != 0) {
        empanel_util_format_err(err, err_size, "empanel: out of memory");
    }
    for (int i = 0; i < n_todo && status == 0; i++) {
        if ((regs[i] = add(todo[i])) == NULL) {
            empanel_util_format_err(err, err_size, "RPC server %s offers no devices", todo[i]);
            status = -1;
        } else if ((names[i] = strdup(todo[i])) == NULL) {
            empanel_util_format_err(err, err_size, "empanel: out of memory");
            status = -1;
        }
    }
    for (int i = 0; i < n_todo && status == 0; i++) {
        ggml_backend_register(regs[i]);
        *n_devices += (int32_t) ggml_backend_reg_dev_count(regs[i]);
        g_added[g_added_n++] = names[i];
        names[i] = NULL;
    }
    for (int i = 0; names != NULL && i < n_todo; i++) {
        free(names[i]);
    }
    free(names);
    free(regs);
    return status;
}

int32_t empanel_rpc_add_servers(const char * servers, char * err, size_t err_size) {
    if (err != NULL && err_size > 0) {
        err[0] = '\0';
    }
    if (rpc()->reg == NULL) {
        empanel_util_format_err(err, err_size, "RPC servers given, but this build has no RPC backend "
                                "(build with CMAKE_ARGS=\"-DGGML_RPC=ON\")");
        return -1;
    }
    rpc_add_server_fn add = (rpc_add_server_fn) ggml_backend_reg_get_proc_address(rpc()->reg, "ggml_backend_rpc_add_server");
    if (add == NULL || !rpc()->found) {
        empanel_util_format_err(err, err_size, "ggml's RPC backend lacks empanel-gguf's patch 0008 (another ggml build "
                                "on the library path?)");
        return -1;
    }
    char * list = strdup(servers != NULL ? servers : "");
    char ** todo = calloc(strlen(servers != NULL ? servers : "") / 2 + 1, sizeof(char *)); // new endpoints
    if (list == NULL || todo == NULL) {
        free(list);
        free(todo);
        empanel_util_format_err(err, err_size, "empanel: out of memory");
        return -1;
    }
    int32_t n_devices   = 0;
    int     status      = 0;
    int     n_endpoints = 0;
    int     n_todo      = 0;
    pthread_mutex_lock(&g_added_lock);
    // every server is checked before any is registered: a failure leaves none of this list behind
    status = check_registered(err, err_size);
    if (status == 0) {
        status = probe_list(list, todo, &n_todo, &n_endpoints, err, err_size);
    }
    if (status == 0) {
        status = register_list(add, todo, n_todo, &n_devices, err, err_size);
    }
    pthread_mutex_unlock(&g_added_lock);
    free(todo);
    free(list);
    if (status == 0 && n_endpoints == 0) {
        empanel_util_format_err(err, err_size, "no RPC servers given (expected HOST:PORT,...)");
        status = -1;
    }
    return status == 0 ? n_devices : -1;
}
