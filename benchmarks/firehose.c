// A streaming server, and its clients, for the hot-path benchmark: neither may be the bottleneck.
//
// Serves keep-alive POSTs on 127.0.0.1:PORT. Each response is an SSE stream of
// TOKENS text events in SHAPE (default vllm: OpenAI chat-completion chunks as vLLM writes them, an
// id and creation time of the response's own in every chunk; see SHAPES), chunked transfer encoding,
// one write() per chunk (what uvicorn and most servers do at low load), paced so that all
// connections together write RATE events per second. The clients run in the same
// loop (a Python client would be slower than the agent it loads): each sends its
// next request when a response ends, and notes its TTFT (request sent to first event
// read). Commands, one a line on stdin:
//   RATE        a new rate (0 pauses)
//   clients N   N keep-alive clients from now on (0: none)
//   report      prints "received EVENTS RESPONSES TTFT_P50_US TTFT_P99_US": what the clients
//               read since the last report (responses that ended)
// At the end of stdin it prints "written EVENTS RESPONSES" and exits.
//
//   cc -O2 -o firehose firehose.c && ./firehose PORT TOKENS [SHAPE]
#define _GNU_SOURCE // memmem
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNECTIONS 1024
#define MAX_TTFTS (1 << 20)
#define MARK_LEN 8 // strlen of a shape's mark
#define BURST 64   // events written between two reads of the clients

// A shape's events, in which {id} is the response's number (16 hex digits, as vLLM's ids are hex),
// {created} the time it began (s), {tokens} and {total} the usage's counts.
struct shape {
    const char *name, *path; // path: the API's, which the clients ask
    const char *type;        // the response's content type
    const char *mark;        // MARK_LEN bytes, one per event the clients read (after its chunk line)
    const char *start;       // events before the first text, in a write of their own ("": none)
    const char *text;        // a text event: one write each
    const char *last;        // the closing events, in one write
};
#define SSE "text/event-stream", "\ndata: {"
#define CHUNK_HEAD "{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\""
#define CHAT_TEXT(head, logprobs, eol) \
    "data: " head ",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok\"}," logprobs "\"finish_reason\":null}]}" eol eol
#define CHAT_LAST(head, eol)                                                                                   \
    "data: " head ",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],"                       \
    "\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":{tokens},\"total_tokens\":{total}}}" eol eol "data: [DONE]" eol eol
#define VLLM_HEAD CHUNK_HEAD ",\"created\":{created},\"model\":\"bench\""
#define OPENAI_HEAD VLLM_HEAD ",\"system_fingerprint\":\"fp_bench\""
static const struct shape SHAPES[] = {
    {"vllm", "/v1/chat/completions", SSE, "", CHAT_TEXT(VLLM_HEAD, "", "\n"), CHAT_LAST(VLLM_HEAD, "\n")},
    // Servers that leave out `created` and `model`.
    {"bare", "/v1/chat/completions", SSE, "", CHAT_TEXT(CHUNK_HEAD, "", "\n"), CHAT_LAST(CHUNK_HEAD, "\n")},
    // OpenAI's own: a system_fingerprint, and logprobs in each choice.
    {"openai", "/v1/chat/completions", SSE, "", CHAT_TEXT(OPENAI_HEAD, "\"logprobs\":null,", "\n"),
     CHAT_LAST(OPENAI_HEAD, "\n")},
    // sse-starlette's framing: CRLF line ends.
    {"starlette", "/v1/chat/completions", SSE, "", CHAT_TEXT(VLLM_HEAD, "", "\r\n"), CHAT_LAST(VLLM_HEAD, "\r\n")},
    // Anthropic's Messages API: named events, the message's id and model in the first.
    {"anthropic", "/v1/messages", SSE,
     "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_{id}\",\"type\":\"message\","
     "\"role\":\"assistant\",\"model\":\"bench\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,"
     "\"usage\":{\"input_tokens\":8,\"output_tokens\":1}}}\n\n"
     "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,"
     "\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
     "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,"
     "\"delta\":{\"type\":\"text_delta\",\"text\":\" tok\"}}\n\n",
     "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
     "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\","
     "\"stop_sequence\":null},\"usage\":{\"output_tokens\":{tokens}}}\n\n"
     "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"},
    // Ollama's /api/chat: NDJSON, each line with the model and a creation time (the response's own).
    {"ollama", "/api/chat", "application/x-ndjson", "\n{\"model", "",
     "{\"model\":\"bench\",\"created_at\":\"2025-01-02T03:04:05.{created}Z\",\"message\":{\"role\":\"assistant\","
     "\"content\":\" tok\"},\"done\":false}\n",
     "{\"model\":\"bench\",\"created_at\":\"2025-01-02T03:04:05.{created}Z\",\"message\":{\"role\":\"assistant\","
     "\"content\":\"\"},\"done\":true,\"done_reason\":\"stop\",\"prompt_eval_count\":8,\"eval_count\":{tokens},"
     "\"prompt_eval_duration\":1000000,\"eval_duration\":9000000}\n"},
};
static const char HEADERS[] = // %s: the shape's content type
    "HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n";
