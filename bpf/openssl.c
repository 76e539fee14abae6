// OpenSSL: uprobes on libssl and libcrypto. Included by tokenprobe.c (after the files before it there), not compiled alone.

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

