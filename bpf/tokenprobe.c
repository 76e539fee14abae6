// tokenprobe kernel side: per-connection I/O of target HTTP servers.
//
// Only syscall tracepoints, sched tracepoints and libssl uprobes: many kernels (this one included) have no kprobes, and
// tracepoint layouts are read from tracefs at load time, so the program does
// not depend on the kernel headers matching the running kernel exactly.
//
// A connection is tracked from accept (or connect, for outbound tracking)
// when its local port is a target port or its process is a target process.
// Only tracked connections emit events; everything else returns after one
// hash lookup. The agent (agent/capture/kernel/loader.py) sets the compile-time constants.

#include <uapi/linux/ptrace.h>
#include <linux/sched.h>
#include <linux/socket.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/uio.h>

// Calls up to HEAD_CAP bytes are captured whole: servers coalesce a stream's
// events into one large send or writev (20–40 KiB are common), and every byte
// of it is needed to count token events exactly.
#ifndef HEAD_CAP
#define HEAD_CAP 65536 // bytes captured from the start of each read/write (power of two)
#endif
#ifndef TAIL_CAP
#define TAIL_CAP 4096 // bytes captured from the end of a flat call larger than HEAD_CAP
#endif
#ifndef NR_CPUS_POSSIBLE
#define NR_CPUS_POSSIBLE 1024
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 4096
#endif
// Map sizes, set by the agent (probes.MapSizes); the agent reports each map's
// overflows (map_overflows below) as tokenprobe_agent_map_overflows_total.
#ifndef MAX_CONNS
#define MAX_CONNS 65536
#endif
#ifndef MAX_TGIDS
#define MAX_TGIDS 16384 // processes: targets, owners of tracked connections, listeners
#endif
#ifndef MAX_LISTENERS
#define MAX_LISTENERS 16384
#endif
#ifndef MAX_PENDING
#define MAX_PENDING 16384 // threads inside a traced call at once
#endif
#define MAX_UNSEEN_ENDS 16384 // connections that ended unseen, until the agent takes them
#define MAX_IOV 64 // iovecs copied per program (hyper and libuv gather three a chunk); more: tail calls
#define MAX_EXE_PATHS 8 // up to 4 executables, each as given and resolved
#define EXE_PATH_LEN 256

// Hides a value from the compiler so that the bounds check the verifier
// needs is applied to the very register used for the memory access.
#define OPAQUE(x) asm volatile("" : "+r"(x))

enum event_kind {
    EV_ACCEPT = 1,
    EV_CONNECT = 2,
    EV_DATA = 3,
    EV_CLOSE = 4,
    EV_TLS_DONE = 5,
    EV_EXEC = 6,
    EV_EXIT = 7,
};

enum direction { DIR_READ = 0, DIR_WRITE = 1 };
enum role { ROLE_SERVER = 0, ROLE_CLIENT = 1 };

// Which libssl function a thread is inside (uprobe entry → return).
enum ssl_fn { SSL_FN_READ = 1, SSL_FN_READ_EX, SSL_FN_WRITE, SSL_FN_WRITE_EX, SSL_FN_HANDSHAKE };

// Config array slots, written by the agent.
enum config_slot { CFG_TRACK_OUTBOUND = 0, CFG_EXE_PATHS = 1, CFG_SELF_TGID = 2, CFG_SLOTS = 3 };

struct conn_key {
    u32 tgid;
    u32 fd;
};

struct conn_info {
    u64 accept_ns;      // also the connection's generation: fds are reused
    // Per direction (DIR_READ, DIR_WRITE): bytes moved and data events
    // emitted so far, whether or not the ring buffer took them. Every event
    // carries them, so the agent knows exactly what it did not receive.
    u64 bytes[2];
    u32 events[2];
    u8 peer_addr[16];   // IPv6 or IPv4-mapped IPv6
    u16 local_port;     // 0 when unknown (no socket offsets, see socket_endpoints)
    u16 peer_port;
    u8 role;
    u8 tls;
    u8 plain;           // its first bytes were not a TLS handshake: no SSL object is looked for
    u8 pad;
};

// One record in the ring buffer; only the used part of data[] is sent.
struct event {
    u64 ts_ns;          // CLOCK_MONOTONIC
    u64 conn_ns;        // the connection's accept_ns
    u64 bytes[2];       // the connection's counters before this event
    u32 tgid;
    u32 fd;
    u32 events[2];
    u8 kind;
    u8 dir;
    u8 tls;
    u8 role;
    s32 ret;            // syscall/SSL return value: bytes, or -errno
    u32 total_len;      // bytes moved by the call
    u32 head_len;       // bytes of data[] from the call's start
    u32 tail_len;       // bytes of data[] (after head) from the call's end
    u16 local_port;
    u16 peer_port;
    u8 peer_addr[16];
    char comm[16];
    u8 data[2 * HEAD_CAP];
};

struct io_args {
    u64 enter_ns;
    const u8 *buf;            // contiguous buffer (read/write/recvfrom/sendto)
    const struct iovec *iov;  // vectored I/O (readv/writev/recvmsg/sendmsg)
    u32 iovcnt;
    u32 fd;
    u8 dir;
    u8 ciphertext;            // TLS: only the call's EOF or error is reported
};

struct accept_args {
    struct sockaddr *addr;
    u32 listen_fd;
};

struct sockaddr_args {
    struct sockaddr *addr;
    u32 fd;
};

struct ssl_args {
    u64 enter_ns;
    void *ssl;
    const u8 *buf;
    size_t *len_out;        // SSL_*_ex's size_t* result
    u8 fn;
};

