#!/usr/bin/env bash
# Makes schemathesis (the OpenAPI fuzzer, from PyPI) available in a virtual environment of its
# own and prints the path of that environment's python; run it as
# `<python> -m schemathesis.cli run ...`.
#
#   bash scripts/install-schemathesis.sh              # prints the python's path
#   bash scripts/install-schemathesis.sh --dir DIR    # install under DIR instead of the default
#
# The environment is DIR/schemathesis-<version>; DIR defaults to the tools folder of the
# copilot-pool cache, where the tests look too: $COPILOT_POOL_CACHE_DIR/tools, else
# $XDG_CACHE_HOME/copilot-pool/tools, else ~/.cache/copilot-pool/tools. It is built in a
# temporary folder beside it and renamed into place once pip has finished, so concurrent runs
# never see half an install (the tests also serialize their installs with a lock). The
# environment comes from scripts/make-venv.sh (the python3 on PATH, else Debian's Python
# unpacked into the cache); pip needs access to PyPI. A broken environment (its bin/python
# not executable) is replaced; the temporary folders of runs killed before their cleanup
# (.schemathesis-install.*) are removed by the tests' next install, under their lock.
set -euo pipefail

# The pinned version: the fuzzer's numbers in the README are from this one.
version=4.32.5

dir=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dir)
            [[ $# -ge 2 ]] || { echo "error: --dir needs a directory" >&2; exit 2; }
            dir="$2"
            shift
            ;;
        *) echo "error: unknown argument $1 (usage: install-schemathesis.sh [--dir DIR])" >&2; exit 2 ;;
    esac
    shift
done

if [[ -z "${dir}" ]]; then
    # shellcheck source=scripts/tools-dir.sh
    source "$(dirname "${BASH_SOURCE[0]}")/tools-dir.sh"
    dir="$(tools_dir)" || { echo "error: none of COPILOT_POOL_CACHE_DIR, XDG_CACHE_HOME or HOME is set; pass --dir DIR" >&2; exit 1; }
fi
target="${dir}/schemathesis-${version}"

if [[ -x "${target}/bin/python" ]]; then
    echo "${target}/bin/python"
    exit 0
fi
mkdir -p "${dir}"
tmp="$(mktemp -d "${dir}/.schemathesis-install.XXXXXX")"
trap 'rm -rf "${tmp}"' EXIT
if ! bash "$(dirname "${BASH_SOURCE[0]}")/make-venv.sh" "${tmp}/venv" >/dev/null; then
    echo "error: making the virtual environment failed (its error is above)" >&2
    exit 1
fi
"${tmp}/venv/bin/python" -m pip install --quiet --disable-pip-version-check "schemathesis==${version}"
"${tmp}/venv/bin/python" -m schemathesis.cli --version >/dev/null
# A venv's scripts name its path in their first line, but `python -m` does not depend on
# them: the renamed environment runs as is.
# A target here is broken (its bin/python is not executable: e.g. a link to an interpreter
# since removed), or it would have been used above: it goes (under the tests' lock).
rm -rf "${target}"
mv -T "${tmp}/venv" "${target}"
echo "${target}/bin/python"