static const char REQUEST[] =  // %s: the shape's path
    "POST %s HTTP/1.1\r\nHost: bench\r\ncontent-type: application/json\r\n"
    "content-length: 48\r\n\r\n{\"model\":\"bench\",\"stream\":true,\"messages\":[]}   ";
static const char END_MARK[] = "0\r\n\r\n";     // the last chunk

struct stream {
    int fd;
    int remaining;  // events left in the response in flight; -1: waiting for a request
    long id;        // the response's number
    long created;   // when it began (s)
    char event[512];
    int event_len;  // the text event, with the response's own id and time
};

// `format` (a shape's events) with its placeholders filled in; its length.
static int fill(char *buf, int cap, const char *format, long id, long created, int tokens) {
    char values[4][24];
    const char *names[4] = {"{id}", "{created}", "{tokens}", "{total}"};
    snprintf(values[0], sizeof values[0], "%016lx", id);
    snprintf(values[1], sizeof values[1], "%ld", created);
    snprintf(values[2], sizeof values[2], "%d", tokens);
    snprintf(values[3], sizeof values[3], "%d", tokens + 8);
    int n = 0;
    while (*format && n < cap - 1) {
        int k = 0;
        while (k < 4 && strncmp(format, names[k], strlen(names[k])) != 0) k++;
        if (k < 4) {
            n += snprintf(buf + n, cap - n, "%s", values[k]);
            format += strlen(names[k]);
        } else {
            buf[n++] = *format++;
        }
    }
    buf[n < cap ? n : cap - 1] = 0;
    return n < cap ? n : cap - 1;
}

struct client {
    int fd;
    double sent_at;         // when its request went out
    int seen_first;         // its response's first event was read
    char tail[MARK_LEN];    // the last bytes read: a mark may span two reads
    int tail_len;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int send_chunk(int fd, const char *data, int len) {
    char buf[1024];
    int n = snprintf(buf, sizeof buf, "%x\r\n%.*s\r\n", len, len, data);
    return send(fd, buf, n, MSG_NOSIGNAL) == n ? 0 : -1;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int count_marks(const char *data, int len, const char *mark, int mark_len) {
    int found = 0;
    for (const char *at = data; (at = memmem(at, data + len - at, mark, mark_len)) != NULL; at += mark_len) found++;
    return found;
}

static int client_send(struct client *c, const char *request, int len) {
    c->sent_at = now_s();
    c->seen_first = 0;
    c->tail_len = 0;
    return send(c->fd, request, len, MSG_NOSIGNAL) == len ? 0 : -1;
}

int main(int argc, char **argv) {
    const struct shape *shape = &SHAPES[0];
    for (size_t i = 0; argc == 4 && i < sizeof SHAPES / sizeof *SHAPES; i++)
        if (strcmp(argv[3], SHAPES[i].name) == 0) shape = &SHAPES[i];
    if ((argc != 3 && argc != 4) || (argc == 4 && strcmp(argv[3], shape->name) != 0)) {
        fprintf(stderr, "usage: %s PORT TOKENS [vllm|bare|openai|starlette|anthropic|ollama] (commands on stdin)\n",
                argv[0]);
        return 2;
    }
    static char request_text[512], headers[256];
    int request_len = snprintf(request_text, sizeof request_text, REQUEST, shape->path);
    int headers_len = snprintf(headers, sizeof headers, HEADERS, shape->type);
    int port = atoi(argv[1]), tokens = atoi(argv[2]);
    double rate = 0;
    int listener = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, MAX_CONNECTIONS)) {
        perror("firehose: bind/listen");
        return 1;
    }
    printf("listening\n");
    fflush(stdout);