struct exe_path {
    char path[EXE_PATH_LEN];
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
// One record under construction per CPU. A plain array indexed by CPU, not a
// per-CPU array: per-CPU map values are limited to 32 KiB.
BPF_ARRAY(scratch, struct event, NR_CPUS_POSSIBLE);
BPF_PERCPU_ARRAY(drops, u64, 1);
// Per map, entries it could not take: a failed insert into a full hash, or a
// live connection evicted from the conns LRU. Slots in probes.MAP_OVERFLOW_SLOTS.
enum map_slot {
    MAP_CONNS = 0, MAP_LISTENERS, MAP_IO_PENDING, MAP_SSL_PENDING, MAP_ACCEPT_PENDING,
    MAP_CONNECT_PENDING, MAP_BIND_PENDING, MAP_SLOTS
};
BPF_PERCPU_ARRAY(map_overflows, u64, MAP_SLOTS);
// Live entries of conns, which the LRU cannot report: [0] the program's inserts
// less its deletes, [1] the agent's (it alone writes that slot).
BPF_ARRAY(conns_fill, s64, 2);
BPF_ARRAY(config, u32, CFG_SLOTS);
BPF_ARRAY(exe_paths, struct exe_path, MAX_EXE_PATHS);

BPF_TABLE("lru_hash", struct conn_key, struct conn_info, conns, MAX_CONNS);
// Ends of connections the agent had no record of: a close whose record the
// ring buffer refused, or a close never traced (close_range, dup2 over the fd,
// close on exec), found when accept or connect reuses the fd. The agent takes
// an entry when it finds the connection gone (its fd reused, idle, or at its
// own stop) and counts from its counters what it lost of its last events.
struct unseen_end {
    u64 accept_ns;      // the connection's generation (conn_info.accept_ns)
    u64 close_ns;       // close()'s time; 0 when the close was never traced
    u64 bytes[2];       // the connection's counters at its end
    u32 events[2];
};
BPF_TABLE("lru_hash", struct conn_key, struct unseen_end, unseen_ends, MAX_UNSEEN_ENDS);
BPF_HASH(target_ports, u16, u8, 256); // probes.MAX_TARGET_PORTS
BPF_TABLE("lru_hash", u32, u8, target_tgids, MAX_TGIDS);
// Processes that own a tracked connection: the libssl uprobes return at once
// for every other process on the node.
BPF_TABLE("lru_hash", u32, u8, active_tgids, MAX_TGIDS);

// Listening sockets of target ports: (tgid, fd) → port. Filled from bind()
// here and from /proc by the agent (sockets bound before it started, and
// listening fds inherited by forked workers).
BPF_HASH(listeners, struct conn_key, u16, MAX_LISTENERS);
BPF_HASH(bind_pending, u64, struct sockaddr_args, MAX_PENDING);
BPF_TABLE("lru_hash", u32, u8, listener_tgids, MAX_TGIDS);

// A thread's call in progress, entry → exit; a thread that dies inside one
// leaves its entry, removed at its exit (sched_process_exit).
BPF_HASH(io_pending, u64, struct io_args, MAX_PENDING);
BPF_HASH(accept_pending, u64, struct accept_args, MAX_PENDING);
BPF_HASH(connect_pending, u64, struct sockaddr_args, MAX_PENDING);
// The agent's own TCP connections (its scrapes of an engine's /metrics, store and exporter clients), by
// their ports: a traced server accepting one sees the agent as its client. The agent matches each
// accepted connection's (peer port, local port) and accept time against them and records none of it.
struct own_key {
    u16 local_port;
    u16 remote_port;
};
struct own_conn {
    u64 open_ns;  // the agent's connect returned
    u64 close_ns; // the agent closed it; 0 while open
};
#define MAX_OWN_CONNS 4096
BPF_TABLE("lru_hash", struct own_key, struct own_conn, own_conns, MAX_OWN_CONNS);
BPF_HASH(own_fds, u32, struct own_key, MAX_OWN_CONNS); // the agent's fd → its entry, until it closes
BPF_HASH(ssl_pending, u64, struct ssl_args, MAX_PENDING);
// SSL* → fd, only ever from what names the fd itself: SSL_set_fd, a socket
// syscall made inside a libssl call (socket BIOs: nginx, CPython's ssl), or,
// for memory BIOs (asyncio, uvicorn, httpx/anyio clients), the ciphertext's
// own path: the bytes a socket read delivered are the ones BIO_write feeds to
// a BIO (matched by content: event loops copy them between buffers), and the
// BIO libssl reads inside an SSL call is that SSL object's; for SSLs whose
// output the application sends itself (Node), the records it wrote, met again
// in a socket write (written_record_ssl). Nothing depends on having seen the
// SSL object created, so connections opened before the agent started are
// bound at their next read too.
// Keyed by process too: forked workers (nginx) share an address layout, so
// the same pointer names different objects in different processes.
struct ptr_key {
    u64 ptr;
    u32 tgid;
    u32 pad;
};
// A connection by fd and generation: an fd reused by a newer connection is not it.
struct conn_ref {
    u64 conn_ns;
    u32 fd;
    u32 pad;
};
// Ciphertext's first bytes: within a record header they are followed by the
// record's random-looking AEAD output or handshake random, so they name one read.
#define CIPHER_KEY_LEN 16
struct cipher_key {
    u32 tgid;
    u8 head[CIPHER_KEY_LEN];
};
BPF_TABLE("lru_hash", struct ptr_key, u32, ssl_fd, MAX_CONNS);
BPF_TABLE("lru_hash", struct ptr_key, struct conn_ref, bio_conn, MAX_CONNS);       // memory BIO → its socket
BPF_TABLE("lru_hash", struct cipher_key, struct conn_ref, cipher_read, 16384);   // bytes just read → socket

// SSLs whose BIOs are the application's own (Node's TLSWrap, asyncio's memory
// BIOs on the client side) write their records into memory, and the
// application sends them later, outside any SSL call, maybe from another
// stack frame (libuv). The record's own first bytes bind it: those an unbound
// SSL wrote with BIO_write, met again at the start of a socket write, name
// the SSL's socket. TLS records carry ciphertext or hello randoms from their
// sixth byte on, so RECORD_FP_LEN bytes are never shared by two connections.
#define RECORD_FP_LEN 32
struct record_fp {
    u32 tgid;
    u8 bytes[RECORD_FP_LEN];
};
BPF_TABLE("lru_hash", struct record_fp, u64, written_record_ssl, 4096);

static __always_inline void count_drop(void) {
    int zero = 0;
    u64 *d = drops.lookup(&zero);
    if (d)
        __sync_fetch_and_add(d, 1);
}

static __always_inline void count_overflow(int slot) {
    u64 *n = map_overflows.lookup(&slot);
    if (n)
        __sync_fetch_and_add(n, 1);
}

static __always_inline void keep_unseen_end(struct conn_key *k, u64 accept_ns, u64 close_ns,
                                            u64 *bytes, u32 *events) {
    struct unseen_end end = {.accept_ns = accept_ns, .close_ns = close_ns};
    __builtin_memcpy(end.bytes, bytes, sizeof(end.bytes));
    __builtin_memcpy(end.events, events, sizeof(end.events));
    unseen_ends.update(k, &end);
}

// Adds a connection to conns. Full, the LRU evicts the least recently used
// entry, which is one nobody removed: a live connection (idle, or a busy one
// if that many are open) or one closed unseen (close_range, exec). Counted.
static __always_inline void track_connection(struct conn_key *k, struct conn_info *ci) {
    struct conn_info *before = conns.lookup(k);
    if (before) // the fd's previous connection, closed where no probe saw it
        keep_unseen_end(k, before->accept_ns, 0, before->bytes, before->events);
    else {
        int kernel = 0, agent = 1;
        s64 *mine = conns_fill.lookup(&kernel), *theirs = conns_fill.lookup(&agent);
        if (mine && theirs) {
            if (*mine + *theirs >= MAX_CONNS)
                count_overflow(MAP_CONNS); // one in, one evicted: the count stands
            else
                __sync_fetch_and_add(mine, 1);
        }
    }
    conns.update(k, ci);
}

static __always_inline void untrack_connection(struct conn_key *k) {
    int kernel = 0;
    s64 *mine = conns_fill.lookup(&kernel);
    if (conns.delete(k) == 0 && mine)
        __sync_fetch_and_add(mine, -1);
}

static __always_inline struct event *new_event(u8 kind, u32 tgid, u32 fd,
                                               struct conn_info *ci, u64 ts) {
    u32 cpu = bpf_get_smp_processor_id();
    struct event *e = scratch.lookup(&cpu);
    if (!e)
        return 0;
    e->ts_ns = ts;
    e->conn_ns = ci->accept_ns;
    __builtin_memcpy(e->bytes, ci->bytes, sizeof(e->bytes));
    __builtin_memcpy(e->events, ci->events, sizeof(e->events));
    e->tgid = tgid;
    e->fd = fd;
    e->kind = kind;
    e->dir = 0;
    e->tls = ci->tls;
    e->role = ci->role;
    e->ret = 0;
    e->total_len = 0;
    e->head_len = 0;
    e->tail_len = 0;
    e->local_port = ci->local_port;
    e->peer_port = ci->peer_port;
    __builtin_memcpy(e->peer_addr, ci->peer_addr, 16);
    e->comm[0] = 0;
    return e;
}

// Counts a data event against its connection, before it is submitted: a
// record the ring buffer refuses still advances the sequence. (Two threads
// moving bytes the same way on one socket at once could race here; HTTP/1
// servers do not.)
static __always_inline void sequence(struct conn_info *ci, u8 dir, u32 moved) {
    dir &= 1;
    ci->bytes[dir] += moved;
    ci->events[dir] += 1;
}

// The agent is woken for every RING_WAKE_EVERY-th record a CPU sends, or sooner once the
// CPU sent RING_WAKE_BYTES since its last wakeup (a share of the ring buffer: all CPUs
// together never fill it before the agent is woken), and otherwise reads the ring buffer
// at its own pace (every 250 ms at most, agent/capture/kernel/loader.py): a wakeup per record (the
// ring buffer's default while the agent keeps up) costs the agent a poll round and the
// writer's CPU the wakeup's work, for every few records.
#ifndef RING_WAKE_EVERY
#define RING_WAKE_EVERY 256 // records
#endif
#define RING_WAKE_BYTES (RINGBUF_PAGES * 4096ULL / (4 * NR_CPUS_POSSIBLE))
#define RB_NO_WAKEUP 1
#define RB_FORCE_WAKEUP 2
struct ring_sent_since_wakeup {
    u32 records;
    u32 pad;
    u64 bytes;
};
BPF_PERCPU_ARRAY(ring_sent, struct ring_sent_since_wakeup, 1);

static __always_inline u64 ring_flags(u64 size) {
    int zero = 0;
    struct ring_sent_since_wakeup *sent = ring_sent.lookup(&zero);
    if (!sent)
        return 0;
    sent->records += 1;
    sent->bytes += size;
    if (sent->records < RING_WAKE_EVERY && sent->bytes < RING_WAKE_BYTES)
        return RB_NO_WAKEUP;
    sent->records = 0;
    sent->bytes = 0;
    return RB_FORCE_WAKEUP;
}

// Sends a record; 0 if the ring buffer took it (a refused one is counted).
static __always_inline int submit(struct event *e, u32 data_len) {
    u32 size = offsetof(struct event, data) + (data_len & (2 * HEAD_CAP - 1));
    if (size > sizeof(struct event))
        size = sizeof(struct event);
    if (events.ringbuf_output(e, size, ring_flags(size)) == 0)
        return 0;
    count_drop();
    return -1;
}

// Copies the head (and, for large calls, the tail) of a contiguous buffer.
static __always_inline u32 capture_flat(struct event *e, const u8 *buf, u32 total) {
    u64 head = total;
    OPAQUE(head);
    if (head > HEAD_CAP)
        head = HEAD_CAP;
    if (head > 0 && bpf_probe_read_user(e->data, head, buf) != 0)
        head = 0;
    e->head_len = head;
    if (total > HEAD_CAP && head == HEAD_CAP) {
        u64 tail = total - HEAD_CAP;
        OPAQUE(tail);
        if (tail > TAIL_CAP)
            tail = TAIL_CAP;
        if (bpf_probe_read_user(e->data + HEAD_CAP, tail, buf + total - tail) == 0)
            e->tail_len = tail;
    }
    return e->head_len + e->tail_len;
}

// A vectored call's capture past its first MAX_IOV iovecs goes on in
// capture_iov_more, tail-called with the walk's place saved per CPU (a
// bounded loop over every iovec is more than the verifier takes, and BCC
// cannot pass bpf_loop a callback). Calls of up to MAX_IOV iovecs never
// get here; UIO_MAXIOV (1024) iovecs take 15 tail calls, within the kernel's 33.
struct iov_walk {
    const struct iovec *iov;
    u32 iovcnt;
    u32 next;     // the next iovec to read
    u32 pos;      // where in the call's bytes it starts
    u32 total;    // bytes the call moved
    u32 tail_ok;  // the tail window's bytes read so far all arrived
};
BPF_PERCPU_ARRAY(iov_walks, struct iov_walk, 1);
BPF_PROG_ARRAY(iov_more, 1);

// Copies a vectored call's iovecs from w->next on, up to MAX_IOV of them:
// what falls in its first HEAD_CAP bytes to the head, and, of a call larger
// than that, what falls in its last TAIL_CAP bytes to the tail (as
// capture_flat does). Returns the bytes of data[] the event carries so far.
static __always_inline u32 capture_iov(struct event *e, struct iov_walk *w) {
    u32 total = w->total;
    u32 tail = total > HEAD_CAP ? total - HEAD_CAP : 0;
    if (tail > TAIL_CAP)
        tail = TAIL_CAP;
    u32 tail_from = total - tail;
    u32 i = w->next, pos = w->pos;
    for (int k = 0; k < MAX_IOV; k++, i++) {
        if (i >= w->iovcnt || pos >= total)
            break;
        struct iovec v = {};
        if (bpf_probe_read_user(&v, sizeof(v), &w->iov[i]) != 0)
            break;
        u32 n = v.iov_len;
        if (n > total - pos)
            n = total - pos;
        if (n == 0)
            continue;
        if (pos < HEAD_CAP && pos == e->head_len) {
            u64 at = pos;
            OPAQUE(at);
            at &= HEAD_CAP - 1;
            u64 len = n < HEAD_CAP - pos ? n : HEAD_CAP - pos;
            OPAQUE(len);
            if (len > HEAD_CAP)
                len = HEAD_CAP;
            if (bpf_probe_read_user(e->data + at, len, v.iov_base) == 0)
                e->head_len = pos + len;
        }
        if (tail && pos + n > tail_from) {
            u32 skip = pos < tail_from ? tail_from - pos : 0;
            u64 at = pos + skip - tail_from;
            OPAQUE(at);
            at &= TAIL_CAP - 1;
            u64 len = n - skip;
            OPAQUE(len);
            if (len > TAIL_CAP)
                len = TAIL_CAP;
            if (bpf_probe_read_user(e->data + HEAD_CAP + at, len, (const u8 *)v.iov_base + skip) != 0)
                w->tail_ok = 0;
        }
        pos += n;
    }
    w->next = i;
    w->pos = pos;
    e->tail_len = tail && w->tail_ok && pos >= total ? tail : 0;
    return e->head_len + e->tail_len;
}

// Saves a vectored call's walk and tail-calls capture_iov_more while iovecs
// are left that hold bytes the capture keeps; returns only if none are (or
// the tail call failed: the event then goes with what it holds).
static __always_inline void capture_iov_on(void *ctx, struct iov_walk *w) {
    if (w->next >= w->iovcnt || w->pos >= w->total)
        return;
    int zero = 0;
    iov_walks.update(&zero, w);
    iov_more.call(ctx, 0);
}

int capture_iov_more(void *ctx) {
    int zero = 0;
    struct iov_walk *saved = iov_walks.lookup(&zero);
    u32 cpu = bpf_get_smp_processor_id();
    struct event *e = scratch.lookup(&cpu);
    if (!saved || !e)
        return 0;
    struct iov_walk w = *saved;
    u32 len = capture_iov(e, &w);
    capture_iov_on(ctx, &w);
    submit(e, len);
    return 0;
}

static __always_inline void to_v6(u8 *dst, u16 family, const u8 *v4, const u8 *v6) {
    __builtin_memset(dst, 0, 16);
    if (family == AF_INET) {
        dst[10] = 0xff;
        dst[11] = 0xff;
        __builtin_memcpy(dst + 12, v4, 4);
    } else {
        __builtin_memcpy(dst, v6, 16);
    }
}

// Reads a user sockaddr into an IPv6-form address and a port; 0 if not inet.
static __always_inline int read_sockaddr(struct sockaddr *uaddr, u8 *addr, u16 *port) {
    struct sockaddr_in6 sa = {};
    if (!uaddr || bpf_probe_read_user(&sa, sizeof(sa), uaddr) != 0)
        return 0;
    if (sa.sin6_family == AF_INET) {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&sa;
        to_v6(addr, AF_INET, (u8 *)&s4->sin_addr.s_addr, 0);
        *port = ntohs(s4->sin_port);
        return 1;
    }
    if (sa.sin6_family == AF_INET6) {
        to_v6(addr, AF_INET6, 0, (u8 *)&sa.sin6_addr);
        *port = ntohs(sa.sin6_port);
        return 1;
    }
    return 0;
}

// ---------------------------------------------------------------- steady SSE streams
//
// Kernel batching. Once the agent has read a response as an SSE stream in which
// each write is one HTTP chunk holding one token event, it names the bytes such
// a write has around its text (steady_templates), and in them the fields each
// response holds values of its own (an id, a creation time): bytes there need only
// be of the field's kind (plain string bytes, digits). Every later write on that
// connection that has exactly those bytes, and a text of plain characters (no
// quote, backslash or control byte: no escape, no second JSON member, no line
// end), only needs its time and size: those go into a per-connection batch. The
// template lives as long as the connection (a keep-alive connection's next responses
// have the same shape): a write with other bytes around its text (the last token's
// finish_reason, usage, [DONE], the next response's header) holds it, and the first
// write after that which matches it again is read whole, so that the agent has read
// an event of the response (its id and model) before it counts any from their sizes;
// so is the first after the agent named the template (the kernel may be a response ahead).
// Writes read whole are carried whole in the batch, in their place among the batched
// ones, once one that matches the template opened it (so one record holds a response
// from its first text to its end: the escaped texts, the finish and usage chunks,
// [DONE] and the last chunk): a response's head and any write before the batch opened
// go out as events of their own, as do writes over STEADY_WRITE_MAX bytes or of several
// iovecs (the batch sent ahead of them). A batch is sent at the write that ends a
// chunked body (`0\r\n\r\n`), when it is full, at the first write STEADY_AGE_NS after
// its first (a stalled stream's batch waits for its next write), and before any other
// event of the connection (so the agent reads everything in order).
// Batched writes, and those carried whole, advance the connection's sequence numbers
// like any other: a batch the ring buffer refuses is a gap the agent sees.
#ifndef STEADY_WORDS
#define STEADY_WORDS 512 // u64 words of a batch record: a batched write takes one, one carried whole 2 + its bytes'
#endif
#define STEADY_WHOLE_MAX 16 // writes carried whole in one batch (power of two)
#ifndef STEADY_AGE_NS
#define STEADY_AGE_NS 2000000000ULL // a batch is sent at its first write this long after its first (a slow
// stream, 30-100 tokens/s, then costs a record per 60-200 tokens; the agent reads a held batch's times from
// the map when it samples the requests in flight, so holding it longer hides no stall)
#endif
#define STEADY_CONNS 8192
#define STEADY_PREFIX_CAP 256 // bytes after the chunk-size line, up to the text (power of two)
#define STEADY_SUFFIX_CAP 256 // bytes after the text, to the end of the write (power of two)
#define STEADY_WRITE_MAX 1024 // longer writes are never batched (power of two)
#define STEADY_CHUNK_DIGITS 8
#define EV_STEADY_BATCH 8     // an event kind of its own, after those of enum event_kind

struct steady_template {
    u32 prefix_len; // 8..STEADY_PREFIX_CAP
    u32 suffix_len; // 8..STEADY_SUFFIX_CAP, the chunk's closing CRLF included
    u32 hold;       // 1: the next write that matches is read whole (and clears it)
    u32 pad;
    u8 prefix[STEADY_PREFIX_CAP];
    // Per byte of the prefix, 0xff in the one that says what it must be: the template's
    // own byte, any digit, or any plain byte (a field of the response's own).
    u8 exact[STEADY_PREFIX_CAP];
    u8 digits[STEADY_PREFIX_CAP];
    u8 plain[STEADY_PREFIX_CAP];
    u8 suffix[STEADY_SUFFIX_CAP];
    u8 slack[8]; // the word compares' bounds reach past suffix[]
};

// The record sent to the ring buffer, straight from the map value. Its fields up
// to `kind` are struct event's, in its layout, so that the agent tells the two
// apart by `kind` alone; ts_ns is the last write's time, bytes and events the
// connection's counters before the first. words[] holds the writes in order: a
// batched one as its time; one carried whole as its time, then its length (low 32
// bits) with the batched bytes since the one carried whole before it (high 32), then
// its bytes, padded to a word.
struct steady_batch {
    u64 ts_ns, conn_ns, bytes[2];
    u32 tgid, fd, events[2];
    u8 kind, dir, tls, role;
    u32 count;                      // words used
    u64 nbytes;                     // the batched writes' bytes, all together
    u32 wholes;                     // writes carried whole
    u32 run_bytes;                  // batched bytes since the last one carried whole (the kernel's own)
    u16 whole_at[STEADY_WHOLE_MAX]; // where in words[] each starts
    u64 words[STEADY_WORDS];
    u8 slack[STEADY_WRITE_MAX + 16]; // bounds a copy's reach for the verifier; never sent
};
_Static_assert(offsetof(struct steady_batch, kind) == offsetof(struct event, kind), "kind tells the records apart");
_Static_assert(offsetof(struct steady_batch, role) == offsetof(struct event, role), "the same header");

// Elements are freed after an RCU grace period: the agent may replace a template
// while a write on another CPU is reading it.
BPF_F_TABLE("hash", struct conn_key, struct steady_template, steady_templates, STEADY_CONNS,
            BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct conn_key, struct steady_batch, steady_batches, STEADY_CONNS,
            BPF_F_NO_PREALLOC);
BPF_ARRAY(steady_empty, struct steady_batch, 1); // an all-zero batch to create entries from

static __always_inline void steady_send(struct steady_batch *b) {
    u64 count = b->count;
    if (count == 0)
        return;
    OPAQUE(count); // never over STEADY_WORDS (each write makes room first); the mask is for the verifier
    u64 size = offsetof(struct steady_batch, words) + (((count - 1) & (STEADY_WORDS - 1)) + 1) * sizeof(u64);
    if (events.ringbuf_output(b, size, ring_flags(size)) != 0)
        count_drop();
    b->count = 0;
}

// Sends the connection's batch, if one is pending: before any other event of it.
static __always_inline void steady_flush(struct conn_key *k) {
    struct steady_batch *b = steady_batches.lookup(k);
    if (b)
        steady_send(b);
}

// A new connection on the fd starts with none of an old one's state (one the
// conns LRU evicted never had its close() seen).
static __always_inline void steady_forget(struct conn_key *k) {
    steady_templates.delete(k);
    steady_batches.delete(k);
}

static __always_inline void steady_end(struct conn_key *k) {
    steady_flush(k);
    steady_forget(k);
}

// The loops below branch only to leave, on a word count of their own: leaving
// then teaches the verifier nothing about the lengths used after the loop, so the
// states it leaves with are alike and it walks what follows once, not once per
// iteration count.

// The chunk-size line's length (digits and CRLF) if data starts with one naming
// the n-byte write's chunk exactly (data, then CRLF), else 0. Hex digits of either case.
static __always_inline u32 steady_chunk_line(const u8 *data, u32 n) {
    u32 digits = 0, found = 0;
    for (u32 i = 1; i <= STEADY_CHUNK_DIGITS; i++) {
        u32 cr = (((u32)(data[i] ^ '\r')) - 1) >> 31; // 1 at a CR
        digits += i * (cr & ~found);
        found |= cr;
    }
    if (!digits || data[(digits + 1) & 15] != '\n' || n < digits + 4)
        return 0;
    u64 size = n - digits - 4;
    if (size >> (4 * digits))
        return 0;
    // The digits the size is written with, compared byte for byte (case aside).
    u32 bad = 0;
    for (u32 j = 0; j < STEADY_CHUNK_DIGITS; j++) {
        u32 in = ((s32)(j - digits)) >> 31 & 1; // 1 for the line's digits
        u32 nibble = (size >> ((4 * (digits - 1 - j)) & 31)) & 0xF;
        u32 want = '0' + nibble + ((nibble + 6) >> 4) * ('a' - '0' - 10);
        u32 got = data[j];
        bad |= in * (((got | 0x20) ^ want) | ((got - 0x30) >> 31)); // below '0' never aliases a digit
    }
    return bad ? 0 : digits + 2;
}

// Any byte of the word a quote, a backslash or a control byte (exact SWAR tests).
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
static __always_inline u64 steady_special(u64 w) {
    u64 quote = w ^ (0x22 * ONES), backslash = w ^ (0x5c * ONES);
    return (((quote - ONES) & ~quote) | ((backslash - ONES) & ~backslash) | ((w - 0x20 * ONES) & ~w)) & HIGHS;
}

// Any byte of the word not an ASCII digit (false alarms only past a byte that is not one).
static __always_inline u64 steady_nondigit(u64 w) {
    u64 x = w ^ (0x30 * ONES);
    return (x & (0xF0 * ONES)) | ((x + 0x06 * ONES) & (0x10 * ONES));
}

// Whether len bytes (8..cap) of data at off are what want says: whole words, then
// the word that ends them (overlapping the one before). With masks (the prefix's),
// each byte is compared where `exact` says, and of its kind where `digits` or
// `plain` say; without (the suffix), every byte is compared.
static __always_inline int steady_same(const u8 *data, u32 off, const u8 *want, const u8 *exact,
                                       const u8 *digits, const u8 *plain, u32 len, u32 cap) {
    u32 words = len / 8;
    OPAQUE(words);
    u64 diff = 0;
    for (u32 i = 0; i <= cap / 8; i++) {
        u32 at = i < words ? i * 8 : len - 8; // the last round: the word that ends them
        u64 here = off + at, there = at;
        OPAQUE(here); // the masks must stay: they are the verifier's bounds
        OPAQUE(there);
        u64 got = *(const u64 *)(data + (here & (STEADY_WRITE_MAX - 1)));
        u64 differs = got ^ *(const u64 *)(want + (there & (cap - 1)));
        if (exact)
            differs = (differs & *(const u64 *)(exact + (there & (cap - 1))))
                      | (steady_nondigit(got) & *(const u64 *)(digits + (there & (cap - 1))))
                      | (steady_special(got) & *(const u64 *)(plain + (there & (cap - 1))));
        diff |= differs;
        if (i >= words)
            break;
    }
    return diff == 0;
}

// How a write compares with its connection's template.
enum steady_verdict {
    STEADY_DIFFERENT = 0, // other bytes around the text, or not one chunk: the steady state ends
    STEADY_ESCAPED = 1,   // the template's bytes, but a text the agent must read itself
    STEADY_PLAIN = 2,     // the template's bytes around plain text: batched
};

static __always_inline int steady_classify(const u8 *buf, u32 n, struct steady_template *t) {
    u32 plen = t->prefix_len, slen = t->suffix_len;
    if (plen < 8 || plen > STEADY_PREFIX_CAP || slen < 8 || slen > STEADY_SUFFIX_CAP)
        return STEADY_DIFFERENT;
    if (n > STEADY_WRITE_MAX || n < plen + slen + 4)
        return STEADY_DIFFERENT;
    u32 cpu = bpf_get_smp_processor_id();
    struct event *e = scratch.lookup(&cpu);
    if (!e)
        return STEADY_DIFFERENT;
    u8 *data = e->data; // borrowed, as exec does: it is rebuilt for any event sent
    u64 len = n;
    OPAQUE(len);
    if (len > STEADY_WRITE_MAX)
        return STEADY_DIFFERENT;
    if (bpf_probe_read_user(data, len, buf) != 0)
        return STEADY_DIFFERENT;
    u32 from = steady_chunk_line(data, n);
    if (!from || n < from + plen + slen + 1)
        return STEADY_DIFFERENT;
    if (!steady_same(data, from, t->prefix, t->exact, t->digits, t->plain, plen, STEADY_PREFIX_CAP)
        || !steady_same(data, n - slen, t->suffix, 0, 0, 0, slen, STEADY_SUFFIX_CAP))
        return STEADY_DIFFERENT;
    // The text between them: whole words, then the word that ends the text, its
    // bytes already judged replaced with a harmless 'a'.
    from += plen;
    u32 to = n - slen;
    u32 words = (to - from) / 8;
    OPAQUE(words);
    u64 special = 0;
    for (u32 i = 0; i < STEADY_WRITE_MAX / 8; i++) {
        if (i >= words)
            break;
        u64 at = from + i * 8;
        OPAQUE(at);
        special |= steady_special(*(const u64 *)(data + (at & (STEADY_WRITE_MAX - 1))));
    }
    u64 judged = ~0ULL >> (((to - from) & 7) * 8);
    u64 at = to - 8;
    OPAQUE(at);
    u64 last = *(const u64 *)(data + (at & (STEADY_WRITE_MAX - 1)));
    special |= steady_special((last & ~judged) | (0x61 * ONES & judged));
    return special ? STEADY_ESCAPED : STEADY_PLAIN;
}

// The connection's batch, begun afresh if it holds nothing; 0 if the map has no room.
static __always_inline struct steady_batch *steady_open(struct conn_key *k, struct conn_info *ci) {
    int zero = 0;
    struct steady_batch *empty = steady_empty.lookup(&zero);
    if (!empty)
        return 0;
    struct steady_batch *b = steady_batches.lookup_or_try_init(k, empty);
    if (b && b->count == 0) {
        b->conn_ns = ci->accept_ns;
        __builtin_memcpy(b->bytes, ci->bytes, sizeof(b->bytes));
        __builtin_memcpy(b->events, ci->events, sizeof(b->events));
        b->tgid = k->tgid;
        b->fd = k->fd;
        b->kind = EV_STEADY_BATCH;
        b->dir = DIR_WRITE;
        b->tls = ci->tls;
        b->role = ci->role;
        b->nbytes = 0;
        b->wholes = 0;
        b->run_bytes = 0;
    }
    return b;
}

// Copies the n-byte write at buf whole into the batch (room for it checked by the
// caller); 0 if it could not be read.
static __always_inline int steady_carry(struct steady_batch *b, const u8 *buf, u32 n, u64 ts) {
    u64 at = b->count;
    OPAQUE(at);
    at &= STEADY_WORDS - 1;
    u64 len = n;
    OPAQUE(len);
    if (len > STEADY_WRITE_MAX)
        return 0;
    if (bpf_probe_read_user(&b->words[at + 2], len, buf) != 0)
        return 0;
    b->words[at] = ts;
    b->words[at + 1] = n | (u64)b->run_bytes << 32; // at + 1 < STEADY_WORDS: the caller made room
    b->whole_at[b->wholes & (STEADY_WHOLE_MAX - 1)] = at;
    b->wholes += 1;
    b->run_bytes = 0;
    b->count = at + 2 + (n + 7) / 8;
    return 1;
}

// Whether the n-byte write at buf ends a chunked body (its last chunk, no trailer). A
// chunk's data that ends so only sends the batch early.
static __always_inline int steady_body_ends(const u8 *buf, u32 n) {
    u8 end[5] = {};
    return n >= 5 && bpf_probe_read_user(end, sizeof(end), buf + n - 5) == 0 && end[0] == '0' &&
           end[1] == '\r' && end[2] == '\n' && end[3] == '\r' && end[4] == '\n';
}

// A write of n bytes from buf on a tracked connection, before it is sent as an
// event: 1 if it joined the connection's batch (and was sequenced), 0 if it is to
// be sent as usual, the pending batch sent ahead of it.
static __always_inline int steady_write(struct conn_key *k, struct conn_info *ci, const u8 *buf, u32 n,
                                        u64 ts) {
    struct steady_template *t = steady_templates.lookup(k);
    if (!t)
        return 0; // no template: no batch either (both end together)
    int verdict = steady_classify(buf, n, t);
    struct steady_batch *b = 0;
    if (verdict == STEADY_PLAIN && !t->hold) {
        b = steady_open(k, ci);
        if (!b)
            return 0;
        u32 at = b->count;
        b->words[at & (STEADY_WORDS - 1)] = ts;
        b->count = at + 1;
        b->nbytes += n;
        b->run_bytes += n;
    } else {
        // Read whole: carried in the batch if one is open or this write opens it (it matches the template).
        t->hold = verdict == STEADY_DIFFERENT; // the stream moved on: the next write like the template's is read whole
        b = steady_batches.lookup(k);
        u32 open = b && b->count;
        u32 need = 2 + (n + 7) / 8;
        if (open && (b->count + need > STEADY_WORDS || b->wholes >= STEADY_WHOLE_MAX)) {
            steady_send(b);
            open = 0;
        }
        if (n > STEADY_WRITE_MAX || (!open && verdict == STEADY_DIFFERENT)) {
            if (open)
                steady_send(b);
            return 0;
        }
        b = steady_open(k, ci);
        if (!b)
            return 0;
        if (!steady_carry(b, buf, n, ts)) {
            steady_send(b);
            return 0;
        }
    }
    b->ts_ns = ts;
    sequence(ci, DIR_WRITE, n);
    if (b->count >= STEADY_WORDS || ts - b->words[0] >= STEADY_AGE_NS ||
        (verdict == STEADY_DIFFERENT && steady_body_ends(buf, n)))
        steady_send(b);
    return 1;
}

// Called where a data event of the connection is about to be built: 1 if it was a
// write taken into the batch (nothing more to send), else 0 with any pending batch
// sent first. A vectored write is batched only when one iovec holds it all.
static __always_inline int steady_event(struct conn_key *k, struct conn_info *ci, u8 dir, long ret,
                                        const u8 *buf, const struct iovec *iov, u32 iovcnt, u64 ts) {
    // Judged on a copy: what the checks learn of the length must not follow the
    // caller's own, or the verifier walks the caller's capture once per way out of here.
    long n = ret;
    OPAQUE(n);
    if (dir != DIR_WRITE || n <= 0) {
        steady_flush(k);
        return 0;
    }
    if (iov) {
        struct iovec v = {};
        if (iovcnt != 1 || bpf_probe_read_user(&v, sizeof(v), iov) != 0 || v.iov_len < n) {
            steady_flush(k);
            return 0;
        }
        buf = v.iov_base;
    }
    return steady_write(k, ci, buf, n, ts);
}

// ---------------------------------------------------------------- sockets

// Reads a socket fd's addresses from the kernel's own struct sock, through
// the task's fd table: the one source that needs no help from the caller
// (accept4(fd, NULL, NULL) gives no peer; the new socket's state change may
// be traced on another CPU after accept returns). The offsets come from the
// running kernel's BTF (agent/capture/kernel/btf.py); without BTF they are not
// defined and the agent reads /proc instead.
static __always_inline int socket_endpoints(u32 fd, struct conn_info *ci) {
#ifdef OFF_SK_NUM
    void *task = (void *)bpf_get_current_task();
    void *files = 0, *fdt = 0, *fds = 0, *file = 0, *sock = 0, *sk = 0;
    u32 max_fds = 0;
    if (bpf_probe_read_kernel(&files, sizeof(files), task + OFF_TASK_FILES) || !files)
        return 0;
    if (bpf_probe_read_kernel(&fdt, sizeof(fdt), files + OFF_FILES_FDT) || !fdt)
        return 0;
    if (bpf_probe_read_kernel(&max_fds, sizeof(max_fds), fdt + OFF_FDT_MAX_FDS) || fd >= max_fds)
        return 0;
    if (bpf_probe_read_kernel(&fds, sizeof(fds), fdt + OFF_FDT_FD) || !fds)
        return 0;
    if (bpf_probe_read_kernel(&file, sizeof(file), fds + (u64)fd * sizeof(void *)) || !file)
        return 0;
    if (bpf_probe_read_kernel(&sock, sizeof(sock), file + OFF_FILE_PRIVATE) || !sock)
        return 0;
    if (bpf_probe_read_kernel(&sk, sizeof(sk), sock + OFF_SOCKET_SK) || !sk)
        return 0;
    u16 family = 0, dport = 0, num = 0;
    bpf_probe_read_kernel(&family, sizeof(family), sk + OFF_SK_FAMILY);
    bpf_probe_read_kernel(&dport, sizeof(dport), sk + OFF_SK_DPORT);
    bpf_probe_read_kernel(&num, sizeof(num), sk + OFF_SK_NUM);
    u8 v4[4] = {}, v6[16] = {};
    if (family == AF_INET)
        bpf_probe_read_kernel(v4, sizeof(v4), sk + OFF_SK_DADDR);
    else if (family == AF_INET6)
        bpf_probe_read_kernel(v6, sizeof(v6), sk + OFF_SK_V6_DADDR);
    else
        return 0;
    to_v6(ci->peer_addr, family, v4, v6);
    ci->peer_port = ntohs(dport);
    ci->local_port = num; // an accepted socket's local port is its listener's
    return num != 0;
#else
    return 0;
#endif
}

static __always_inline int is_agent(u32 tgid) {
    int self_slot = CFG_SELF_TGID;
    u32 *self_tgid = config.lookup(&self_slot);
    return self_tgid && *self_tgid == tgid;
}

// The agent connected fd: its ports are noted (own_conns), for the agent to know its own traffic.
static __always_inline void note_own_connect(u32 fd) {
    struct conn_info ci = {};
    if (!socket_endpoints(fd, &ci)) // no socket offsets (no BTF): the agent cannot tell its own connections
        return;
    struct own_key key = {.local_port = ci.local_port, .remote_port = ci.peer_port};
    struct own_conn conn = {.open_ns = bpf_ktime_get_ns()};
    own_conns.update(&key, &conn);
    own_fds.update(&fd, &key);
}

static __always_inline void note_own_close(u32 fd) {
    struct own_key *key = own_fds.lookup(&fd);
    if (!key)
        return;
    struct own_conn *conn = own_conns.lookup(key);
    if (conn)
        conn->close_ns = bpf_ktime_get_ns();
    own_fds.delete(&fd);
}

static __always_inline int accept_enter(int fd, struct sockaddr *addr) {
    u64 id = bpf_get_current_pid_tgid();
    struct accept_args a = {.addr = addr, .listen_fd = fd};
    if (accept_pending.update(&id, &a) != 0)
        count_overflow(MAP_ACCEPT_PENDING);
    return 0;
}

static __always_inline int accept_exit(long ret) {
    u64 id = bpf_get_current_pid_tgid();
    struct accept_args saved = {};
    struct accept_args *a = accept_pending.lookup(&id);
    if (a) {
        saved = *a;
        accept_pending.delete(&id);
    }
    if (ret < 0)
        return 0;
    u32 tgid = id >> 32;
    // The agent never traces itself (its store serves readers over HTTP).
    if (is_agent(tgid))
        return 0;
    struct conn_info ci = {};
    ci.accept_ns = bpf_ktime_get_ns();
    ci.role = ROLE_SERVER;
    if (!socket_endpoints((u32)ret, &ci) && a) {
        // No socket offsets: the caller's sockaddr names the peer, if it
        // asked for one, and the listener the port.
        read_sockaddr(saved.addr, ci.peer_addr, &ci.peer_port);
        struct conn_key lk = {.tgid = tgid, .fd = saved.listen_fd};
        u16 *lport = listeners.lookup(&lk);
        if (lport)
            ci.local_port = *lport;
    }
    int wanted = target_tgids.lookup(&tgid) != 0;
    if (!wanted && ci.local_port)
        wanted = target_ports.lookup(&ci.local_port) != 0;
    // The port is unknown here: keep the connection if this process already
    // serves a target port; the agent resolves the port from /proc and drops
    // it if it is not a target.
    if (!wanted && !ci.local_port)
        wanted = listener_tgids.lookup(&tgid) != 0 || active_tgids.lookup(&tgid) != 0;
    if (!wanted)
        return 0;

    struct conn_key k = {.tgid = tgid, .fd = (u32)ret};
    track_connection(&k, &ci);
    steady_forget(&k);
    u8 one = 1;
    active_tgids.update(&tgid, &one);

    struct event *e = new_event(EV_ACCEPT, tgid, k.fd, &ci, ci.accept_ns);
    if (!e)
        return 0;
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_accept4) {
    return accept_enter(args->fd, args->upeer_sockaddr);
}
TRACEPOINT_PROBE(syscalls, sys_exit_accept4) { return accept_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_accept) {
    return accept_enter(args->fd, args->upeer_sockaddr);
}
TRACEPOINT_PROBE(syscalls, sys_exit_accept) { return accept_exit(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_bind) {
    u64 id = bpf_get_current_pid_tgid();
    struct sockaddr_args a = {.addr = (struct sockaddr *)args->umyaddr, .fd = args->fd};
    if (bind_pending.update(&id, &a) != 0)
        count_overflow(MAP_BIND_PENDING);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_bind) {
    u64 id = bpf_get_current_pid_tgid();
    struct sockaddr_args *a = bind_pending.lookup(&id);
    if (!a)
        return 0;
    struct sockaddr_args saved = *a;
    bind_pending.delete(&id);
    if (args->ret != 0)
        return 0;
    u8 addr[16];
    u16 port = 0;
    if (!read_sockaddr(saved.addr, addr, &port) || !target_ports.lookup(&port))
        return 0;
    struct conn_key k = {.tgid = id >> 32, .fd = saved.fd};
    if (listeners.update(&k, &port) != 0)
        count_overflow(MAP_LISTENERS);
    u8 one = 1;
    listener_tgids.update(&k.tgid, &one);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_connect) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_agent(tgid)) {
        int zero = CFG_TRACK_OUTBOUND;
        u32 *outbound = config.lookup(&zero);
        if (!outbound || !*outbound || !target_tgids.lookup(&tgid))
            return 0;
    }
    struct sockaddr_args a = {.addr = (struct sockaddr *)args->uservaddr, .fd = args->fd};
    if (connect_pending.update(&id, &a) != 0)
        count_overflow(MAP_CONNECT_PENDING);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_connect) {
    u64 id = bpf_get_current_pid_tgid();
    struct sockaddr_args *a = connect_pending.lookup(&id);
    if (!a)
        return 0;
    struct sockaddr_args saved = *a;
    connect_pending.delete(&id);
    // Non-blocking sockets report EINPROGRESS and complete later.
    if (args->ret != 0 && args->ret != -115)
        return 0;
    u32 tgid = id >> 32;
    if (is_agent(tgid)) { // its local port is bound by now
        note_own_connect(saved.fd);
        return 0;
    }
    struct conn_info ci = {};
    ci.accept_ns = bpf_ktime_get_ns();
    ci.role = ROLE_CLIENT;
    if (!read_sockaddr(saved.addr, ci.peer_addr, &ci.peer_port))
        return 0; // not TCP/IP (e.g. a unix socket)
    struct conn_key k = {.tgid = tgid, .fd = saved.fd};
    track_connection(&k, &ci);
    u8 one = 1;
    active_tgids.update(&tgid, &one);
    struct event *e = new_event(EV_CONNECT, tgid, k.fd, &ci, ci.accept_ns);
    if (!e)
        return 0;
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_close) {
    u64 id = bpf_get_current_pid_tgid();
    struct conn_key k = {.tgid = id >> 32, .fd = args->fd};
    struct conn_info *ci = conns.lookup(&k);
    if (!ci) {
        if (is_agent(k.tgid))
            note_own_close(args->fd);
        return 0;
    }
    steady_end(&k);
    struct event *e = new_event(EV_CLOSE, k.tgid, k.fd, ci, bpf_ktime_get_ns());
    untrack_connection(&k);
    if (e && submit(e, 0) != 0) // kept for the agent, which would count this close's record as lost
        keep_unseen_end(&k, e->conn_ns, e->ts_ns, e->bytes, e->events);
    return 0;
}

