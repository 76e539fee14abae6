"""deploy/seccomp/tokenprobe-agent.json, enforced by the kernel: a process under it runs BCC (a tracepoint
program feeding a ring buffer, a uprobe) and forks threads and children, while the calls it denies fail.

The filter is built with libseccomp (Debian's python3-seccomp, for Debian's Python, beside python3-bpfcc) in a
child process, which then runs the checks: a filter cannot be lifted from the process that loaded it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap

import pytest
from tokenprobe.agent.capture.kernel.headers import choose_headers

from tests.kernel_harness import REQUIRE_KERNEL, require_kernel
from tests.test_deploy_manifests import SECCOMP_PROFILE

DEBIAN_PYTHON = "/usr/bin/python3"

# Runs in the child, under the profile; prints one JSON object of what each check saw.
CHECKS = textwrap.dedent(r"""
    import ctypes, errno, json, os, sys, threading
    import seccomp

    profile = json.load(open(sys.argv[1]))
    ops = {"SCMP_CMP_MASKED_EQ": seccomp.MASKED_EQ}
    seen = {}
    try:
        bad = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
        for arch in ("X86", "X32"):  # the native one is in every filter
            bad.add_arch(getattr(seccomp.Arch, arch))
        for rule in profile["syscalls"]:
            args = [seccomp.Arg(a["index"], ops[a["op"]], a["value"], a["valueTwo"]) for a in rule.get("args", [])]
            for name in rule["names"]:
                bad.add_rule(seccomp.ERRNO(rule["errnoRet"]), name, *args)
        bad.load()
    except Exception as error:
        print(json.dumps({"load": repr(error)}))
        sys.exit(0)

    libc = ctypes.CDLL(None, use_errno=True)
    def call(number, *args):
        # The raw system call: "allowed", or the name of the errno it failed with.
        result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])
        if result == 0 and number == 56:
            os._exit(0)  # a clone the profile failed to stop: the copy must not run the checks too
        return "allowed" if result >= 0 else errno.errorcode[ctypes.get_errno()]

    from bcc import BPF
    program = BPF(text='''
        BPF_RINGBUF_OUTPUT(events, 8);
        TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
            u32 pid = bpf_get_current_pid_tgid() >> 32;
            events.ringbuf_output(&pid, sizeof(pid), 0);
            return 0;
        }
        int on_getpid(struct pt_regs *ctx) { return 0; }
    ''')
    got = []
    program["events"].open_ring_buffer(lambda ctx, data, size: got.append(ctypes.cast(data, ctypes.POINTER(ctypes.c_uint32))[0]))
    os.getppid()
    program.ring_buffer_poll(1000)
    seen["ring buffer event from this process"] = got == [os.getpid()]
    program.attach_uprobe(name="c", sym="getpid", fn_name="on_getpid")
    seen["uprobes attached"] = program.num_open_uprobes()
    thread = threading.Thread(target=lambda: None); thread.start(); thread.join()
    child = os.fork()
    if child == 0:
        os._exit(7)
    seen["fork"] = os.waitpid(child, 0)[1] >> 8
    CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x20000, 17
    sleeper = os.fork()  # a process of our own to try ptrace on
    if sleeper == 0:
        os.execv("/bin/sleep", ["sleep", "60"])
    seen["ptrace"] = call(101, 16, sleeper, 0, 0)  # PTRACE_ATTACH
    os.kill(sleeper, 9)
    os.waitpid(sleeper, 0)
    seen["clone new user namespace"] = call(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
    seen["unshare"] = call(272, CLONE_NEWNS)
    seen["clone3"] = call(435, 0, 0)
    seen["open_by_handle_at"] = call(304, -100, 0, 0)
    seen["userfaultfd"] = call(323, 0)
    print(json.dumps(seen))
""")


def test_bcc_works_under_the_profile_and_what_it_denies_is_denied(tmp_path):
    require_kernel()
    if shutil.which(DEBIAN_PYTHON) is None or subprocess.run(
            [DEBIAN_PYTHON, "-c", "import seccomp, bcc"], capture_output=True).returncode != 0:
        missing = "Debian's python3 with python3-seccomp and python3-bpfcc is needed (scripts/install.sh installs them)"
        if REQUIRE_KERNEL:
            pytest.fail(missing)
        pytest.skip(missing)
    script = tmp_path / "checks.py"
    script.write_text(CHECKS)
    env = dict(os.environ)
    headers = choose_headers()  # the headers the agent itself would compile against
    if headers.kernel_source is not None:
        env["BCC_KERNEL_SOURCE"] = str(headers.kernel_source)
    result = subprocess.run([DEBIAN_PYTHON, str(script), str(SECCOMP_PROFILE)], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {
        "ring buffer event from this process": True,
        "uprobes attached": 1,
        "fork": 7,
        "ptrace": "EPERM",
        "clone new user namespace": "EPERM",
        "unshare": "EPERM",
        "clone3": "ENOSYS",
        "open_by_handle_at": "EPERM",
        "userfaultfd": "EPERM",
    }, result.stderr
