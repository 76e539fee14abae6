"""The kernel room: what the agent asks of the kernel and how it reads the answers.

- loader.py         compiles and loads bpf/tokenprobe.c with BCC, chooses targets, attaches the probes
- records.py        the ring buffer's records (events, steady batches) and their decoding
- btf.py, headers.py the running kernel's BTF offsets; the headers BCC compiles against
- tls_libraries.py  which mapped files hold a TLS library (OpenSSL, Go crypto/tls), through elf.py, go_tls.py
- procfs.py         /proc: listening sockets, a socket's endpoints, a process's name
- clock.py          the kernel's monotonic clock mapped to wall time
"""
