"""Load bpf/tokenprobe.c with BCC, choose targets, and deliver the ring buffer's records
(decoded by records.py) to the agent."""

from __future__ import annotations

import ctypes
import glob
import importlib.resources
import ipaddress
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .btf import BtfError, socket_offset_flags
from .go_tls import GO_TLS_HANDSHAKES, GO_TLS_READ, GO_TLS_WRITE
from .headers import HeaderChoice, choose_headers
from .privileges import bpf_refusal, try_bpf_load, uprobe_refusal
from .procfs import ListenerScan, own_tcp_ports, target_port_sockets
from .records import (
    _STEADY_HEADER,
    HEAD_CAP,
    STEADY_PART_CAP,
    STEADY_PART_MIN,
    STEADY_WORDS,
    TAIL_CAP,
    EventDecodeError,
    KernelEvent,
    SteadyBatch,
    SteadyShape,
    UnseenEnd,
    decode_event,
    decode_steady_batch,
    steady_template_fits,
)
from .tls_libraries import ElfTls, elf_tls, mapped_elves

log = logging.getLogger("tokenprobe.probes")

# An include of one of bpf/'s own files: `#include "name.c"`.
_LOCAL_INCLUDE = re.compile(r'#include "([\w.]+)"')

MAX_EXE_PATHS = 8  # up to MAX_EXES executables, each as given and resolved
MAX_EXES = 4
EXE_PATH_LEN = 256
MAX_TARGET_PORTS = 256  # the target_ports map's size
# The longest the agent waits for the kernel's wakeup before reading what came meanwhile. Each wait
# that ends costs a round's fixed work and a cold start of the next; at 10k events/s (the kernel then
# wakes no one: bpf/shared.c) 250 ms in place of 100 took the main thread from 15.5 to 12.3 ms of
# CPU a second. A row comes at most this much later; its times are the kernel's.
POLL_TIMEOUT_MS = 250

CFG_TRACK_OUTBOUND, CFG_EXE_PATHS, CFG_SELF_TGID = 0, 1, 2
# The slots of map_overflows (enum map_slot in bpf/shared.c), by map name.
MAP_OVERFLOW_SLOTS = ("conns", "listeners", "io_pending", "ssl_pending", "accept_pending", "connect_pending",
                      "bind_pending")
# Every map of the program (docs/operations.md, "Bounded state", says how each stays bounded).
KERNEL_MAPS = ("events", "scratch", "drops", "map_overflows", "conns_fill", "config", "exe_paths", "conns",
               "target_ports", "target_tgids", "active_tgids", "listeners", "bind_pending", "listener_tgids",
               "io_pending", "accept_pending", "connect_pending", "ssl_pending", "ssl_fd", "bio_conn",
               "cipher_read", "written_record_ssl", "go_tls_pending", "go_tcp_conn_itab_hashes", "steady_templates",
               "steady_batches", "steady_empty", "iov_walks", "iov_more", "ring_sent", "unseen_ends", "own_conns",
               "own_fds")
# The agent's connect returns around the moment the server's accept does, on either side of it.
OWN_CONNECT_SLACK_NS = 1_000_000_000

