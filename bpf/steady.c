// Kernel batching of steady SSE streams. Included by tokenprobe.c (after the files before it there), not compiled alone.

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
    u32 suffix_len; // 1..STEADY_SUFFIX_CAP, the chunk's closing CRLF included (under 8: in suffix[8 - len..8])
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
    if (plen < 8 || plen > STEADY_PREFIX_CAP || slen < 1 || slen > STEADY_SUFFIX_CAP)
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
    if (!steady_same(data, from, t->prefix, t->exact, t->digits, t->plain, plen, STEADY_PREFIX_CAP))
        return STEADY_DIFFERENT;
    if (slen < 8) {
        // A suffix shorter than a word (Anthropic's `"}}\n\n` and the chunk's CRLF): the write's last
        // word, its last slen bytes compared (those before it are the text's, judged below).
        u64 at = n - 8;
        OPAQUE(at);
        u64 got = *(const u64 *)(data + (at & (STEADY_WRITE_MAX - 1)));
        if ((got ^ *(const u64 *)t->suffix) & (~0ULL << ((8 - slen) * 8)))
            return STEADY_DIFFERENT;
    } else if (!steady_same(data, n - slen, t->suffix, 0, 0, 0, slen, STEADY_SUFFIX_CAP)) {
        return STEADY_DIFFERENT;
    }
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

