//! Prints what opening a conversation's transcript mirror costs a lease, for transcripts of
//! 10, 100, 1,000 and 10,000 entries: the full read (`Transcript::open`, what every lease did
//! before the cache), the first open through `TranscriptSettings::open` (the lease's path: a
//! blocking thread, the settings' cache; a full read, as nothing is cached yet), and the
//! following opens of a conversation whose previous lease appended one entry (a turn), which
//! read only that entry and the line before it.
//!
//! Run with `cargo bench --bench transcript`. Numbers are wall-clock on this machine;
//! printed, never asserted.

#[path = "support/summary.rs"]
mod summary;

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use copilot_pool::transcript::{Entry, Role, Transcript, TranscriptMode};
use copilot_pool::turn::TranscriptSettings;
use summary::summary;

const SIZES: [usize; 4] = [10, 100, 1_000, 10_000];
/// Full reads per size.
const FULL_READS: usize = 30;
/// Leases (open, append one entry, close) per size.
const LEASES: usize = 200;

/// Writes `n` entries the way the mirror does (one JSON object per line), without an fsync
/// per line, so building a 10,000-entry transcript takes no time.
fn write_transcript(path: &Path, session: &str, n: usize) {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).expect("create"));
    for i in 0..n {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let line = serde_json::json!({
            "id": format!("evt-{i}"),
            "scope": format!("copilot:{session}"),
            "role": role,
            "content": format!("message {i}: {}", "lorem ipsum dolor sit amet ".repeat(6)),
            "ts_ms": 1_700_000_000_000u64 + i as u64,
        });
        serde_json::to_writer(&mut file, &line).expect("write");
        file.write_all(b"\n").expect("write");
    }
    file.flush().expect("flush");
}

#[tokio::main]
async fn main() {
    let scratch = tempfile::tempdir().expect("tempdir");
    println!("transcript open per lease, by entries in the file before the lease");
    for n in SIZES {
        let dir = scratch.path().join(format!("n{n}"));
        std::fs::create_dir_all(&dir).expect("dir");
        let session = format!("bench-{n}");
        write_transcript(&dir.join(format!("copilot-{session}.jsonl")), &session, n);

        let mut full = Vec::with_capacity(FULL_READS);
        let mut full_bytes = 0;
        for _ in 0..FULL_READS {
            let (dir, session) = (dir.clone(), session.clone());
            let t = Instant::now();
            let opened = tokio::task::spawn_blocking(move || {
                Transcript::open(&dir, &session, TranscriptMode::Strict)
            })
            .await
            .expect("join")
            .expect("open");
            full.push(t.elapsed());
            full_bytes = opened.bytes_read();
        }

        let settings = TranscriptSettings::new(&dir, TranscriptMode::Strict);
        let t = Instant::now();
        let first = settings.open(&session).await.expect("first open");
        let first_time = t.elapsed();
        let first_bytes = first.bytes_read();
        drop(first);

        let mut cached: Vec<Duration> = Vec::with_capacity(LEASES);
        let mut cached_bytes = 0;
        for turn in 0..LEASES {
            let t = Instant::now();
            let mut transcript = settings.open(&session).await.expect("open");
            cached.push(t.elapsed());
            cached_bytes = cached_bytes.max(transcript.bytes_read());
            let reply = format!("turn {turn}");
            let appended = transcript
                .append(&Entry::new(Role::Assistant, &reply))
                .expect("append");
            assert!(appended, "the turn's entry was not new");
        }
        println!("n = {n} entries");
        summary(&format!("  full read ({full_bytes} B)"), full.clone());
        summary(
            &format!("  first lease ({first_bytes} B)"),
            vec![first_time],
        );
        summary(&format!("  later leases (<= {cached_bytes} B)"), cached);
    }
}
