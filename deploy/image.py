#!/usr/bin/env python3
"""Builds the agent image (deploy/Dockerfile) with podman, also where no container registry answers.

    python3 deploy/image.py [--tag tokenprobe/agent:0.1.0]

- **The base.** The Dockerfile starts FROM debian:bookworm-slim. Where podman has no such image and cannot
  pull one, this makes it: `debootstrap --variant=minbase bookworm` from the build machine's own Debian
  mirror, imported under that name.
- **The build machine's package-index settings** (apt's sources and configuration, pip's configuration
  and CA bundle, the local folders they name) reach the build's RUN steps as read-only mounts, so a
  build behind a proxy or a private index works as the machine's own apt and pip do; none of it is in a
  layer of the image.
- **podman's own settings** for machines like CI's (containers.conf, written beside the build): runc,
  cgroupfs, file events, ulimits the host allows. `podman_environment()` gives them to any podman call.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import configparser
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DEFAULT_TAG = "localhost/tokenprobe/agent:0.1.0"
BASE_IMAGE = "docker.io/library/debian:bookworm-slim"
SUITE = "bookworm"
# Where the build's RUN steps find the generated pip configuration and the copied CA bundle.
BUILD_SETTINGS = "/run/tokenprobe-build"
# apt's configuration: bind-mounted read-only at the same paths where the build machine has them.
APT_SETTINGS = ("/etc/apt/sources.list", "/etc/apt/sources.list.d", "/etc/apt/apt.conf.d", "/etc/apt/trusted.gpg.d")
# pip options whose values are local files or folders the build must see too.
PIP_PATH_OPTIONS = {"find-links", "extra-index-url", "index-url", "constraint", "requirement"}
# podman, as it works on these machines (DESIGN.md, "Containers, offline"): crun refuses hybrid cgroups,
# there is no systemd to manage cgroups or hold a journal, and ulimits above the host's hard ones fail.
DPKG_EXCLUDES = """\
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
"""
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def log(message: str) -> None:
    print(f"[image] {message}", file=sys.stderr, flush=True)


def podman_environment(work: Path) -> dict[str, str]:
    """The environment for podman calls: this machine's process environment plus a containers.conf in ``work``."""
    conf = work / "containers.conf"
    _, nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    conf.write_text(CONTAINERS_CONF.format(nofile=nofile))
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str, env: dict[str, str], check: bool = True, capture: bool = False,
           timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=env, check=check, text=True, timeout=timeout,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)


def image_exists(name: str, env: dict[str, str]) -> bool:
    return podman("image", "exists", name, env=env, check=False).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        if not path.is_file() or path.suffix not in {".list", ".sources", ""}:
            continue
        for url in re.findall(r"(?:^URIs:\s*|^deb\s+(?:\[[^]]*\]\s+)?)(\S+)", path.read_text(), re.MULTILINE):
            if "security" not in url:
                return url
    return "http://deb.debian.org/debian"


def ensure_base(env: dict[str, str]) -> None:
    """Gives podman the Dockerfile's base image: present, pulled, or made with debootstrap."""
    if image_exists(BASE_IMAGE, env):
        return
    try:
        if podman("pull", "--quiet", BASE_IMAGE, env=env, check=False, capture=True, timeout=60).returncode == 0:
            return
    except subprocess.TimeoutExpired:
        pass
    mirror = debian_mirror()
    log(f"no registry gave {BASE_IMAGE}: making it with debootstrap from {mirror}")
    with tempfile.TemporaryDirectory(prefix="tokenprobe-base-") as rootfs:
        subprocess.run(["debootstrap", "--variant=minbase", SUITE, rootfs, mirror], check=True,
                       stdout=subprocess.DEVNULL)
        slim(Path(rootfs))
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "--change", "CMD [\"bash\"]", "-", BASE_IMAGE], stdin=tar.stdout,
                       env=env, check=True, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise RuntimeError("tar of the debootstrapped base failed")


def slim(rootfs: Path) -> None:
    """Makes a debootstrapped tree what Debian's -slim images are: no documentation, manual pages or
    translations, now or from packages installed later (dpkg's path excludes); no apt download cache or lists."""
    (rootfs / "etc/dpkg/dpkg.cfg.d/slim").write_text(DPKG_EXCLUDES)
    for pattern in ("usr/share/doc/*", "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*",
                    "var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_*"):
        for path in rootfs.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def pip_settings() -> dict[str, str]:
    """pip's effective configuration on this machine (files and PIP_* variables), option -> value."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], text=True, capture_output=True)
    files, variables = {}, {}
    for line in listing.stdout.splitlines():
        match = re.fullmatch(r"([^.]*)\.([\w-]+)='(.*)'", line.strip())
        if match and match[2] != "config-file":  # that file's options are listed themselves
            (variables if match[1] == ":env:" else files)[match[2]] = match[3]
    return files | variables  # as in pip, a PIP_* variable outweighs a file


def local_paths(value: str) -> list[Path]:
    """The local files and folders a pip option's value names, where they exist. A file:// index counts with
    the folder above it: a local index's pages link to files beside it (../../files/...)."""
    paths = [Path(word) for word in value.split() if word.startswith("/")]
    paths += [Path(word.removeprefix("file://")).parent for word in value.split() if word.startswith("file:///")]
    return [path for path in paths if path.exists()]


def build_settings(directory: Path) -> list[str]:
    """Writes the build's pip configuration into ``directory``; returns podman's ``-v`` mounts for the build."""
    mounts = [f"{directory}:{BUILD_SETTINGS}:ro"]
    mounts += [f"{path}:{path}:ro" for path in APT_SETTINGS if Path(path).exists()]
    config = configparser.ConfigParser(interpolation=None)
    config["global"] = {}
    for option, value in pip_settings().items():
        if option == "cert":
            # Copied, not mounted at its own path: the image's ca-certificates writes its bundle there.
            shutil.copyfile(value, directory / "ca.crt")
            value = f"{BUILD_SETTINGS}/ca.crt"
        elif option in PIP_PATH_OPTIONS:
            mounts += [f"{path}:{path}:ro" for path in local_paths(value)]
        config["global"][option] = value
    with open(directory / "pip.conf", "w") as handle:
        config.write(handle)
    return mounts


def build(tag: str, env: dict[str, str], work: Path) -> None:
    ensure_base(env)
    settings = work / "build-settings"
    settings.mkdir(exist_ok=True)
    mounts = build_settings(settings)
    volume_args = [arg for mount in mounts for arg in ("-v", mount)]
    podman("build", "--pull=never", "--network", "host", *volume_args, "-f", str(DOCKERFILE), "-t", tag,
           str(ROOT), env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=DEFAULT_TAG, help="the image's name (default %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenprobe-image-") as work:
        build(args.tag, podman_environment(Path(work)), Path(work))
    log(f"built {args.tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
