#!/usr/bin/env bash
# Coverage-guided fuzzing of the byte-reading surfaces (tests/fuzz: frame codec, JSON-RPC
# connection, session events, transcript reader, HTTP request bodies) with cargo-fuzz and
# libFuzzer. CI runs every target briefly; a longer run is the same command with more seconds.
#
#   bash scripts/fuzz-smoke.sh --seconds 10             # every target, 10 s each (CI; 20 s by default)
#   bash scripts/fuzz-smoke.sh --release --seconds 600 json_rpc   # one target, 10 minutes
#   bash scripts/fuzz-smoke.sh --keep-corpus DIR ...    # keep what the fuzzer found in DIR
#   bash scripts/fuzz-smoke.sh --build-only             # install cargo-fuzz and build, run nothing
#
# Each target starts from its committed seeds (tests/fuzz/seeds/<target>, read only) and
# writes new inputs to a scratch corpus. A panic, a hang past 10 s on one input, or an RSS
# over --rss-limit-mb (default 1024) fails the run and leaves the input in
# tests/fuzz/artifacts/<target>/ (replay it with `cargo fuzz run --fuzz-dir tests/fuzz
# <target> <file>`, or add it to the seeds and run `cargo test --test fuzz_seeds`).
#
# cargo-fuzz (pinned below) is taken from the tools folder of the copilot-pool cache
# ($COPILOT_POOL_CACHE_DIR/tools, else $XDG_CACHE_HOME/copilot-pool/tools, else
# ~/.cache/copilot-pool/tools), else installed there with `cargo install --locked` under a
# lock (one installer at a time; the others wait up to FUZZ_INSTALL_WAIT_SECS, default 900)
# and moved into place in one rename. The machine needs only a stable toolchain:
# RUSTC_BOOTSTRAP=1 lets it take cargo-fuzz's nightly flags. No sanitizer (the crate denies
# unsafe code; libFuzzer's coverage and the crate's own assertions do the finding), debug
# assertions on, one build for all targets: by default tests/fuzz's `dev` profile (the
# dependencies at opt-level 1, the library at 0: a cold build fits CI's budget), with
# --release the optimised one (several times more inputs a second, for long runs).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARGO_FUZZ_VERSION=0.13.2
seconds="${FUZZ_SECONDS:-20}"
rss_limit_mb=1024
keep=""
build_only=0
profile=(--dev)
targets=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --seconds)
            [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || { echo "error: --seconds needs a whole number" >&2; exit 2; }
            seconds="$2"
            shift
            ;;
        --rss-limit-mb)
            [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || { echo "error: --rss-limit-mb needs a whole number" >&2; exit 2; }
            rss_limit_mb="$2"
            shift
            ;;
        --release) profile=(--release --debug-assertions) ;;
        --build-only) build_only=1 ;;
        --keep-corpus)
            [[ $# -ge 2 ]] || { echo "error: --keep-corpus needs a directory" >&2; exit 2; }
            keep="$2"
            shift
            ;;
        -*) echo "error: unknown option $1 (usage: fuzz-smoke.sh [--release] [--build-only] [--seconds N] [--rss-limit-mb N] [--keep-corpus DIR] [TARGET...])" >&2; exit 2 ;;
        *) targets+=("$1") ;;
    esac
    shift
done

all_targets=(frame_codec json_rpc session_event transcript_reader http_body)
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=("${all_targets[@]}")
fi
for t in "${targets[@]}"; do
    if [[ ! -f "tests/fuzz/fuzz_targets/${t}.rs" ]]; then
        echo "error: no fuzz target ${t} (targets: ${all_targets[*]})" >&2
        exit 2
    fi
done

for tool in cargo c++ flock timeout; do
    if ! command -v "${tool}" >/dev/null 2>&1; then
        echo "error: ${tool} is not on PATH (libFuzzer is C++: install a C++ compiler such as g++)" >&2
        exit 1
    fi
done

# shellcheck source=scripts/tools-dir.sh
source "$(dirname "${BASH_SOURCE[0]}")/tools-dir.sh"
tools="$(tools_dir)" || { echo "error: none of COPILOT_POOL_CACHE_DIR, XDG_CACHE_HOME or HOME is set" >&2; exit 1; }
root="${tools}/cargo-fuzz-${CARGO_FUZZ_VERSION}"
cargo_fuzz="${root}/bin/cargo-fuzz"

scratch="$(mktemp -d)"
trap 'rm -rf "${scratch}"' EXIT

if [[ ! -x "${cargo_fuzz}" ]]; then
    mkdir -p "${tools}"
    wait_secs="${FUZZ_INSTALL_WAIT_SECS:-900}"
    exec 9>"${tools}/.cargo-fuzz.lock"
    if ! flock -w "${wait_secs}" 9; then
        echo "error: another cargo-fuzz install held ${tools}/.cargo-fuzz.lock for over" \
            "${wait_secs} s; if no install is running, delete the lock file and retry" >&2
        exit 1
    fi
    # Another run may have finished the install while this one waited.
    if [[ ! -x "${cargo_fuzz}" ]]; then
        echo "installing cargo-fuzz ${CARGO_FUZZ_VERSION} into ${root}" >&2
        part="$(mktemp -d "${tools}/.cargo-fuzz.XXXXXX")"
        if ! timeout "${wait_secs}" cargo install cargo-fuzz --version "${CARGO_FUZZ_VERSION}" \
            --locked --root "${part}" >&2; then
            rm -rf "${part}"
            echo "error: cargo install cargo-fuzz ${CARGO_FUZZ_VERSION} failed or took over" \
                "${wait_secs} s (it needs crates.io; or put cargo-fuzz ${CARGO_FUZZ_VERSION}" \
                "at ${cargo_fuzz})" >&2
            exit 1
        fi
        rm -rf "${root}"
        mv "${part}" "${root}"
    fi
    exec 9>&-
fi

export RUSTC_BOOTSTRAP=1
# The transcript target's scratch files: in memory when /dev/shm is there (every append is
# fsync'd; on a disk that bounds the target to ~200 inputs a second), and removed at the end.
if [[ -d /dev/shm && -w /dev/shm ]]; then
    files="$(mktemp -d /dev/shm/copilot-pool-fuzz.XXXXXX)"
    trap 'rm -rf "${scratch}" "${files}"' EXIT
    export TMPDIR="${files}"
else
    export TMPDIR="${scratch}"
fi
fuzz=("${cargo_fuzz}" fuzz)
common=(--fuzz-dir tests/fuzz --sanitizer none "${profile[@]}")

start=$(date +%s)
"${fuzz[@]}" build "${common[@]}"
echo "fuzz build: $(( $(date +%s) - start )) s" >&2
if [[ "${build_only}" == 1 ]]; then
    exit 0
fi

for t in "${targets[@]}"; do
    corpus="${keep:-${scratch}/corpus}/${t}"
    mkdir -p "${corpus}"
    echo "==> fuzzing ${t} for ${seconds} s" >&2
    "${fuzz[@]}" run "${common[@]}" "${t}" "${corpus}" "tests/fuzz/seeds/${t}" -- \
        -max_total_time="${seconds}" -rss_limit_mb="${rss_limit_mb}" -timeout=10 \
        -print_final_stats=1
done
echo "fuzz smoke: ${#targets[@]} targets, ${seconds} s each, $(( $(date +%s) - start )) s in all" >&2
