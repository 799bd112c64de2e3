#!/usr/bin/env bash
# Makes a Python virtual environment with pip at DEST and prints the path of its python, for
# the tests' Python tools (the official Python SDK, schemathesis), so that `cargo test` needs
# nothing beyond Rust and Node.js on a Debian-like machine:
#
#   bash scripts/make-venv.sh DEST              # makes DEST, prints DEST/bin/python
#   bash scripts/make-venv.sh --no-system DEST  # never the python3 on PATH (the fallback's test)
#
# With a python3 on PATH that has venv and ensurepip: `python3 -m venv DEST`. Else Debian's
# Python (the interpreter and standard library of the version `python3-minimal` depends on,
# and Debian's pip wheel): `apt-get download` + `dpkg-deb -x`, nothing installed system-wide
# (root only for one `apt-get update` when the package lists are missing), unpacked once into
# the tools folder of the copilot-pool cache ($COPILOT_POOL_CACHE_DIR/tools, else
# $XDG_CACHE_HOME/copilot-pool/tools, else ~/.cache/copilot-pool/tools) as `debian-python`,
# renamed into place when complete so concurrent runs never see half of it. The shared
# libraries those packages depend on (libexpat, libssl, libffi, ...: a minimal Debian lacks
# some, debootstrap's minbase has neither libexpat1 nor libssl3) are unpacked beside it, and
# the environment's `python` is a wrapper that puts them on LD_LIBRARY_PATH. The environment
# is made without pip (Debian's ensurepip looks for its wheels only under
# /usr/share/python-wheels) and pip is installed into it from the unpacked wheel.
set -euo pipefail

usage="usage: make-venv.sh [--no-system] DEST"
system=1
dest=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-system) system=0 ;;
        -*) echo "error: unknown option $1 (${usage})" >&2; exit 2 ;;
        *)
            [[ -z "${dest}" ]] || { echo "error: one DEST only (${usage})" >&2; exit 2; }
            dest="$1"
            ;;
    esac
    shift
done
[[ -n "${dest}" ]] || { echo "error: no DEST (${usage})" >&2; exit 2; }

# What to do when Debian's Python cannot be had either.
if [[ "${system}" -eq 1 ]]; then
    fix="install python3 and python3-venv"
else
    fix="--no-system needs a Debian-like system (apt-get, apt-cache, dpkg-deb)"
fi

if [[ "${system}" -eq 1 ]] && command -v python3 >/dev/null 2>&1 \
    && python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    python3 -m venv "${dest}"
    echo "${dest}/bin/python"
    exit 0
fi

# shellcheck source=scripts/tools-dir.sh
source "$(dirname "${BASH_SOURCE[0]}")/tools-dir.sh"
if ! tools="$(tools_dir)"; then
    echo "error: none of COPILOT_POOL_CACHE_DIR, XDG_CACHE_HOME or HOME is set to unpack" \
        "Debian's Python under: set one, or ${fix}" >&2
    exit 1
fi
root="${tools}/debian-python"
# Written last into a complete unpack (named anew when what an unpack holds changes, so an
# older one is replaced).
marker=".complete-with-libraries-and-certificates"
# The CA bundle of the unpack, for a system without its own.
bundle="etc/ssl/certs/ca-certificates.crt"

# The unpacked Python, if a run before completed it: its interpreter and pip wheel.
find_unpacked() {
    python="$(find "${root}/usr/bin" -maxdepth 1 -name 'python3.*' -type f 2>/dev/null | sort | head -n 1)"
    wheel="$(find "${root}/usr/share/python-wheels" -maxdepth 1 -name 'pip-*.whl' 2>/dev/null | head -n 1)"
    [[ -n "${python}" && -n "${wheel}" && -f "${root}/${marker}" ]]
}