# (symbol, entry handler, return handler or None). Both OpenSSL call
# families: CPython calls the _ex forms, nginx and most C servers the classic
# ones. SSL_set_fd binds an SSL object to its socket, SSL_set_bio names a fresh
# read BIO, SSL_free unbinds it. A copy that lacks some (BoringSSL has no _ex
# forms) is probed through those it has.
SSL_PROBES = (
    ("SSL_read", "uprobe_ssl_read", "uretprobe_ssl_read"),
    ("SSL_read_ex", "uprobe_ssl_read_ex", "uretprobe_ssl_read_ex"),
    ("SSL_write", "uprobe_ssl_write", "uretprobe_ssl_write"),
    ("SSL_write_ex", "uprobe_ssl_write_ex", "uretprobe_ssl_write_ex"),
    ("SSL_do_handshake", "uprobe_ssl_handshake", "uretprobe_ssl_handshake"),
    ("SSL_set_fd", "uprobe_ssl_set_fd", None),
    ("SSL_set_bio", "uprobe_ssl_set_bio", None),
    ("SSL_free", "uprobe_ssl_free", None),
)
# In libcrypto, or in the program OpenSSL is linked into: memory BIOs are fed,
# and records written out, with BIO_write, and libssl reads an SSL object's
# read BIO with BIO_read (bpf/openssl.c ties the two to bind the SSL object
# to its socket).
CRYPTO_PROBES = (("BIO_write", "uprobe_bio_write", None), ("BIO_read", "uprobe_bio_read", None))
# Go crypto/tls function → (entry handler, handler put on each of its RET instructions, or None:
# Write is read whole at its entry, see bpf/go_tls.c).
GO_TLS_PROBES = {
    GO_TLS_READ: ("uprobe_go_tls_read", "uprobe_go_tls_read_ret"),
    GO_TLS_WRITE: ("uprobe_go_tls_write", None),
    **{name: ("uprobe_go_tls_handshake", "uprobe_go_tls_handshake_ret") for name in GO_TLS_HANDSHAKES},
}


@dataclass(frozen=True)
class MapSizes:
    """Entries of the kernel maps that grow with the node's load (compile-time constants)."""

    conns: int = 65536       # tracked connections (ssl_fd and bio_conn hold as many)
    tgids: int = 16384       # target processes, owners of tracked connections, listeners' processes
    listeners: int = 16384   # listening sockets of target ports
    pending: int = 16384     # threads inside a traced call at once (each *_pending map)

    def cflags(self) -> list[str]:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"map size {name} must be at least 1")
        return [f"-DMAX_CONNS={self.conns}", f"-DMAX_TGIDS={self.tgids}", f"-DMAX_LISTENERS={self.listeners}",
                f"-DMAX_PENDING={self.pending}"]


class ProbeError(RuntimeError):
    """The probes cannot be loaded here; the message says why and what to do."""



@dataclass
class Targets:
    """What to watch. A connection is tracked if any of these selects it."""

    ports: list[int] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    exes: list[str] = field(default_factory=list)
    outbound: bool = False  # also track connect()s made by target processes
    pods: bool = False  # processes of selected pods, added as target pids while running (agent/identity/)

    def validate(self) -> None:
        if not (self.ports or self.pids or self.exes or self.pods):
            raise ValueError("no targets: give at least one --port, --pid, --exe, --namespace or --pod-selector")
        if len(set(self.ports)) > MAX_TARGET_PORTS:
            raise ValueError(f"at most {MAX_TARGET_PORTS} --port targets")
        for port in self.ports:
            if not 0 < port < 65536:
                raise ValueError(f"port {port} is not a TCP port")
        for pid in self.pids:
            if not Path(f"/proc/{pid}").exists():
                raise ValueError(f"no process with pid {pid}")
        if len(self.exes) > MAX_EXES:
            raise ValueError(f"at most {MAX_EXES} --exe paths")
        if self.outbound and not (self.pids or self.exes):
            raise ValueError("--outbound tracks connect()s of target processes: give --pid or --exe")


def ensure_tracefs() -> str:
    """Mounts tracefs if needed (BCC reads tracepoint layouts from it)."""
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.exists(os.path.join(path, "events")):
            return path
    try:
        os.makedirs("/sys/kernel/tracing", exist_ok=True)
        rc = os.system("mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null")
    except OSError as exc:
        raise ProbeError(f"tracefs is not mounted and mounting it failed: {exc}") from exc
    if rc != 0 or not os.path.exists("/sys/kernel/tracing/events"):
        raise ProbeError("tracefs is not mounted and could not be mounted; run "
                         "'mount -t tracefs nodev /sys/kernel/tracing' as root")
    return "/sys/kernel/tracing"


@dataclass(frozen=True)
class OpenSsl:
    """One copy of OpenSSL to probe."""

    path: str               # the file exporting the SSL API: a libssl, or a program with OpenSSL linked in
    api: frozenset[bytes]   # the probed functions it exports
    crypto: str | None      # the file exporting BIO_write beside it (its libcrypto, or itself), if any