// ---------------------------------------------------------------- plain I/O

#define MSG_PEEK_FLAG 2

// A TLS record header: content type 20-23 (change cipher spec, alert,
// handshake, application data), protocol version 3.x.
static __always_inline int starts_tls_record(const u8 *b) {
    return b[0] >= 20 && b[0] <= 23 && b[1] == 3 && b[2] <= 4;
}

// A socket write outside any SSL call that starts with a record an unbound
// SSL wrote (see written_record_ssl): that SSL's socket is this one.
static __always_inline void bind_by_written_record(u32 tgid, u32 fd, const u8 *buf,
                                                   const struct iovec *iov, struct conn_info *ci) {
    if (!buf && iov) {
        struct iovec v = {};
        if (bpf_probe_read_user(&v, sizeof(v), &iov[0]) != 0 || v.iov_len < RECORD_FP_LEN)
            return;
        buf = v.iov_base;
    }
    struct record_fp fp = {.tgid = tgid};
    if (!buf || bpf_probe_read_user(fp.bytes, RECORD_FP_LEN, buf) != 0 || !starts_tls_record(fp.bytes))
        return;
    u64 *ssl = written_record_ssl.lookup(&fp);
    if (!ssl)
        return;
    struct ptr_key sk = {.ptr = *ssl, .tgid = tgid};
    ssl_fd.update(&sk, &fd);
    written_record_ssl.delete(&fp);
    ci->tls = 1;
}

