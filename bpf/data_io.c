// Data syscalls: read/write families on tracked sockets. Included by tokenprobe.c (after the files before it there), not compiled alone.

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

