"""Find kernel headers BCC can compile the probes against.

BCC looks in /lib/modules/$(uname -r)/{build,source}. Many nodes run a kernel
without a headers package (cloud and custom kernels). The probes only use
tracepoints and uprobes, whose layouts BCC reads from tracefs at load time, so
the headers of a nearby kernel version work. Debian splits a kernel's headers
into an arch part (`linux-headers-X-amd64`: generated files, config) and a
common part (`linux-headers-X-common`: the sources); BCC_KERNEL_SOURCE takes
one folder, so we build a merged tree of symlinks in a cache folder.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

MODULES_DIR = Path("/lib/modules")
SRC_DIR = Path("/usr/src")
DEFAULT_CACHE = Path(os.environ.get("TOKENPROBE_CACHE", "/var/cache/tokenprobe"))


@dataclass(frozen=True)
class HeaderChoice:
    """Where BCC should find headers, and how we got there (for people)."""

    kernel_source: Path | None  # value for BCC_KERNEL_SOURCE; None = BCC's own default
    version: str
    exact: bool
    note: str


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0].split("-")[0])[:3])


def _distance(running: tuple[int, ...], candidate: tuple[int, ...]) -> tuple[int, int, int]:
    """Closeness of two kernel versions: same major.minor first, then newer."""
    r = (running + (0, 0, 0))[:3]
    c = (candidate + (0, 0, 0))[:3]
    return (abs(r[0] - c[0]), abs(r[1] - c[1]), -c[2])


def _has_headers(path: Path) -> bool:
    return (path / "include").is_dir()


def find_debian_pairs(src_dir: Path = SRC_DIR) -> list[tuple[str, Path, Path]]:
    """Installed Debian header pairs: (version, arch dir, common dir).

    The generic flavour (`-amd64`) is preferred over `-cloud-` and `-rt-` of
    the same version because its config is closest to a typical kernel.
    """
    pairs = []
    for arch_dir in sorted(src_dir.glob("linux-headers-*")):
        m = re.fullmatch(r"linux-headers-(\d+\.\d+\.\d+\+\S+?)-(?:(cloud|rt)-)?(amd64|arm64)", arch_dir.name)
        if not m:
            continue
        version, flavour = m.group(1), m.group(2)
        common = src_dir / f"linux-headers-{version}-common{'-rt' if flavour == 'rt' else ''}"
        if _has_headers(arch_dir) and _has_headers(common):
            pairs.append((version, arch_dir, common, flavour is None))
    # the generic flavour first among equal versions
    pairs.sort(key=lambda p: (_version_key(p[0]), not p[3]))
    return [(v, a, c) for v, a, c, _ in pairs]


def merge_tree(arch_dir: Path, common_dir: Path, dest: Path) -> Path:
    """A folder of symlinks holding both halves of a Debian headers pair."""
    dest.mkdir(parents=True, exist_ok=True)

    def link_all(src: Path, dst: Path) -> None:
        dst.mkdir(parents=True, exist_ok=True)
        for entry in src.iterdir():
            target = dst / entry.name
            if target.is_symlink() or target.exists():
                continue
            target.symlink_to(entry)

    # Sources from the common half; generated files and config from the arch half.
    link_all(common_dir / "include", dest / "include")
    for name in ("generated", "config"):
        if (arch_dir / "include" / name).exists() and not (dest / "include" / name).exists():
            (dest / "include" / name).symlink_to(arch_dir / "include" / name)
    for arch in ("x86", "arm64"):
        common_arch = common_dir / "arch" / arch / "include"
        if not common_arch.is_dir():
            continue
        link_all(common_arch, dest / "arch" / arch / "include")
        generated = arch_dir / "arch" / arch / "include" / "generated"
        if generated.exists() and not (dest / "arch" / arch / "include" / "generated").exists():
            (dest / "arch" / arch / "include" / "generated").symlink_to(generated)
    for name in ("Makefile", "scripts"):
        if not (dest / name).exists() and (arch_dir / name).exists():
            (dest / name).symlink_to(arch_dir / name)
    return dest


def choose_headers(release: str | None = None, cache_dir: Path = DEFAULT_CACHE,
                   modules_dir: Path = MODULES_DIR, src_dir: Path = SRC_DIR) -> HeaderChoice:
    """Headers for the running kernel, else the nearest installed version."""
    release = release or platform.release()
    own = modules_dir / release
    if _has_headers(own / "build"):
        return HeaderChoice(None, release, True, f"kernel headers for {release} found in {own}")
    pairs = find_debian_pairs(src_dir)
    if not pairs:
        return HeaderChoice(None, release, False,
                            f"no kernel headers for {release} and none installed to fall back on; "
                            "install linux-headers for this kernel or Debian's linux-headers-6.12.*-amd64")
    running = _version_key(release)
    # min() keeps the first of equals: find_debian_pairs lists the generic flavour first.
    version, arch_dir, common_dir = min(pairs, key=lambda p: _distance(running, _version_key(p[0])))
    merged = merge_tree(arch_dir, common_dir, cache_dir / "kernel-headers" / version)
    return HeaderChoice(merged, version, False,
                        f"no kernel headers for {release}; using the nearest installed, {version} "
                        f"({arch_dir.name} + {common_dir.name}), merged in {merged}. "
                        "This is safe: tracepoint layouts are read from tracefs at load time")