// Reads of a TLS candidate that are keyed for BIO_write: binding happens at the
// first (the handshake, or an adopted connection's next read), so a connection
// still unbound after these is TLS no probe reads, and costs no more.
#define CIPHER_KEYED_READS 8

// A captured call on a connection no SSL object is bound to yet. Its first
// bytes, if the connection is seen from its start, tell TLS from cleartext
// for good (cleartext costs nothing more); on a TLS candidate, a read that
// starts with a TLS record header is remembered by its first bytes for
// BIO_write to find (uprobe_bio_write).
static __always_inline void note_cleartext_or_cipher(struct event *e, struct conn_info *ci, u8 dir) {
    if (ci->plain || e->head_len < 2)
        return;
    if (ci->accept_ns && ci->events[0] + ci->events[1] == 1 && !(e->data[0] == 0x16 && e->data[1] == 0x03)) {
        ci->plain = 1;
        return;
    }
    if (dir != DIR_READ || ci->events[DIR_READ] > CIPHER_KEYED_READS || e->head_len < CIPHER_KEY_LEN ||
        !starts_tls_record(e->data))
        return;
    struct cipher_key ck = {.tgid = e->tgid};
    __builtin_memcpy(ck.head, e->data, CIPHER_KEY_LEN);
    struct conn_ref ref = {.conn_ns = ci->accept_ns, .fd = e->fd};
    cipher_read.update(&ck, &ref);
}

