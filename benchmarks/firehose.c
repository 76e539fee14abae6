// A streaming server for the hot-path benchmark: it must never be the bottleneck.
//
// Serves keep-alive POSTs on 127.0.0.1:PORT. Each response is an SSE stream of
// TOKENS OpenAI chat-completion chunks as vLLM writes them, chunked transfer encoding,
// one write() per chunk (what uvicorn and most servers do at low load), paced so that all
// connections together write RATE events per second. Each line read on stdin
// sets a new RATE (0 pauses); at the end of stdin it prints one line,
// "written EVENTS RESPONSES", and exits.
//
//   cc -O2 -o firehose firehose.c && ./firehose PORT TOKENS
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

static const char HEADERS[] =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
static const char EVENT[] =
    "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,"
    "\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok\"},\"finish_reason\":null}]}\n\n";
static const char LAST[] =
    "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,"
    "\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],"
    "\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n"
    "data: [DONE]\n\n";

struct stream {
    int fd;
    int remaining;  // events left in the response in flight; -1: waiting for a request
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

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PORT TOKENS (rates on stdin)\n", argv[0]);
        return 2;
    }
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

    struct stream streams[MAX_CONNECTIONS];
    struct pollfd fds[MAX_CONNECTIONS + 2];
    int count = 0;
    long written = 0, responses = 0;
    char request[65536], last[512];
    double next_at = now_s();
    int turn = 0;
    for (;;) {
        // Accept, read requests and rates without blocking; write on schedule.
        fds[0] = (struct pollfd){.fd = listener, .events = POLLIN};
        for (int i = 0; i < count; i++) fds[i + 1] = (struct pollfd){.fd = streams[i].fd, .events = POLLIN};
        fds[count + 1] = (struct pollfd){.fd = STDIN_FILENO, .events = POLLIN};
        double wait = next_at - now_s();
        poll(fds, count + 2, rate > 0 && wait <= 0.001 ? 0 : 1);
        if (fds[count + 1].revents & (POLLIN | POLLHUP)) {
            char line[64];
            ssize_t n = read(STDIN_FILENO, line, sizeof line - 1);
            if (n <= 0) break;
            line[n] = 0;
            rate = atof(line);
            next_at = now_s();
        }
        if ((fds[0].revents & POLLIN) && count < MAX_CONNECTIONS) {
            int fd = accept(listener, NULL, NULL);
            if (fd >= 0) {
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                streams[count++] = (struct stream){.fd = fd, .remaining = -1};
            }
        }
        for (int i = 0; i < count; i++) {
            if (!(fds[i + 1].revents & (POLLIN | POLLHUP)) || streams[i].remaining >= 0) continue;
            ssize_t n = recv(streams[i].fd, request, sizeof request, 0);
            if (n <= 0) {  // the client went away
                close(streams[i].fd);
                streams[i--] = streams[--count];
                continue;
            }
            if (send(streams[i].fd, HEADERS, sizeof HEADERS - 1, MSG_NOSIGNAL) > 0) streams[i].remaining = tokens;
        }
        // Events due by now, round-robin over the streams that have a response in flight.
        for (double t = now_s(); rate > 0 && next_at <= t && count > 0; next_at += 1.0 / rate) {
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
            if (send_chunk(s->fd, EVENT, sizeof EVENT - 1) == 0) written++;
            if (--s->remaining == 0) {
                int len = snprintf(last, sizeof last, LAST, tokens, tokens + 8);
                send_chunk(s->fd, last, len);
                send(s->fd, "0\r\n\r\n", 5, MSG_NOSIGNAL);
                s->remaining = -1;
                responses++;
            }
        }
    }
    printf("written %ld %ld\n", written, responses);
    return 0;
}
