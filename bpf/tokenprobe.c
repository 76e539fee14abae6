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

// One file per concern, in this order: each uses what the ones before it define. The agent writes
// them in place before BCC compiles the whole (agent/capture/kernel/loader.py, program_source).
#include "shared.c"
#include "steady.c"
#include "connections.c"
#include "data_io.c"
#include "openssl.c"
#include "go_tls.c"
