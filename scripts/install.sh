#!/usr/bin/env bash
# Installs everything tokenprobe needs on a Debian 12 machine, as root:
# BCC from Debian, kernel headers BCC can compile against, nginx for the
# proxy tests, tracefs, and a virtual environment (.venv) with the project.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[install] %s\n' "$*"; }
# BCC for the probes; nginx, Prometheus, Alertmanager and chromium (driven by
# Playwright against the dashboard) for the tests; Go (net/http, crypto/tls)
# for the server matrix's Go server, built by the tests; python3-seccomp for the
# seccomp profile's test; binutils (objdump) to check the Go RET offsets against.
APT_PACKAGES="bpfcc-tools python3-bpfcc python3-seccomp nginx-light prometheus prometheus-alertmanager chromium golang-go binutils curl"
# Remembers what apt installed, so a second run skips apt until the list changes.
stamp=.venv/.apt-done

if [ "$(cat "$stamp" 2>/dev/null)" != "$APT_PACKAGES" ]; then
  export DEBIAN_FRONTEND=noninteractive
  log "apt: $APT_PACKAGES"
  apt-get update -qq
  # shellcheck disable=SC2086  # a list of package names
  apt-get install -y -qq --no-install-recommends $APT_PACKAGES >/dev/null
  if [ ! -e "/lib/modules/$(uname -r)/build" ]; then
    # No headers package exists for this kernel; Debian's newest 6.12 headers
    # work (tracepoint layouts are read from tracefs at run time). The agent
    # finds them itself and says so.
    hdr=$(apt-cache pkgnames linux-headers-6.12 | grep -E '^linux-headers-6\.12\.[0-9]+\+deb12-amd64$' | sort -V | tail -n 1 || true)
    if [ -n "$hdr" ]; then
      log "apt: $hdr (no headers exist for kernel $(uname -r))"
      apt-get install -y -qq --no-install-recommends "$hdr" >/dev/null
    else
      log "warning: no linux-headers-6.12.*-amd64 package found; 'tokenprobe doctor' will say what is missing"
    fi
  fi
fi

if ! mountpoint -q /sys/kernel/tracing 2>/dev/null; then
  log "mounting tracefs on /sys/kernel/tracing"
  mount -t tracefs nodev /sys/kernel/tracing || log "warning: could not mount tracefs"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
echo "$APT_PACKAGES" > "$stamp"
log "pip: tokenprobe and its dependencies"
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
# xds-protos (Envoy's published protos, for the rate-limit adapter) carries its
# own older copy of the opentelemetry protos; whichever installs last wins.
# Put opentelemetry-proto's own files back so the OTLP exporter imports.
scripts/fix-otel-protos.sh .venv/bin/pip

# python3-bpfcc installs for Debian's python only; expose just its bcc package.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -e "$site/bcc" ] && [ -d /usr/lib/python3/dist-packages/bcc ]; then
  ln -s /usr/lib/python3/dist-packages/bcc "$site/bcc"
fi
log "ready: .venv/bin/tokenprobe"
