// Go crypto/tls: uprobes on Go executables. Included by tokenprobe.c (after the files before it there), not compiled alone.

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