def openssl_copies(pids: Iterable[int] | None = None, first: Iterable[int] = ()) -> list[OpenSsl]:
    """Every copy of OpenSSL that processes map (through /proc/PID/root, so that those
    inside containers are found), found by what the files export rather than by their
    names, plus the system's own; one per file. A file several processes map is named
    through the first of them, those in `first` before the rest: a name through a process
    that has exited cannot be probed, and servers outlive the short-lived processes around
    them (from the agent's container, the host's libssl is reached only through such names)."""
    found: dict[tuple[int, int], OpenSsl] = {}

    def add(path: str, crypto_candidates: list[tuple[str, ElfTls]], file_id=None) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        tls = elf_tls(path, file_id)
        if not tls.openssl_io or (st.st_dev, st.st_ino) in found:
            return
        crypto = path if b"BIO_write" in tls.openssl else next(
            (other for other, other_tls in crypto_candidates if b"BIO_write" in other_tls.openssl), None)
        found[(st.st_dev, st.st_ino)] = OpenSsl(path, tls.openssl, crypto)

    # The system's own first, so that its plain path names the common case.
    for pattern in ("/usr/lib/*/libssl.so.3", "/usr/lib/libssl.so.3", "/lib/*/libssl.so.1.1",
                    "/usr/lib/*/libssl.so.1.1"):
        for path in glob.glob(pattern):
            crypto = path.replace("libssl", "libcrypto")
            add(path, [(crypto, elf_tls(crypto))])
    proc_pids = pids if pids is not None else [int(p) for p in os.listdir("/proc") if p.isdigit()]
    first = list(first)
    looked_at_first = set(first)
    for pid in [*first, *(pid for pid in proc_pids if pid not in looked_at_first)]:
        root = f"/proc/{pid}/root"
        try:
            held = [(root + elf.path, elf_tls(root + elf.path, elf.file_id), elf.file_id) for elf in mapped_elves(pid)]
        except OSError:
            continue
        for path, tls, file_id in held:
            if tls.openssl_io:
                add(path, [(other, other_tls) for other, other_tls, _ in held], file_id)
    return list(found.values())


def program_source() -> str:
    """bpf/tokenprobe.c with the files it includes (one per concern, from bpf/) written in place. BCC
    is given the one text: it rewrites TRACEPOINT_PROBE only in the file it compiles, not in includes."""
    bpf_dir = importlib.resources.files("tokenprobe.bpf")

    def inlined(line: str) -> str:
        match = _LOCAL_INCLUDE.match(line)
        return bpf_dir.joinpath(match[1]).read_text() if match else line

    return "".join(inlined(line) for line in bpf_dir.joinpath("tokenprobe.c").read_text().splitlines(keepends=True))


# The compiler's libraries (BCC links LLVM and clang), named in /proc/self/maps: used by the compile only.
COMPILER_LIBRARY = re.compile(r"/lib(?:LLVM|clang)[^/]*\.so")
MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim the range now; dirty pages are written to swap or kept, never lost


