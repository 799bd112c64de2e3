#!/usr/bin/env bash
# Makes `promtool` (Prometheus' rule and metrics checker) available and prints its path; with
# --prometheus, makes the `prometheus` server of the same package available and prints its path
# instead.
#
#   bash scripts/install-promtool.sh                  # prints promtool's path
#   bash scripts/install-promtool.sh --prometheus     # prints the prometheus server's path
#   bash scripts/install-promtool.sh --dir DIR ...    # install into DIR instead of the default
#
# Looks in DIR first, then on PATH, else takes both executables from Debian's `prometheus`
# package (`apt-get download` + `dpkg-deb -x`: nothing is installed system-wide; root is needed
# only when the package lists are missing, for one `apt-get update`) and puts them in DIR.
# DIR defaults to the tools folder of the copilot-pool cache, where the tests look too:
# $COPILOT_POOL_CACHE_DIR/tools, else $XDG_CACHE_HOME/copilot-pool/tools, else
# ~/.cache/copilot-pool/tools. Each file is moved into place in one rename, so concurrent runs
# cannot leave a half-written executable (the tests also serialize their installs with a lock).
set -euo pipefail

want=promtool
dir=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --prometheus) want=prometheus ;;
        --dir)
            [[ $# -ge 2 ]] || { echo "error: --dir needs a directory" >&2; exit 2; }
            dir="$2"
            shift
            ;;
        *) echo "error: unknown argument $1 (usage: install-promtool.sh [--prometheus] [--dir DIR])" >&2; exit 2 ;;
    esac
    shift
done

if [[ -z "${dir}" ]]; then
    # shellcheck source=scripts/tools-dir.sh
    source "$(dirname "${BASH_SOURCE[0]}")/tools-dir.sh"
    dir="$(tools_dir)" || { echo "error: none of COPILOT_POOL_CACHE_DIR, XDG_CACHE_HOME or HOME is set; pass --dir DIR" >&2; exit 1; }
fi
target="${dir}/${want}"

if [[ -x "${target}" ]]; then
    echo "${target}"
    exit 0
fi
if command -v "${want}" >/dev/null 2>&1; then
    command -v "${want}"
    exit 0
fi

for tool in apt-get dpkg-deb; do
    if ! command -v "${tool}" >/dev/null 2>&1; then
        echo "error: ${want} is not on PATH and ${tool} is missing to fetch it (install the" \
            "prometheus package, or put ${want} on PATH, or set PROMTOOL to a promtool)" >&2
        exit 1
    fi
done

tmp="$(mktemp -d)"
part=""
# As root, apt-get warns that it downloads "unsandboxed" into this private directory: harmless.
trap 'rm -rf "${tmp}"; [[ -z "${part}" ]] || rm -f "${part}"' EXIT

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
if [[ ! -x "${tmp}/root/usr/bin/${want}" ]]; then
    echo "error: ${deb##*/} has no /usr/bin/${want}" >&2
    exit 1
fi
mkdir -p "${dir}"
# Both executables of the package, each copied under a private name beside its final one and
# renamed into place.
for name in promtool prometheus; do
    if [[ -x "${tmp}/root/usr/bin/${name}" ]]; then
        part="$(mktemp "${dir}/.${name}.XXXXXX")"
        install -m 0755 "${tmp}/root/usr/bin/${name}" "${part}"
        mv -f "${part}" "${dir}/${name}"
        part=""
    fi
done
"${target}" --version >&2
echo "${target}"
