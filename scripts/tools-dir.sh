#!/usr/bin/env bash
# Sourced by the scripts that install tools for the tests (promtool, schemathesis, Debian's
# Python, cargo-fuzz): `tools_dir` prints the tools folder of the copilot-pool cache, where the
# tests look for them, in the order of the runtime's cache directory:
# $COPILOT_POOL_CACHE_DIR/tools, else $XDG_CACHE_HOME/copilot-pool/tools (an absolute
# XDG_CACHE_HOME only), else ~/.cache/copilot-pool/tools. It fails, printing nothing, when
# none of the three is set.
tools_dir() {
    if [[ -n "${COPILOT_POOL_CACHE_DIR:-}" ]]; then
        echo "${COPILOT_POOL_CACHE_DIR}/tools"
    elif [[ "${XDG_CACHE_HOME:-}" == /* ]]; then
        echo "${XDG_CACHE_HOME}/copilot-pool/tools"
    elif [[ -n "${HOME:-}" ]]; then
        echo "${HOME}/.cache/copilot-pool/tools"
    else
        return 1
    fi
}
