// Constants, the maps, the ring buffer's record and the helpers every probe uses. Included by tokenprobe.c (after the files before it there), not compiled alone.

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