def release_compiler_memory() -> None:
    """After the compile: hands the C heap's free pages back to the kernel (LLVM frees what it took, but
    glibc keeps much of it: 37 MiB here), and lets go of the pages of the compiler's libraries the compile
    read (85 MiB of LLVM's and clang's code here), which the agent never runs again. Where either call is
    missing (no glibc, an older kernel) that part is left to the kernel's reclaim."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and COMPILER_LIBRARY.search(fields[5]):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                libc.madvise(start, end - start, MADV_PAGEOUT)


def _bcc():
    try:
        import bcc  # Debian's python3-bpfcc, linked into the venv
        import bcc.utils
    except ImportError as exc:
        raise ProbeError("BCC's Python module is missing: install Debian's python3-bpfcc "
                         "(scripts/install.sh links it into the venv)") from exc
    return bcc


class Probes:
    """The loaded BPF program: targets in, decoded events out."""

    def __init__(self, targets: Targets, *, ringbuf_pages: int = 4096,
                 headers: HeaderChoice | None = None, map_sizes: MapSizes = MapSizes()) -> None:
        targets.validate()
        self.targets = targets
        self.headers = headers or choose_headers()
        self.attached_ssl: list[str] = []
        # (device, inode) of each attached copy: in a container, /proc/PID/root/usr/lib/... of a host process
        # resolves (realpath) to the container's own /usr/lib/..., another file that has the same name.
        self._ssl_files: set[tuple[int, int]] = set()
        self.unprobed_ssl: dict[str, str] = {}  # real path → why its uprobes did not attach (doctor names them)
        self.attached_go_tls: list[str] = []
        self._go_files: set[tuple[str, int]] = set()  # (device, inode) of each mapped file looked at
        self.decode_errors = 0
        self._full_maps: set[str] = set()
        # Map entries the agent itself could not store (listeners learnt from /proc).
        self._refused: dict[str, int] = {}
        self._conns_added = 0  # the agent's own inserts less its deletes (conns_fill[1])
        self._configured_ns = 0  # when the kernel knew the agent's tgid (own_conns noted from then on)
        self._listeners = ListenerScan(set(targets.ports))
        self._ssl_scanned = False  # whether attach_ssl read every process's map once
        # A kernel that refuses bpf() itself (capabilities, seccomp) is said now, not blamed on the headers
        # after a compile of up to a minute.
        refused = try_bpf_load()
        if refused > 0:
            raise ProbeError(f"the BPF program cannot load: {bpf_refusal(refused)}")
        ensure_tracefs()
        if self.headers.kernel_source is not None:
            os.environ["BCC_KERNEL_SOURCE"] = str(self.headers.kernel_source)
        log.info("%s", self.headers.note)
        source = program_source()
        if ringbuf_pages & (ringbuf_pages - 1):
            raise ValueError("ring buffer pages must be a power of two")
        bcc = _bcc()
        cpus = max(bcc.utils.get_possible_cpus()) + 1  # the scratch records are indexed by CPU id
        cflags = [f"-DHEAD_CAP={HEAD_CAP}", f"-DTAIL_CAP={TAIL_CAP}", f"-DRINGBUF_PAGES={ringbuf_pages}",
                  f"-DNR_CPUS_POSSIBLE={cpus}", *map_sizes.cflags(), "-w"]
        try:
            cflags += socket_offset_flags()
        except BtfError as exc:
            log.warning("%s: accepted sockets' addresses are read from /proc instead of the kernel", exc)
        try:
            self.bpf = bcc.BPF(text=source, cflags=cflags)
            # Vectored calls past MAX_IOV iovecs are captured on in this program, tail-called.
            more = self.bpf.load_func("capture_iov_more", bcc.BPF.TRACEPOINT)
        except Exception as exc:  # BCC raises bare Exceptions on compile/load failure
            raise ProbeError(f"the BPF program did not load: {' '.join(str(exc).split())}. {self.headers.note}") \
                from exc
        finally:
            release_compiler_memory()
        self.bpf["iov_more"][ctypes.c_int(0)] = ctypes.c_int(more.fd)
        self._configure()
        self.attach_ssl()
        self.attach_go_tls()

    # -- configuration -------------------------------------------------
    def _configure(self) -> None:
        ports = self.bpf["target_ports"]
        for port in self.targets.ports:
            ports[ctypes.c_uint16(port)] = ctypes.c_uint8(1)
        for pid in self.targets.pids:
            self.add_target_pid(pid)
        config = self.bpf["config"]
        config[ctypes.c_int(CFG_TRACK_OUTBOUND)] = ctypes.c_uint32(int(self.targets.outbound))
        config[ctypes.c_int(CFG_SELF_TGID)] = ctypes.c_uint32(os.getpid())
        exe_table = self.bpf["exe_paths"]
        paths = self._exe_variants()
        for i, path in enumerate(paths):
            leaf = exe_table.Leaf()
            raw = path.encode()[:EXE_PATH_LEN - 1]
            ctypes.memmove(ctypes.addressof(leaf), raw, len(raw))
            exe_table[ctypes.c_int(i)] = leaf
        config[ctypes.c_int(CFG_EXE_PATHS)] = ctypes.c_uint32(len(paths))
        self._configured_ns = time.monotonic_ns()
        self.rescan_processes()
        self.adopt_established()

    def _exe_variants(self) -> list[str]:
        """The paths exec() may be called with for each target executable."""
        paths: list[str] = []
        for exe in self.targets.exes:
            for variant in (exe, os.path.realpath(exe)):
                if variant not in paths:
                    paths.append(variant)
        return paths[:MAX_EXE_PATHS]

    def add_target_pid(self, pid: int) -> None:
        self.bpf["target_tgids"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    def rescan_processes(self) -> list[int]:
        """Tells the kernel about listening sockets of target ports and
        running processes of target executables that it cannot have seen
        (started before us, forked workers, exec'd through another path)."""
        listening = self._listeners.scan() if self.targets.ports else []
        listeners, listener_tgids = self.bpf["listeners"], self.bpf["listener_tgids"]
        # Pruned to what listens now: bind() adds entries in the kernel that
        # outlive their sockets and processes.
        now = {(sock.pid, sock.fd): sock for sock in listening}
        for key in list(listeners.keys()):
            if (key.tgid, key.fd) not in now:
                self._delete(listeners, key)
        for sock in listening:
            key = listeners.Key()
            key.tgid, key.fd = sock.pid, sock.fd
            if not self._put("listeners", key, ctypes.c_uint16(sock.local_port)):
                break
            listener_tgids[ctypes.c_uint32(sock.pid)] = ctypes.c_uint8(1)
        if not self.targets.exes:
            return []
        # Compared as paths, not inodes: /proc/PID/exe reads as the path in the
        # process's own mount namespace, so container paths match as given.
        wanted = set(self._exe_variants())
        added = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                exe = os.readlink(f"/proc/{entry}/exe")
            except OSError:
                continue
            if exe in wanted:
                self.add_target_pid(int(entry))
                added.append(int(entry))
        return added

    def adopt_established(self) -> int:
        """Tracks connections on target ports that were open before the
        probes attached (keep-alive pools live long); their first bytes may
        be mid-request, which the assembler resynchronises on. Not the agent's own: its samplers start
        while the probes load, and a scrape then in progress has no own_conns entry."""
        _, established = target_port_sockets(set(self.targets.ports))
        own = own_tcp_ports() if established else set()
        conns = self.bpf["conns"]
        for sock in established:
            if sock.pid == os.getpid() or (sock.peer_port, sock.local_port) in own:
                continue
            key, info = conns.Key(), conns.Leaf()
            key.tgid, key.fd = sock.pid, sock.fd
            info.local_port, info.peer_port = sock.local_port, sock.peer_port
            raw = ipaddress.IPv6Address(f"::ffff:{sock.peer_addr}" if "." in sock.peer_addr else sock.peer_addr).packed
            ctypes.memmove(ctypes.addressof(info) + type(info).peer_addr.offset, raw, 16)
            if not self._has(conns, key):
                self._conns_added += 1
            conns[key] = info
            self.bpf["active_tgids"][ctypes.c_uint32(sock.pid)] = ctypes.c_uint8(1)
        self._write_conns_fill()
        return len(established)

    def attach_ssl(self) -> list[str]:
        """Attaches the OpenSSL uprobes to every copy of OpenSSL not yet attached: at the first
        call, those any process maps; later (the rescans), those the processes the kernel watches
        map (targets, listeners on target ports, owners of tracked connections). A process that
        starts later joins those at its first bind() on a target port, exec() of a target or
        tracked connection. Reading every process's memory map at every rescan cost more the
        larger the node (5 ms a rescan with this machine's 76 processes, more where servers map
        thousands of libraries)."""
        watched = sorted(self._watched_tgids())
        pids = watched if self._ssl_scanned else None
        self._ssl_scanned = True
        new = []
        for copy in openssl_copies(pids, first=watched):
            try:
                st = os.stat(copy.path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in self._ssl_files:
                continue
            try:
                self._attach(copy.path, [probe for probe in SSL_PROBES if probe[0].encode() in copy.api])
            except Exception as exc:  # BCC raises bare Exceptions when a uprobe does not attach
                refused = uprobe_refusal()
                self.unprobed_ssl[os.path.realpath(copy.path)] = f"{exc}" + (f": {refused.cause}" if refused else "")
                log.warning("OpenSSL in %s not probed: %s%s", copy.path, exc, f" ({refused})" if refused else "")
                continue
            try:
                if copy.crypto is None:
                    raise ValueError("no file beside it exports BIO_write")
                self._attach(copy.crypto, CRYPTO_PROBES)
            except Exception as exc:
                log.warning("BIO_write and BIO_read of %s not probed (%s): TLS through memory BIOs (asyncio, "
                            "Node.js) is not followed", copy.path, exc)
            self._ssl_files.add((st.st_dev, st.st_ino))
            self.attached_ssl.append(copy.path)
            new.append(copy.path)
        return new

    def _watched_tgids(self) -> set[int]:
        """The processes the kernel watches: targets, listeners on target ports, owners of tracked connections."""
        return {key.value for table in ("target_tgids", "listener_tgids", "active_tgids") for key in self.bpf[table]}

    def attach_go_tls(self) -> list[str]:
        """Attaches the Go crypto/tls probes to the files mapped by the processes the kernel
        watches (targets, and listeners on target ports) not looked at yet; the paths attached.
        One that cannot be probed is left to tls_reach, which names why."""
        new = []
        for tgid in sorted(self._watched_tgids()):
            try:
                mapped = [elf for elf in mapped_elves(tgid) if elf.file_id not in self._go_files]
            except OSError:
                continue
            for elf in mapped:
                self._go_files.add(elf.file_id)
                path = f"/proc/{tgid}/root{elf.path}"
                go = elf_tls(path, elf.file_id).go
                if go is None:
                    continue
                try:  # a full hash map (more than 64 Go executables) raises here too
                    self.bpf["go_tcp_conn_itab_hashes"][ctypes.c_uint32(go.tcp_conn_itab_hash)] = ctypes.c_uint8(1)
                    for function, rets in go.returns.items():
                        entry, ret = GO_TLS_PROBES[function]
                        self.bpf.attach_uprobe(name=path, sym=function, sym_off=go.entries[function], fn_name=entry)
                        for offset in rets if ret else ():
                            self.bpf.attach_uprobe(name=path, sym=function, sym_off=offset, fn_name=ret)
                except Exception as exc:  # BCC raises bare Exceptions (uprobe quota, vanished file)
                    log.warning("Go crypto/tls in %s not probed: %s", path, exc)
                    continue
                self.attached_go_tls.append(f"{path} ({go.version})")
                new.append(path)
        return new

    def _attach(self, path: str, probes) -> None:
        for sym, entry, ret in probes:
            self.bpf.attach_uprobe(name=path, sym=sym, fn_name=entry)
            if ret:
                self.bpf.attach_uretprobe(name=path, sym=sym, fn_name=ret)

    # -- events --------------------------------------------------------
    def open(self, on_event: Callable[[KernelEvent], None]) -> None:
        """Starts delivering events to on_event from poll()."""

        def callback(_ctx, data, size):
            raw = ctypes.string_at(data, size)
            try:
                event = decode_event(raw)
            except EventDecodeError as exc:
                self.decode_errors += 1
                if self.decode_errors <= 5:
                    log.warning("skipped a malformed kernel event: %s", exc)
                return 0
            on_event(event)
            return 0

        self._callback = callback  # keep a reference: BCC holds only a C pointer
        self.bpf["events"].open_ring_buffer(callback)

    def poll(self, timeout_ms: int = POLL_TIMEOUT_MS) -> None:
        """Delivers what the ring buffer holds, after waiting up to timeout_ms for a wakeup. The
        kernel wakes the agent only every RING_WAKE_EVERY records (bpf/shared.c), so what came
        meanwhile is read after the wait, many records to the round."""
        self.bpf.ring_buffer_poll(timeout_ms)
        self.bpf.ring_buffer_consume()

    def drops(self) -> int:
        return int(sum(self.bpf["drops"][ctypes.c_int(0)]))

    def map_overflows(self) -> dict[str, int]:
        """Per map that can overflow, entries it could not take since the probes loaded."""
        counts = self.bpf["map_overflows"]
        overflows = {name: int(sum(counts[ctypes.c_int(slot)])) for slot, name in enumerate(MAP_OVERFLOW_SLOTS)}
        for name, refused in self._refused.items():
            overflows[name] = overflows.get(name, 0) + refused
        return overflows

    def map_sizes(self) -> dict[str, int]:
        """Every map's capacity in entries, as loaded (the ring buffer's in bytes)."""
        return {name: int(self.bpf[name].max_entries) for name in KERNEL_MAPS}

    def forget_connection(self, tgid: int, fd: int, generation: int) -> None:
        """Stops kernel-side tracking of a connection the agent does not want (or whose process is gone):
        the one of ``generation`` (its accept time, 0 adopted), not a newer one on its fd."""
        conns = self.bpf["conns"]
        key = self._conn_key(conns, tgid, fd)
        entry = self._lookup(conns, key)
        if entry is not None and entry.accept_ns != generation:
            return  # a newer connection's by now: records reach the agent up to POLL_TIMEOUT_MS late
        if entry is not None and self._delete(conns, key):
            self._conns_added -= 1
            self._write_conns_fill()
        # Also when the LRU evicted its entry: what it left in the steady maps is nobody's, and a plain hash
        # keeps it until another connection is accepted on the fd (for a process that died: never).
        self._forget_steady(tgid, fd)

    def own_connection(self, peer_port: int, local_port: int, accept_ns: int) -> bool:
        """Whether the connection a server accepted at ``accept_ns`` (kernel time) from ``peer_port`` on its
        ``local_port`` is one the agent itself opened (own_conns, bpf/tokenprobe.c): the agent's socket with
        those ports was open then. A later connection reusing the ports is not it: that socket had closed."""
        table = self.bpf["own_conns"]
        key = table.Key()
        key.local_port, key.remote_port = peer_port, local_port
        own = self._lookup(table, key)
        if own is None:
            # Accepted before the kernel knew the agent (its samplers start while the probes load): the
            # agent's open sockets are read instead, for these few connections only.
            return (accept_ns <= self._configured_ns + OWN_CONNECT_SLACK_NS
                    and (peer_port, local_port) in own_tcp_ports())
        return own.open_ns <= accept_ns + OWN_CONNECT_SLACK_NS and (own.close_ns == 0 or own.close_ns >= accept_ns)

    def _forget_steady(self, tgid: int, fd: int) -> None:
        for name in ("steady_templates", "steady_batches"):
            table = self.bpf[name]
            self._delete(table, self._conn_key(table, tgid, fd))

    @staticmethod
    def _conn_key(table, tgid: int, fd: int):
        key = table.Key()
        key.tgid, key.fd = tgid, fd
        return key

    def restart_connection(self, tgid: int, fd: int, generation: int) -> None:
        """An idle connection the agent forgot (the one of ``generation``): its kernel entry is kept
        (should it speak again) but made one adopted at start, without accept time or counters, so
        that the agent follows it afresh under a new conn_id, and nothing before reads as lost."""
        table = self.bpf["conns"]
        key = self._conn_key(table, tgid, fd)
        info = self._lookup(table, key)
        if info is not None and info.accept_ns != generation:
            return  # a newer connection's by now
        self._forget_steady(tgid, fd)  # its template is learnt again from what it says next
        if info is None:  # closed meanwhile, or evicted from the LRU
            return
        info.accept_ns = 0
        for direction in (0, 1):
            info.bytes[direction], info.events[direction] = 0, 0
        table[key] = info

    def _write_conns_fill(self) -> None:
        self.bpf["conns_fill"][ctypes.c_int(1)] = ctypes.c_int64(self._conns_added)

    @staticmethod
    def _lookup(table, key):
        """The map's entry at ``key``, or None."""
        try:
            return table[key]
        except KeyError:
            return None

    @staticmethod
    def _has(table, key) -> bool:
        return Probes._lookup(table, key) is not None

    def arm_steady(self, tgid: int, fd: int, template: SteadyShape) -> bool:
        """Names the bytes around the text of the connection's steady writes: the kernel batches
        those that match from the next but one on (bpf/steady.c). False
        when the map is full (the connection's writes stay whole events)."""
        if not steady_template_fits(template):
            raise ValueError(f"a steady template's prefix holds {STEADY_PART_MIN}..{STEADY_PART_CAP} bytes, "
                             f"its suffix 1..{STEADY_PART_CAP}")
        table = self.bpf["steady_templates"]
        leaf = table.Leaf()
        prefix, suffix = template.prefix, template.suffix
        leaf.prefix_len, leaf.suffix_len, leaf.hold = len(prefix), len(suffix), 1
        exact, digits, plain = bytearray(b"\xff" * len(prefix)), bytearray(len(prefix)), bytearray(len(prefix))
        for spans, kind in ((template.digits, digits), (template.plain, plain)):
            for start, end in spans:
                exact[start:end] = bytes(end - start)
                kind[start:end] = b"\xff" * (end - start)
        base, fields = ctypes.addressof(leaf), type(leaf)
        for name, part in (("prefix", prefix), ("exact", exact), ("digits", digits), ("plain", plain),
                           ("suffix", suffix.rjust(8, b"\0"))):  # one shorter than a word ends it (bpf/steady.c)
            ctypes.memmove(base + getattr(fields, name).offset, bytes(part), len(part))
        return self._put("steady_templates", self._conn_key(table, tgid, fd), leaf)

    def take_steady_batch(self, tgid: int, fd: int) -> SteadyBatch | None:
        """The batch a connection of a process that is gone left in the kernel (no close()
        sent it), removed from the kernel; None if there is none."""
        leaf = self._take("steady_batches", tgid, fd)
        if leaf is None or not leaf.count:
            return None
        size = _STEADY_HEADER.size + min(leaf.count, STEADY_WORDS) * 8
        return decode_steady_batch(ctypes.string_at(ctypes.addressof(leaf), size))

    def take_unseen_end(self, tgid: int, fd: int) -> UnseenEnd | None:
        """The end the kernel kept of the connection last on (tgid, fd), removed from the kernel;
        None if it kept none (its close record came, or it was never tracked)."""
        end = self._take("unseen_ends", tgid, fd)
        if end is None:
            return None
        return UnseenEnd(conn_ns=end.accept_ns, ts_ns=end.close_ns, bytes_before=(end.bytes[0], end.bytes[1]),
                         events_before=(end.events[0], end.events[1]))

    def _take(self, name: str, tgid: int, fd: int):
        """A connection's entry of a map, removed from it; None if it has none."""
        table = self.bpf[name]
        key = self._conn_key(table, tgid, fd)
        try:
            leaf = table[key]
        except KeyError:
            return None
        self._delete(table, key)
        return leaf

    def held_steady_writes(self, tgid: int, fd: int) -> tuple[int, int] | None:
        """(first, last) write time of the batch the kernel holds for a connection, left where it is;
        None if it holds none. (Read while the kernel may add to it: each is one aligned word.)"""
        table = self.bpf["steady_batches"]
        try:
            leaf = table[self._conn_key(table, tgid, fd)]
        except KeyError:
            return None
        return (leaf.words[0], leaf.ts_ns) if leaf.count else None

    def _put(self, name: str, key, leaf) -> bool:
        """Writes a map entry; False (logged once per map) when the map is full."""
        try:
            self.bpf[name][key] = leaf
            return True
        except Exception as exc:  # BCC raises a bare Exception with the errno's text
            self._refused[name] = self._refused.get(name, 0) + 1
            if name not in self._full_maps:
                self._full_maps.add(name)
                log.warning("BPF map %s refused an entry (%s): some sockets are resolved from /proc only",
                            name, exc)
            return False

    @staticmethod
    def _delete(table, key) -> bool:
        """Removes a map entry; False if it was already gone (closed, or evicted from an LRU map)."""
        try:
            del table[key]
            return True
        except KeyError:
            return False

    def close(self) -> None:
        self.bpf.cleanup()