static __always_inline int io_enter(u32 fd, const u8 *buf, const struct iovec *iov,
                                    u32 iovcnt, u8 dir, u32 flags) {
    // A peek leaves the bytes queued: they are read again, and counted then.
    if (flags & MSG_PEEK_FLAG)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    struct conn_key k = {.tgid = id >> 32, .fd = fd};
    struct conn_info *ci = conns.lookup(&k);
    if (!ci)
        return 0;
    // Inside a libssl call this is ciphertext: learn SSL* → fd.
    struct ssl_args *sa = ssl_pending.lookup(&id);
    if (sa) {
        struct ptr_key sk = {.ptr = (u64)sa->ssl, .tgid = id >> 32};
        ssl_fd.update(&sk, &fd);
        if (!ci->tls)
            ci->tls = 1;
    } else if (dir == DIR_WRITE && !ci->tls && !ci->plain) {
        bind_by_written_record(k.tgid, fd, buf, iov, ci);
    }
    // Ciphertext's bytes are not reported (the plaintext comes from the SSL
    // uprobes), but its EOF and errors are the connection's: libssl's return
    // values cannot tell them from "try again", whatever BIO it reads through.
    struct io_args a = {.enter_ns = bpf_ktime_get_ns(), .buf = buf, .iov = iov,
                        .iovcnt = iovcnt, .fd = fd, .dir = dir, .ciphertext = ci->tls};
    if (io_pending.update(&id, &a) != 0) {
        // The call goes unseen: count it as an event the ring buffer lost, so
        // that the exchanges it belongs to say `dropped`.
        count_overflow(MAP_IO_PENDING);
        sequence(ci, dir, 0);
    }
    return 0;
}

