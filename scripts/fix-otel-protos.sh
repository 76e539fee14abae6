#!/usr/bin/env bash
# Usage: fix-otel-protos.sh PIP
# xds-protos ships an older copy of the opentelemetry/proto modules than the
# OTLP exporter needs; pip lets the last installed package own those files.
# Reinstalling the installed opentelemetry-proto (same version, no
# dependencies) restores its files. Used by scripts/install.sh and the image.
set -euo pipefail
pip=$1
version=$("$pip" show opentelemetry-proto 2>/dev/null | sed -n 's/^Version: //p')
[ -n "$version" ] || { echo "opentelemetry-proto is not installed" >&2; exit 1; }
"$pip" install -q --disable-pip-version-check --force-reinstall --no-deps "opentelemetry-proto==$version"
