//! Every committed fuzz seed (`tests/fuzz/seeds/<target>/*`) through the same entry points
//! the fuzzer drives (`copilot_pool::fuzzing`), so the seeds and the invariants they reach are
//! checked by a plain `cargo test`, without cargo-fuzz or a nightly flag.

use std::path::{Path, PathBuf};

fn seeds(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/seeds")
        .join(target);
    let mut out: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("a seed entry").path();
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, bytes)
        })
        .collect();
    out.sort();
    assert!(
        out.len() >= 5,
        "{target} has {} seeds; commit at least five meaningful ones",
        out.len()
    );
    out
}

/// Runs each seed of `target` through `entry`, naming the seed that panics.
fn replay(target: &str, entry: impl Fn(&[u8]) + std::panic::RefUnwindSafe) {
    for (path, bytes) in seeds(target) {
        if std::panic::catch_unwind(|| entry(&bytes)).is_err() {
            panic!(
                "fuzz seed {} breaks an invariant (see the panic above)",
                path.display()
            );
        }
    }
}

#[test]
fn every_frame_codec_seed_keeps_the_codec_invariants() {
    replay("frame_codec", copilot_pool::fuzzing::frame_codec);
}

#[test]
fn every_json_rpc_seed_keeps_the_connection_invariants() {
    replay("json_rpc", copilot_pool::fuzzing::json_rpc);
}

#[test]
fn every_session_event_seed_decodes_and_round_trips() {
    replay("session_event", copilot_pool::fuzzing::session_event);
}

#[test]
fn every_transcript_seed_opens_repairs_and_appends_once() {
    let dir = tempfile::tempdir().expect("scratch directory");
    replay("transcript_reader", |bytes| {
        copilot_pool::fuzzing::transcript_reader(dir.path(), bytes)
    });
}

#[test]
fn every_http_body_seed_goes_through_the_request_checks() {
    replay("http_body", copilot_pool::fuzzing::http_body);
}

#[test]
fn deeply_nested_json_is_refused_by_the_recursion_limit_not_the_stack() {
    // 100,000 levels would overflow the stack without serde_json's limit of 128; each entry
    // point must come back (refusing it), in this test thread's ordinary stack.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    copilot_pool::fuzzing::session_event(deep.as_bytes());
    copilot_pool::fuzzing::http_body(deep.as_bytes());
    let frame = format!("Content-Length: {}\r\n\r\n{deep}", deep.len());
    copilot_pool::fuzzing::json_rpc(frame.as_bytes());
    let dir = tempfile::tempdir().expect("scratch directory");
    copilot_pool::fuzzing::transcript_reader(dir.path(), format!("{deep}\n").as_bytes());
}