static __always_inline int io_exit(void *ctx, long ret) {
    u64 id = bpf_get_current_pid_tgid();
    struct io_args *a = io_pending.lookup(&id);
    if (!a)
        return 0;
    struct io_args saved = *a;
    io_pending.delete(&id);
    // EAGAIN/EINTR moved nothing; other errors (ECONNRESET, EPIPE) matter.
    if (ret == 0 && saved.dir == DIR_WRITE)
        return 0;
    if (ret == -11 || ret == -4)
        return 0;
    if (saved.ciphertext && ret > 0)
        return 0;
    struct conn_key k = {.tgid = id >> 32, .fd = saved.fd};
    struct conn_info *ci = conns.lookup(&k);
    if (!ci)
        return 0;
    // Reads count when the bytes reached the process, writes when the
    // process handed them over.
    u64 ts = saved.dir == DIR_READ ? bpf_ktime_get_ns() : saved.enter_ns;
    if (steady_event(&k, ci, saved.dir, ret, saved.buf, saved.iov, saved.iovcnt, ts))
        return 0;
    struct event *e = new_event(EV_DATA, k.tgid, k.fd, ci, ts);
    if (!e)
        return 0;
    e->dir = saved.dir;
    e->ret = ret;
    e->tls |= saved.ciphertext;
    sequence(ci, saved.dir, ret > 0 ? ret : 0);
    u32 len = 0;
    if (ret > 0) {
        e->total_len = ret;
        struct iov_walk w = {.iov = saved.iov, .iovcnt = saved.iovcnt, .total = ret, .tail_ok = 1};
        if (saved.iov)
            len = capture_iov(e, &w);
        else
            len = capture_flat(e, saved.buf, ret);
        note_cleartext_or_cipher(e, ci, saved.dir);
        if (saved.iov)
            capture_iov_on(ctx, &w);
    }
    submit(e, len);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_read) {
    return io_enter(args->fd, (const u8 *)args->buf, 0, 0, DIR_READ, 0);
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return io_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) {
    return io_enter(args->fd, (const u8 *)args->ubuf, 0, 0, DIR_READ, args->flags);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return io_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_readv) {
    return io_enter(args->fd, 0, (const struct iovec *)args->vec, args->vlen, DIR_READ, 0);
}
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return io_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg) {
    struct user_msghdr m = {};
    if (bpf_probe_read_user(&m, sizeof(m), args->msg) != 0)
        return 0;
    return io_enter(args->fd, 0, m.msg_iov, m.msg_iovlen, DIR_READ, args->flags);
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return io_exit(args, args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_write) {
    return io_enter(args->fd, (const u8 *)args->buf, 0, 0, DIR_WRITE, 0);
}
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return io_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendto) {
    return io_enter(args->fd, (const u8 *)args->buff, 0, 0, DIR_WRITE, 0);
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return io_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) {
    return io_enter(args->fd, 0, (const struct iovec *)args->vec, args->vlen, DIR_WRITE, 0);
}
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return io_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) {
    struct user_msghdr m = {};
    if (bpf_probe_read_user(&m, sizeof(m), args->msg) != 0)
        return 0;
    return io_enter(args->fd, 0, m.msg_iov, m.msg_iovlen, DIR_WRITE, 0);
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return io_exit(args, args->ret); }

