"""What the agent's rescan of /proc for listeners costs (every 5 s, on a thread of its own),
on a node with many connections and open files: the full scan it made before
(procfs.target_port_sockets: every socket of every namespace, every open file of every
process) beside procfs.ListenerScan (the listening sockets alone, and the files only of the
processes started since, with a full read every 12 scans), measured side by side in one run.

For each load (connections held open on a port that is not a target, plus other open files,
all in this process) it prints the CPU (user + system) of one scan of each, as the median of
--rounds, and their ratio; it checks that both found the same listeners.

    .venv/bin/python -m benchmarks.bench_rescan [--loads 0:0 2000:2000 5000:5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import time
from typing import Callable

from tokenprobe.agent.capture.kernel.procfs import ListenerScan, target_port_sockets


def cpu_ms(work: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.process_time()
        work()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", nargs="+", default=["0:0", "2000:2000", "5000:5000"],
                        help="CONNECTIONS:FILES held open during the scans (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="scans of each kind per load (default: %(default)s)")
    args = parser.parse_args()
    loads = [tuple(int(part) for part in load.split(":")) for load in args.loads]
    need = max(2 * connections + files for connections, files in loads) + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if need > hard:
        parser.error(f"the loads need {need} open files; this shell allows {hard} (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    target, other = listener(), listener()
    port = target.getsockname()[1]
    print(f"{'connections':>11} {'files':>6} | {'full scan':>10} | {'ListenerScan':>12} | ratio")
    for connections, files in loads:
        held = []
        for _ in range(connections):
            held.append(socket.create_connection(other.getsockname()))
            held.append(other.accept()[0])
        held += [open("/dev/null") for _ in range(files)]
        scan = ListenerScan({port})
        scan.scan()  # the first scan is a full one; the figure is that of the scans between
        full = cpu_ms(lambda: target_port_sockets({port}), args.rounds)
        narrow = cpu_ms(scan.scan, min(args.rounds, scan.full_every - 1))
        assert [(o.pid, o.fd) for o in scan.scan()] == [(o.pid, o.fd) for o in target_port_sockets({port})[0]]
        print(f"{connections:>11} {files:>6} | {full:>7.1f} ms | {narrow:>9.1f} ms | {full / narrow:5.1f}×")
        for thing in held:
            thing.close()


if __name__ == "__main__":
    main()