    static struct stream streams[MAX_CONNECTIONS];
    static struct client clients[MAX_CONNECTIONS];
    static struct pollfd fds[2 * MAX_CONNECTIONS + 2];
    static double ttfts[MAX_TTFTS];
    static char request[65536], last[1024], read_buf[MARK_LEN + 65536], line[256];
    int count = 0, nclients = 0, nttfts = 0, line_len = 0, gone = 0;  // gone: streams closed, to remove
    long written = 0, responses = 0, started = 0, received = 0, answered = 0;
    double next_at = now_s();
    int turn = 0;
    for (;;) {
        // Accept, read requests, responses and commands without blocking; write on schedule.
        fds[0] = (struct pollfd){.fd = listener, .events = POLLIN};
        for (int i = 0; i < count; i++) fds[1 + i] = (struct pollfd){.fd = streams[i].fd, .events = POLLIN};
        for (int i = 0; i < nclients; i++)
            fds[1 + count + i] = (struct pollfd){.fd = clients[i].fd, .events = POLLIN};
        int in = 1 + count + nclients;
        fds[in] = (struct pollfd){.fd = STDIN_FILENO, .events = POLLIN};
        double wait = next_at - now_s();
        poll(fds, in + 1, rate > 0 && wait <= 0.001 ? 0 : 1);
        if (fds[in].revents & (POLLIN | POLLHUP)) {
            ssize_t n = read(STDIN_FILENO, line + line_len, sizeof line - 1 - line_len);
            if (n <= 0) break;
            line_len += n;
            char *end;
            while ((end = memchr(line, '\n', line_len)) != NULL) {
                *end = 0;
                int wanted;
                if (sscanf(line, "clients %d", &wanted) == 1) {
                    for (int i = 0; i < nclients; i++) close(clients[i].fd);
                    nclients = 0;
                    for (int i = 0; i < wanted && i < MAX_CONNECTIONS; i++) {
                        int fd = socket(AF_INET, SOCK_STREAM, 0);
                        if (connect(fd, (struct sockaddr *)&addr, sizeof addr)) {
                            perror("firehose: connect");
                            close(fd);
                            break;
                        }
                        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                        clients[nclients] = (struct client){.fd = fd};
                        client_send(&clients[nclients++], request_text, request_len);
                    }
                } else if (strcmp(line, "report") == 0) {
                    qsort(ttfts, nttfts, sizeof *ttfts, by_value);
                    double p50 = nttfts ? ttfts[nttfts / 2] : 0, p99 = nttfts ? ttfts[(int)(0.99 * (nttfts - 1))] : 0;
                    printf("received %ld %ld %.0f %.0f\n", received, answered, p50 * 1e6, p99 * 1e6);
                    fflush(stdout);
                    received = answered = nttfts = 0;
                } else {
                    rate = atof(line);
                    next_at = now_s();
                }
                line_len -= end + 1 - line;
                memmove(line, end + 1, line_len);
            }
            if (line_len == sizeof line - 1) line_len = 0;  // a line too long to be a command
            continue;  // the clients' fds may have moved
        }
        for (int i = 0; i < nclients; i++) {
            struct client *c = &clients[i];
            if (!(fds[1 + count + i].revents & (POLLIN | POLLHUP))) continue;
            memcpy(read_buf, c->tail, c->tail_len);
            ssize_t n = recv(c->fd, read_buf + c->tail_len, sizeof read_buf - MARK_LEN, 0);
            if (n <= 0) continue;  // the server side went away: the benchmark is over
            int len = c->tail_len + (int)n;
            // A mark is longer than the tail kept: each one counted holds new bytes.
            received += count_marks(read_buf, len, shape->mark, MARK_LEN);
            if (!c->seen_first && memmem(read_buf, len, shape->mark + 1, MARK_LEN - 1)) {
                if (nttfts < MAX_TTFTS) ttfts[nttfts++] = now_s() - c->sent_at;
                c->seen_first = 1;
            }
            int ended = len >= (int)sizeof END_MARK - 1 &&
                        memcmp(read_buf + len - (sizeof END_MARK - 1), END_MARK, sizeof END_MARK - 1) == 0;
            c->tail_len = len < MARK_LEN - 1 ? len : MARK_LEN - 1;
            memcpy(c->tail, read_buf + len - c->tail_len, c->tail_len);
            if (ended) {
                answered++;
                client_send(c, request_text, request_len);
            }
        }
        for (int i = 0; i < count; i++) {
            if (!(fds[1 + i].revents & (POLLIN | POLLHUP)) || streams[i].remaining >= 0) continue;
            ssize_t n = recv(streams[i].fd, request, sizeof request, 0);
            if (n <= 0) {  // the client went away
                close(streams[i].fd);
                streams[i].fd = -1;
                gone = 1;
                continue;
            }
            if (send(streams[i].fd, headers, headers_len, MSG_NOSIGNAL) > 0) {
                struct stream *s = &streams[i];
                s->remaining = tokens;
                s->id = ++started;
                s->created = time(NULL);
                s->event_len = fill(s->event, sizeof s->event, shape->text, s->id, s->created, tokens);
                if (*shape->start) {
                    int len = fill(last, sizeof last, shape->start, s->id, s->created, tokens);
                    send_chunk(s->fd, last, len);
                }
            }
        }
        // Streams and clients are indexed as polled until here: only now do they move.
        for (int i = 0; gone && i < count; i++)
            if (streams[i].fd < 0) streams[i--] = streams[--count];
        gone = 0;
        if ((fds[0].revents & POLLIN) && count < MAX_CONNECTIONS) {
            int fd = accept(listener, NULL, NULL);
            if (fd >= 0) {
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                streams[count++] = (struct stream){.fd = fd, .remaining = -1};
            }
        }
        // Events due by now, round-robin over the streams that have a response in flight; at most
        // BURST before the clients read again (a blocking write to a client of this very loop
        // that had stopped reading would never return).
        int due = 0;
        for (double t = now_s(); rate > 0 && next_at <= t && count > 0 && due < BURST; next_at += 1.0 / rate, due++) {
            int busy = -1;
            for (int k = 0; k < count; k++) {
                int i = (turn + k) % count;
                if (streams[i].remaining > 0) {
                    busy = i;
                    break;
                }
            }
            if (busy < 0) {
                next_at = t;  // nobody is waiting for tokens: do not bank the time
                break;
            }
            turn = busy + 1;
            struct stream *s = &streams[busy];
            if (send_chunk(s->fd, s->event, s->event_len) != 0) {  // its client went away mid-response
                close(s->fd);
                s->fd = -1;
                s->remaining = -1;
                gone = 1;
                continue;
            }
            written++;
            if (--s->remaining == 0) {
                int len = fill(last, sizeof last, shape->last, s->id, s->created, tokens);
                send_chunk(s->fd, last, len);
                send(s->fd, END_MARK, sizeof END_MARK - 1, MSG_NOSIGNAL);
                s->remaining = -1;
                responses++;
            }
        }
    }
    printf("written %ld %ld\n", written, responses);
    return 0;
}