// ---------------------------------------------------------------- libssl

static __always_inline int ssl_enter(struct pt_regs *ctx, u8 fn) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!active_tgids.lookup(&tgid))
        return 0;
    // Nested public calls (one SSL_* implemented with another): the outer
    // call owns the record.
    if (ssl_pending.lookup(&id))
        return 0;
    struct ssl_args a = {};
    a.enter_ns = bpf_ktime_get_ns();
    a.ssl = (void *)PT_REGS_PARM1(ctx);
    a.buf = (const u8 *)PT_REGS_PARM2(ctx);
    if (fn == SSL_FN_READ_EX || fn == SSL_FN_WRITE_EX)
        a.len_out = (size_t *)PT_REGS_PARM4(ctx);
    a.fn = fn;
    if (ssl_pending.update(&id, &a) != 0)
        count_overflow(MAP_SSL_PENDING);
    return 0;
}

// Finds the connection an SSL* belongs to; 0 if none is tracked.
static __always_inline struct conn_info *ssl_conn(struct ssl_args *a, u64 id,
                                                  struct conn_key *k) {
    struct ptr_key sk = {.ptr = (u64)a->ssl, .tgid = id >> 32};
    u32 *fdp = ssl_fd.lookup(&sk);
    if (!fdp)
        return 0;
    k->tgid = id >> 32;
    k->fd = *fdp;
    return conns.lookup(k);
}

// One data event of decrypted bytes: `n` bytes of `buf` that a TLS library
// (libssl, Go crypto/tls) read from or wrote to connection `k`.
static __always_inline void submit_plaintext(struct conn_key *k, struct conn_info *ci, u8 dir, u64 ts,
                                             const u8 *buf, u32 n) {
    struct event *e = new_event(EV_DATA, k->tgid, k->fd, ci, ts);
    if (!e)
        return;
    e->dir = dir;
    e->tls = 1;
    e->ret = n;
    e->total_len = n;
    sequence(ci, dir, n);
    submit(e, capture_flat(e, buf, n));
}

static __always_inline int ssl_exit(struct pt_regs *ctx, u8 fn) {
    u64 id = bpf_get_current_pid_tgid();
    struct ssl_args *ap = ssl_pending.lookup(&id);
    if (!ap || ap->fn != fn)
        return 0;
    struct ssl_args a = *ap;
    ssl_pending.delete(&id);
    int ret = (int)PT_REGS_RC(ctx); // every probed SSL_* returns int
    struct conn_key k = {};
    struct conn_info *ci = ssl_conn(&a, id, &k);
    if (!ci)
        return 0;
    if (!ci->tls)
        ci->tls = 1;

    u64 now = bpf_ktime_get_ns();
    if (fn == SSL_FN_HANDSHAKE) {
        if (ret != 1)
            return 0;
        struct event *e = new_event(EV_TLS_DONE, k.tgid, k.fd, ci, now);
        if (e)
            submit(e, 0);
        return 0;
    }
    u32 n = 0;
    if (fn == SSL_FN_READ_EX || fn == SSL_FN_WRITE_EX) {
        size_t moved = 0;
        if (ret != 1 || !a.len_out || bpf_probe_read_user(&moved, sizeof(moved), a.len_out) != 0)
            return 0;
        n = moved;
    } else {
        // SSL_read's 0 is the peer closing the session (close_notify or EOF);
        // its negative values mix errors with "try again", so the socket's
        // own EOF and errors speak for those (io_exit).
        if (ret < 0 || (ret == 0 && fn != SSL_FN_READ))
            return 0;
        n = ret;
    }
    u8 dir = (fn == SSL_FN_READ || fn == SSL_FN_READ_EX) ? DIR_READ : DIR_WRITE;
    u64 ts = dir == DIR_READ ? now : a.enter_ns;
    if (steady_event(&k, ci, dir, n, a.buf, 0, 0, ts))
        return 0;
    submit_plaintext(&k, ci, dir, ts, a.buf, n);
    return 0;
}

// SSL_set_fd(ssl, fd): a socket BIO on fd (a reused SSL* is rebound here).
int uprobe_ssl_set_fd(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!active_tgids.lookup(&tgid))
        return 0;
    struct ptr_key sk = {.ptr = PT_REGS_PARM1(ctx), .tgid = tgid};
    u32 fd = PT_REGS_PARM2(ctx);
    ssl_fd.update(&sk, &fd);
    return 0;
}

// SSL_set_bio(ssl, rbio, wbio): rbio is a new read BIO; whatever its address
// named before (a freed BIO's socket) is forgotten.
int uprobe_ssl_set_bio(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!active_tgids.lookup(&tgid))
        return 0;
    struct ptr_key bk = {.ptr = PT_REGS_PARM2(ctx), .tgid = tgid};
    bio_conn.delete(&bk);
    return 0;
}

// SSL_free(ssl): its address may name another SSL next, on another socket.
int uprobe_ssl_free(struct pt_regs *ctx) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!active_tgids.lookup(&tgid))
        return 0;
    struct ptr_key sk = {.ptr = PT_REGS_PARM1(ctx), .tgid = tgid};
    ssl_fd.delete(&sk);
    return 0;
}

// BIO_write(bio, record, n) by an SSL not yet bound, inside its own SSL call:
// remember the record's first bytes for bind_by_written_record.
static __always_inline void remember_written_record(u64 ssl, u32 tgid, const u8 *buf, int len) {
    struct ptr_key sk = {.ptr = ssl, .tgid = tgid};
    if (len < RECORD_FP_LEN || ssl_fd.lookup(&sk))
        return;
    struct record_fp fp = {.tgid = tgid};
    if (bpf_probe_read_user(fp.bytes, RECORD_FP_LEN, buf) != 0 || !starts_tls_record(fp.bytes))
        return;
    written_record_ssl.update(&fp, &ssl);
}

// BIO_write(bio, buf, n) outside libssl, of bytes a socket read just
// delivered: bio is fed by that socket. Inside an SSL call, BIO_write is
// libssl's own output: a record the SSL writes out (remember_written_record).
int uprobe_bio_write(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!active_tgids.lookup(&tgid))
        return 0;
    struct ssl_args *inside = ssl_pending.lookup(&id);
    if (inside) {
        remember_written_record((u64)inside->ssl, tgid, (const u8 *)PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx));
        return 0;
    }
    if ((int)PT_REGS_PARM3(ctx) < CIPHER_KEY_LEN)
        return 0;
    struct cipher_key ck = {.tgid = tgid};
    if (bpf_probe_read_user(ck.head, CIPHER_KEY_LEN, (void *)PT_REGS_PARM2(ctx)) != 0)
        return 0;
    struct conn_ref *ref = cipher_read.lookup(&ck);
    if (!ref)
        return 0;
    struct ptr_key bk = {.ptr = PT_REGS_PARM1(ctx), .tgid = tgid};
    bio_conn.update(&bk, ref);
    cipher_read.delete(&ck);
    return 0;
}

// BIO_read(bio, ...) made by libssl inside an SSL call: bio is that SSL
// object's read BIO, so the SSL object is the socket's that feeds bio.
int uprobe_bio_read(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!active_tgids.lookup(&tgid))
        return 0;
    struct ssl_args *sa = ssl_pending.lookup(&id);
    if (!sa)
        return 0;
    struct ptr_key bk = {.ptr = PT_REGS_PARM1(ctx), .tgid = tgid};
    struct conn_ref *ref = bio_conn.lookup(&bk);
    if (!ref)
        return 0;
    struct ptr_key sk = {.ptr = (u64)sa->ssl, .tgid = tgid};
    u32 *bound = ssl_fd.lookup(&sk);
    if (bound && *bound == ref->fd)
        return 0; // every later read of a bound SSL object
    struct conn_key k = {.tgid = tgid, .fd = ref->fd};
    struct conn_info *ci = conns.lookup(&k);
    if (!ci || ci->accept_ns != ref->conn_ns)
        return 0; // that connection is gone: its fd may be another's now
    u32 fd = ref->fd;
    ssl_fd.update(&sk, &fd);
    return 0;
}