if ! find_unpacked; then
    for tool in apt-get apt-cache dpkg-deb; do
        if ! command -v "${tool}" >/dev/null 2>&1; then
            echo "error: ${tool} is missing to fetch Debian's Python: ${fix}" >&2
            exit 1
        fi
    done
    mkdir -p "${tools}"
    # What a run killed at its deadline left behind (its EXIT trap did not run).
    find "${tools}" -maxdepth 1 -name '.debian-python.*' -mmin +60 -exec rm -rf {} + 2>/dev/null || true
    tmp="$(mktemp -d "${tools}/.debian-python.XXXXXX")"
    trap 'rm -rf "${tmp}"' EXIT
    # The Python version Debian's python3-minimal depends on (3.11 on bookworm); empty when
    # apt knows no such package (no package lists yet). No pipeline: under pipefail a
    # consumer that stops reading early would fail the whole script.
    version() {
        local deps
        deps="$(apt-cache depends python3-minimal 2>/dev/null || true)"
        if [[ "${deps}" =~ python(3\.[0-9]+)-minimal ]]; then
            echo "${BASH_REMATCH[1]}"
        fi
    }
    # Refreshes the package lists as root (`$1` says why); otherwise fails saying to.
    refresh_lists() {
        if [[ "$(id -u)" -ne 0 ]]; then
            echo "error: $1; run 'apt-get update' as root first, or ${fix}" >&2
            exit 1
        fi
        echo "$1; running apt-get update once" >&2
        apt-get update -qq >&2
    }
    v="$(version)"
    if [[ -z "${v}" ]]; then
        refresh_lists "apt-cache knows no python3-minimal (no package lists)"
        v="$(version)"
        [[ -n "${v}" ]] || { echo "error: apt-cache knows no python3-minimal after apt-get update" >&2; exit 1; }
    fi
    # As root, apt-get warns that it downloads "unsandboxed" into this private directory:
    # harmless.
    # The shared libraries, as the packages name them (so the names fit the release:
    # libssl3 on bookworm, libssl3t64 after it); libc6 is the system's own.
    declare -A libs=()
    while read -r kind name; do
        [[ "${kind}" == "Depends:" ]] || continue
        case "${name}" in
            libc6 | libpython* | "<"*) ;;
            lib* | zlib1g) libs["${name}"]=1 ;;
        esac
    done < <(apt-cache depends "python${v}-minimal" "libpython${v}-minimal" "libpython${v}-stdlib" \
        2>/dev/null || true)
    download() {
        (cd "${tmp}" && apt-get download -q "python${v}-minimal" "libpython${v}-minimal" \
            "libpython${v}-stdlib" python3-pip-whl ca-certificates "${!libs[@]}" >&2)
    }
    if ! download; then
        # Package lists older than the mirror (a listed version replaced there: 404): refresh
        # them once and retry.
        refresh_lists "apt-get download of Debian's python${v} failed"
        # What did download may be of versions replaced too: all anew.
        rm -f "${tmp}"/*.deb
        download
    fi
    for deb in "${tmp}"/*.deb; do
        dpkg-deb -x "${deb}" "${tmp}/root"
    done
    # Debian's pip trusts /etc/ssl/certs/ca-certificates.crt only, which a minimal system
    # lacks: the bundle that update-ca-certificates would make, from the same package.
    mkdir -p "${tmp}/root/etc/ssl/certs"
    cat "${tmp}"/root/usr/share/ca-certificates/mozilla/*.crt > "${tmp}/root/${bundle}"
    touch "${tmp}/root/${marker}"
    # Only a complete unpack is ever renamed into place, so one without its marker is not
    # another run's work in progress but something left by hand: it goes.
    if [[ -e "${root}" && ! -f "${root}/${marker}" ]]; then
        rm -rf "${root}"
    fi
    # Another run may have put its own in place meanwhile: either is whole, keep the first.
    mv -T "${tmp}/root" "${root}" 2>/dev/null || true
    find_unpacked || { echo "error: Debian's python${v} packages did not unpack a python and a pip wheel into ${root}" >&2; exit 1; }
fi

# Where the unpacked libraries are, searched before the system's.
libpath=""
for dir in "${root}"/usr/lib/*-linux-gnu "${root}"/lib/*-linux-gnu; do
    [[ -d "${dir}" ]] && libpath="${libpath:+${libpath}:}${dir}"
done
# A library neither unpacked nor the system's is named here rather than deep inside pip.
if ! missing="$(LD_LIBRARY_PATH="${libpath}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}" \
    "${python}" -c 'import ssl, pyexpat, zlib, ctypes, venv' 2>&1)"; then
    echo "error: Debian's Python in ${root} cannot load its modules (${missing##*$'\n'}):" \
        "install the system library it names, or ${fix}" >&2
    exit 1
fi
LD_LIBRARY_PATH="${libpath}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}" \
    "${python}" -m venv --without-pip "${dest}"
# The environment's pythons become one wrapper: the libraries' path, then the interpreter
# under the name it was called by (a venv is found from that name, as with the link it
# replaces; "$0" keeps the environment movable).
rm -f "${dest}"/bin/python*
{
    echo '#!/bin/bash'
    echo "# Debian's Python unpacked by scripts/make-venv.sh, with its libraries; pip gets"
    echo "# the unpacked CA bundle where the system has none (and SSL_CERT_FILE names none)."
    printf 'unpacked_bundle=%q\n' "${root}/${bundle}"
    printf 'if [[ -z "${PIP_CERT:-}" && ! -e /%s ]]; then\n' "${bundle}"
    echo '    export PIP_CERT="${SSL_CERT_FILE:-${unpacked_bundle}}"'
    echo 'fi'
    printf 'LD_LIBRARY_PATH=%q"${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}" exec -a "$0" %q "$@"\n' \
        "${libpath}" "${python}"
} > "${dest}/bin/python"
chmod +x "${dest}/bin/python"
ln -s python "${dest}/bin/python3"
ln -s python "${dest}/bin/${python##*/}"
"${dest}/bin/python" "${wheel}/pip" install --quiet --no-index --disable-pip-version-check "${wheel}" >&2
echo "${dest}/bin/python"
