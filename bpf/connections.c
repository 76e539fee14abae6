// Connections: accept, connect, bind, close, socket addresses. Included by tokenprobe.c (after the files before it there), not compiled alone.

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