int uprobe_ssl_read(struct pt_regs *ctx) { return ssl_enter(ctx, SSL_FN_READ); }
int uretprobe_ssl_read(struct pt_regs *ctx) { return ssl_exit(ctx, SSL_FN_READ); }
int uprobe_ssl_read_ex(struct pt_regs *ctx) { return ssl_enter(ctx, SSL_FN_READ_EX); }
int uretprobe_ssl_read_ex(struct pt_regs *ctx) { return ssl_exit(ctx, SSL_FN_READ_EX); }
int uprobe_ssl_write(struct pt_regs *ctx) { return ssl_enter(ctx, SSL_FN_WRITE); }
int uretprobe_ssl_write(struct pt_regs *ctx) { return ssl_exit(ctx, SSL_FN_WRITE); }
int uprobe_ssl_write_ex(struct pt_regs *ctx) { return ssl_enter(ctx, SSL_FN_WRITE_EX); }
int uretprobe_ssl_write_ex(struct pt_regs *ctx) { return ssl_exit(ctx, SSL_FN_WRITE_EX); }
int uprobe_ssl_handshake(struct pt_regs *ctx) { return ssl_enter(ctx, SSL_FN_HANDSHAKE); }
int uretprobe_ssl_handshake(struct pt_regs *ctx) { return ssl_exit(ctx, SSL_FN_HANDSHAKE); }

// ---------------------------------------------------------------- Go crypto/tls
//
// Go links its TLS into the executable: crypto/tls.(*Conn).Read/Write carry the
// plaintext. Go >= 1.17 on amd64 passes arguments and results in registers
// (RAX, RBX, RCX, ...) and keeps the running goroutine's g in R14. Goroutine
// stacks move and goroutines migrate between threads, so there are no
// uretprobes here (they rewrite the return address on the stack) and nothing is
// keyed by thread: the agent puts a uprobe on every RET instruction of Read and
// of the handshakes, and a call is matched to its return by (process, goroutine).
// Write is reported at its entry, with all of its buffer (Go's Write writes it
// all or fails, and a failure is the socket's own error, reported by io_exit):
// in HTTP/2 another goroutine may see the peer's close, and close the socket,
// before the writer gets back to Write's RET. Entry probes sit past the
// prologue's stack check (go_tls.py): a goroutine whose stack grows runs the
// prologue twice, and would show one Write twice.

enum go_tls_fn { GO_TLS_READ = 1, GO_TLS_WRITE, GO_TLS_HANDSHAKE };

struct go_call_key {
    u64 g;              // the goroutine's runtime.g, from R14
    u32 tgid;
    u32 fn;
};

struct go_call {
    const u8 *buf;
    u32 fd;
};

BPF_TABLE("lru_hash", struct go_call_key, struct go_call, go_tls_pending, MAX_PENDING);
// The itab hash (itab.hash, a copy of the type's hash) of *net.TCPConn as a
// net.Conn in each probed binary: a tls.Conn over anything else is not followed.
BPF_HASH(go_tcp_conn_itab_hashes, u32, u8, 64);

// Layouts unchanged since Go 1.9: tls.Conn starts with `conn net.Conn` (itab,
// data); *net.TCPConn points at {fd *netFD}; netFD starts with poll.FD, whose
// Sysfd follows the 16-byte fdMutex.
#define GO_ITAB_HASH_OFFSET 16
#define GO_POLL_FD_SYSFD_OFFSET 16

// The tracked socket under a *tls.Conn; 0 if it is not a tracked TCP connection.
static __always_inline struct conn_info *go_tls_conn(void *tls_conn, u32 tgid, struct conn_key *k) {
    void *iface[2] = {};
    void *netfd = 0;
    u32 hash = 0;
    s64 sysfd = -1;
    if (bpf_probe_read_user(iface, sizeof(iface), tls_conn) || !iface[0] || !iface[1])
        return 0;
    if (bpf_probe_read_user(&hash, sizeof(hash), iface[0] + GO_ITAB_HASH_OFFSET) ||
        !go_tcp_conn_itab_hashes.lookup(&hash))
        return 0;
    if (bpf_probe_read_user(&netfd, sizeof(netfd), iface[1]) || !netfd)
        return 0;
    if (bpf_probe_read_user(&sysfd, sizeof(sysfd), netfd + GO_POLL_FD_SYSFD_OFFSET) || sysfd < 0)
        return 0;
    k->tgid = tgid;
    k->fd = (u32)sysfd;
    return conns.lookup(k);
}

static __always_inline int go_tls_enter(struct pt_regs *ctx, u32 fn) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!active_tgids.lookup(&tgid))
        return 0;
    struct conn_key k = {};
    struct conn_info *ci = go_tls_conn((void *)ctx->ax, tgid, &k);
    if (!ci)
        return 0;
    // The socket I/O inside the call is ciphertext: only its EOF and errors are reported (io_exit).
    if (!ci->tls)
        ci->tls = 1;
    if (fn == GO_TLS_WRITE) { // Write(b []byte): b's pointer in RBX, its length in RCX
        if (ctx->cx > 0)
            submit_plaintext(&k, ci, DIR_WRITE, bpf_ktime_get_ns(), (const u8 *)ctx->bx, ctx->cx);
        return 0;
    }
    struct go_call_key key = {.g = ctx->r14, .tgid = tgid, .fn = fn};
    struct go_call call = {.buf = (const u8 *)ctx->bx, .fd = k.fd};
    go_tls_pending.update(&key, &call);
    return 0;
}

// At a RET: RAX holds the first result (Read's n, the handshake error's itab).
static __always_inline int go_tls_return(struct pt_regs *ctx, u32 fn) {
    u64 id = bpf_get_current_pid_tgid();
    struct go_call_key key = {.g = ctx->r14, .tgid = id >> 32, .fn = fn};
    struct go_call *cp = go_tls_pending.lookup(&key);
    if (!cp)
        return 0;
    struct go_call call = *cp;
    go_tls_pending.delete(&key);
    struct conn_key k = {.tgid = key.tgid, .fd = call.fd};
    struct conn_info *ci = conns.lookup(&k);
    if (!ci)
        return 0;
    u64 now = bpf_ktime_get_ns();
    if (fn == GO_TLS_HANDSHAKE) {
        if (ctx->ax != 0) // a non-nil error
            return 0;
        struct event *e = new_event(EV_TLS_DONE, k.tgid, k.fd, ci, now);
        if (e)
            submit(e, 0);
        return 0;
    }
    // n > 0 only: the socket's own EOF and errors speak for the rest, as for libssl.
    s64 n = (s64)ctx->ax;
    if (n > 0)
        submit_plaintext(&k, ci, DIR_READ, now, call.buf, n);
    return 0;
}

int uprobe_go_tls_read(struct pt_regs *ctx) { return go_tls_enter(ctx, GO_TLS_READ); }
int uprobe_go_tls_read_ret(struct pt_regs *ctx) { return go_tls_return(ctx, GO_TLS_READ); }
int uprobe_go_tls_write(struct pt_regs *ctx) { return go_tls_enter(ctx, GO_TLS_WRITE); }
int uprobe_go_tls_handshake(struct pt_regs *ctx) { return go_tls_enter(ctx, GO_TLS_HANDSHAKE); }
int uprobe_go_tls_handshake_ret(struct pt_regs *ctx) { return go_tls_return(ctx, GO_TLS_HANDSHAKE); }

// ---------------------------------------------------------------- processes

// Children of target processes are targets too (pre-fork servers: nginx
// workers, gunicorn), and children of a process that listens on a target port
// inherit its listeners: their first accept is kept even where the socket's
// port cannot be read in the kernel (the agent reads it from /proc).
TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 parent = args->parent_pid;
    u32 child = args->child_pid;
    u8 one = 1;
    if (target_tgids.lookup(&parent))
        target_tgids.update(&child, &one);
    if (listener_tgids.lookup(&parent))
        listener_tgids.update(&child, &one);
    return 0;
}

// A process that dies closes its sockets without close(): tell the agent, so
// that its connections end (and stop counting as in flight), and forget it.
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    // A thread killed inside a call never reaches its exit probe.
    io_pending.delete(&id);
    ssl_pending.delete(&id);
    accept_pending.delete(&id);
    connect_pending.delete(&id);
    bind_pending.delete(&id);
    if ((u32)id != tgid) // a thread, not the process
        return 0;
    target_tgids.delete(&tgid);
    listener_tgids.delete(&tgid);
    if (!active_tgids.lookup(&tgid))
        return 0;
    active_tgids.delete(&tgid);
    struct conn_info none = {};
    struct event *e = new_event(EV_EXIT, tgid, 0, &none, bpf_ktime_get_ns());
    if (e)
        submit(e, 0);
    return 0;
}

// A newly executed program whose path is a target executable becomes a target.
TRACEPOINT_PROBE(sched, sched_process_exec) {
    int slot = CFG_EXE_PATHS;
    u32 *npaths = config.lookup(&slot);
    if (!npaths || !*npaths)
        return 0;
    u32 cpu = bpf_get_smp_processor_id();
    struct event *e = scratch.lookup(&cpu);
    if (!e)
        return 0;
    // Borrow the scratch event's data area for the path.
    char *name = (char *)e->data;
    unsigned short loc = args->data_loc_filename & 0xFFFF;
    if (bpf_probe_read_kernel_str(name, EXE_PATH_LEN, (void *)args + loc) < 0)
        return 0;
    for (int p = 0; p < MAX_EXE_PATHS; p++) {
        if (p >= *npaths)
            break;
        int idx = p;
        struct exe_path *want = exe_paths.lookup(&idx);
        if (!want)
            continue;
        int same = 1;
        for (int i = 0; i < EXE_PATH_LEN; i++) {
            if (want->path[i] != name[i]) {
                same = 0;
                break;
            }
            if (want->path[i] == 0)
                break;
        }
        if (!same)
            continue;
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        u8 one = 1;
        target_tgids.update(&tgid, &one);
        struct conn_info none = {};
        e = new_event(EV_EXEC, tgid, 0, &none, bpf_ktime_get_ns());
        if (!e)
            return 0;
        bpf_get_current_comm(e->comm, sizeof(e->comm));
        submit(e, 0);
        return 0;
    }
    return 0;
}
