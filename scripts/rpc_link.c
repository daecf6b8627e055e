// A network link on loopback for the RPC bench (scripts/bench_rpc.py): this machine's kernel has
// no netem qdisc, so a TCP proxy delivers each direction's bytes DELAY_US microseconds after they
// arrived, at most RATE_MBIT megabits per second (0: unbounded), to TARGET_PORT on 127.0.0.1.
//
//   cc -O2 -pthread scripts/rpc_link.c -o rpc_link
//   rpc_link LISTEN_PORT TARGET_PORT DELAY_US RATE_MBIT MAX_SECONDS
//
// Per connection and direction, one thread reads (stamping each chunk with its arrival time) and
// one writes (sleeping until the chunk is due and the wire is free). At most QUEUE_BYTES wait per
// direction: a sender faster than the link is held back by TCP, as on a real one. The proxy exits
// after MAX_SECONDS, or with its parent. It prints its CPU seconds on stdout when it gets SIGTERM.

#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { CHUNK_BYTES = 64 * 1024, QUEUE_BYTES = 8 * 1024 * 1024 };

static uint64_t g_delay_ns;  // one way
static double   g_ns_per_byte; // 0: unbounded

struct chunk {
    struct chunk * next;
    uint64_t due_ns; // arrival + delay
    size_t   len;
    char     data[CHUNK_BYTES];
};

struct direction {
    int from, to;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    struct chunk * head, * tail;
    size_t queued; // bytes
    int    eof;
    int    closed; // the writer could not send: the reader stops too, even while it waits for room
};

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t) t.tv_sec * 1000000000ull + (uint64_t) t.tv_nsec;
}

static void sleep_until(uint64_t ns) {
    struct timespec t = { (time_t) (ns / 1000000000ull), (long) (ns % 1000000000ull) };
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
    }
}

static void * reader(void * arg) {
    struct direction * d = arg;
    for (;;) {
        struct chunk * c = malloc(sizeof(*c));
        ssize_t n = c != NULL ? recv(d->from, c->data, CHUNK_BYTES, 0) : -1;
        pthread_mutex_lock(&d->mu);
        if (n <= 0) {
            free(c);
            d->eof = 1;
            pthread_cond_broadcast(&d->cv);
            pthread_mutex_unlock(&d->mu);
            return NULL;
        }
        c->len = (size_t) n;
        c->due_ns = now_ns() + g_delay_ns;
        c->next = NULL;
        while (d->queued >= QUEUE_BYTES && !d->closed) {
            pthread_cond_wait(&d->cv, &d->mu);
        }
        if (d->closed) {
            free(c);
            pthread_mutex_unlock(&d->mu);
            return NULL;
        }
        if (d->tail != NULL) {
            d->tail->next = c;
        } else {
            d->head = c;
        }
        d->tail = c;
        d->queued += c->len;
        pthread_cond_broadcast(&d->cv);
        pthread_mutex_unlock(&d->mu);
    }
}

static void * writer(void * arg) {
    struct direction * d = arg;
    uint64_t wire_free = 0; // when the link has sent the previous chunk
    for (;;) {
        pthread_mutex_lock(&d->mu);
        while (d->head == NULL && !d->eof) {
            pthread_cond_wait(&d->cv, &d->mu);
        }
        struct chunk * c = d->head;
        if (c == NULL) { // the sender closed and everything was delivered
            pthread_mutex_unlock(&d->mu);
            shutdown(d->to, SHUT_WR);
            return NULL;
        }
        d->head = c->next;
        d->tail = d->head != NULL ? d->tail : NULL;
        d->queued -= c->len;
        pthread_cond_broadcast(&d->cv);
        pthread_mutex_unlock(&d->mu);

        uint64_t start = c->due_ns > wire_free ? c->due_ns : wire_free;
        if (g_ns_per_byte > 0) { // the last byte leaves len / rate after the first
            wire_free = start + (uint64_t) (g_ns_per_byte * (double) c->len);
            start = wire_free;
        }
        sleep_until(start);
        for (size_t off = 0; off < c->len;) {
            ssize_t n = send(d->to, c->data + off, c->len - off, MSG_NOSIGNAL);
            if (n <= 0) { // the receiver is gone: the queue is dropped and the reader woken to stop
                free(c);
                pthread_mutex_lock(&d->mu);
                d->closed = 1;
                while (d->head != NULL) {
                    struct chunk * next = d->head->next;
                    free(d->head);
                    d->head = next;
                }
                d->tail   = NULL;
                d->queued = 0;
                pthread_cond_broadcast(&d->cv);
                pthread_mutex_unlock(&d->mu);
                shutdown(d->from, SHUT_RD);
                return NULL;
            }
            off += (size_t) n;
        }
        free(c);
    }
}

struct connection {
    struct direction up, down; // client -> server, server -> client
};

static void * serve(void * arg) {
    struct connection * c = arg;
    pthread_t t[4];
    pthread_create(&t[0], NULL, reader, &c->up);
    pthread_create(&t[1], NULL, writer, &c->up);
    pthread_create(&t[2], NULL, reader, &c->down);
    pthread_create(&t[3], NULL, writer, &c->down);
    for (int i = 0; i < 4; i++) {
        pthread_join(t[i], NULL);
    }
    close(c->up.from);
    close(c->down.from);
    free(c);
    return NULL;
}

static void init_direction(struct direction * d, int from, int to) {
    memset(d, 0, sizeof(*d));
    d->from = from;
    d->to = to;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
}

static void on_term(int sig) {
    (void) sig;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    char line[64];
    int n = snprintf(line, sizeof(line), "cpu_s %.3f\n", ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 +
                                                         ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6);
    if (write(STDOUT_FILENO, line, (size_t) n) < 0) {
        _exit(1);
    }
    _exit(0);
}

static void on_alarm(int sig) {
    (void) sig;
    _exit(3); // MAX_SECONDS passed: a bench that forgot us must not leave us running
}

static int connect_target(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t) port) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *) &a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: rpc_link LISTEN_PORT TARGET_PORT DELAY_US RATE_MBIT MAX_SECONDS\n");
        return 2;
    }
    const int listen_port = atoi(argv[1]), target_port = atoi(argv[2]);
    g_delay_ns = (uint64_t) (atof(argv[3]) * 1000.0);
    const double rate_mbit = atof(argv[4]);
    g_ns_per_byte = rate_mbit > 0 ? 8000.0 / rate_mbit : 0.0;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    prctl(PR_SET_TIMERSLACK, 1UL); // wake at the due time, not 50 us later
    signal(SIGTERM, on_term);
    signal(SIGALRM, on_alarm);
    alarm((unsigned) atoi(argv[5]));

    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t) listen_port) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *) &a, sizeof(a)) != 0 || listen(ls, 16) != 0) {
        perror("rpc_link: listen");
        return 1;
    }
    printf("listening\n");
    fflush(stdout);
    for (;;) {
        int client = accept(ls, NULL, NULL);
        if (client < 0) {
            continue;
        }
        int server = connect_target(target_port);
        if (server < 0) {
            close(client);
            continue;
        }
        setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        struct connection * c = malloc(sizeof(*c));
        init_direction(&c->up, client, server);
        init_direction(&c->down, server, client);
        pthread_t t;
        pthread_create(&t, NULL, serve, c);
        pthread_detach(t);
    }
}
