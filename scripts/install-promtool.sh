#!/usr/bin/env bash
# Makes `promtool` (Prometheus' rule and metrics checker) available for the tests and prints
# its path (and puts the `prometheus` server of the same package in target/tools): the one on PATH, else <repo>/target/tools/promtool, else that file taken from the
# Debian `prometheus` package (`apt-get download`, no installation, no root needed unless the
# package lists are missing).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="${repo}/target/tools"
target="${tools}/promtool"

if command -v promtool >/dev/null 2>&1 && { command -v prometheus >/dev/null 2>&1 || [[ -x "${tools}/prometheus" ]]; }; then
    command -v promtool
    exit 0
fi
if [[ -x "${target}" && ( -x "${tools}/prometheus" || -n "${PROMTOOL_ONLY:-}" ) ]]; then
    echo "${target}"
    exit 0
fi

for tool in apt-get dpkg-deb; do
    if ! command -v "${tool}" >/dev/null 2>&1; then
        echo "error: promtool is not on PATH and ${tool} is missing to fetch it (install the" \
            "prometheus package, or put promtool on PATH)" >&2
        exit 1
    fi
done

tmp="$(mktemp -d)"
# As root, apt-get warns that it downloads "unsandboxed" into this private directory: harmless.
trap 'rm -rf "${tmp}"' EXIT

download() {
    (cd "${tmp}" && apt-get download prometheus >&2)
}

if ! download; then
    # No package lists yet (a fresh container): refresh them once and retry.
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "error: apt-get download prometheus failed; run 'apt-get update' as root first" >&2
        exit 1
    fi
    echo "apt-get download failed; running apt-get update once and retrying" >&2
    apt-get update -qq >&2
    download
fi

deb="$(find "${tmp}" -maxdepth 1 -name 'prometheus_*.deb' | head -n 1)"
if [[ -z "${deb}" ]]; then
    echo "error: apt-get download prometheus produced no package" >&2
    exit 1
fi
dpkg-deb -x "${deb}" "${tmp}/root"
if [[ ! -x "${tmp}/root/usr/bin/promtool" ]]; then
    echo "error: ${deb##*/} has no /usr/bin/promtool" >&2
    exit 1
fi
mkdir -p "${tools}"
install -m 0755 "${tmp}/root/usr/bin/promtool" "${target}.tmp"
mv -f "${target}.tmp" "${target}"
# The server comes from the same package; scripts/prometheus-check.sh runs it.
if [[ -x "${tmp}/root/usr/bin/prometheus" ]]; then
    install -m 0755 "${tmp}/root/usr/bin/prometheus" "${tools}/prometheus.tmp"
    mv -f "${tools}/prometheus.tmp" "${tools}/prometheus"
fi
"${target}" --version >&2
echo "${target}"
