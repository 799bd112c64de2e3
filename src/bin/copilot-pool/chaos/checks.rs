//! The chaos run's invariants, each read from what the run left: the model's request log
//! (histories), the transcript files (duplicates, torn lines), `/proc` (orphans, zombies,
//! this process's memory and descriptors) and the metrics the pool recorded.

use std::collections::BTreeMap;
use std::path::Path;

use copilot_pool::scripted_model::RecordedRequest;
use copilot_pool::transcript::count_duplicates;
use serde::Serialize;

use super::client::{Ended, TurnRecord, marker};

/// One invariant: held or broken, with the count that decides it and what it counts.
#[derive(Debug, Clone, Serialize)]
pub struct Invariant {
    pub name: &'static str,
    pub held: bool,
    pub count: u64,
    pub detail: String,
}

impl Invariant {
    pub fn zero(name: &'static str, count: u64, detail: String) -> Self {
        Invariant {
            name,
            held: count == 0,
            count,
            detail,
        }
    }
}

/// Turns whose request to the model lacked an earlier turn of the same conversation that had
/// ended `idle` before it was sent: a lost history. Returns (requests checked, losses, the
/// first few losses in words).
pub fn lost_histories(
    requests: &[RecordedRequest],
    turns: &BTreeMap<usize, Vec<TurnRecord>>,
) -> (u64, u64, Vec<String>) {
    let (mut checked, mut lost, mut examples) = (0, 0, Vec::new());
    for request in requests {
        let text = serde_json::to_string(request.messages()).unwrap_or_default();
        let Some((conversation, turn)) = newest_marker(&text) else {
            continue;
        };
        let Some(records) = turns.get(&conversation) else {
            continue;
        };
        checked += 1;
        for earlier in records.iter().filter(|r| r.turn < turn) {
            if earlier.ended == Ended::Status("idle".to_owned())
                && !text.contains(&marker(conversation, earlier.turn))
            {
                lost += 1;
                if examples.len() < 5 {
                    examples.push(format!(
                        "conversation {conversation} turn {turn} did not carry its turn {}",
                        earlier.turn
                    ));
                }
                break;
            }
        }
    }
    (checked, lost, examples)
}

/// The conversation and the highest turn of the markers in `text`.
fn newest_marker(text: &str) -> Option<(usize, u32)> {
    let mut newest: Option<(usize, u32)> = None;
    for (at, _) in text.match_indices("chaos-marker c") {
        let rest = &text[at + "chaos-marker c".len()..];
        let Some((c, rest)) = rest.split_once("-t") else {
            continue;
        };
        let t: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if let (Ok(c), Ok(t)) = (c.parse(), t.parse())
            && newest.is_none_or(|(_, n)| t > n)
        {
            newest = Some((c, t));
        }
    }
    newest
}

/// (files, duplicate lines, torn lines) of the transcripts in `dir`.
pub fn transcript_damage(dir: &Path) -> (u64, u64, u64) {
    let (mut files, mut duplicates, mut torn) = (0, 0, 0);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0, 0);
    };
    for path in entries.flatten().map(|e| e.path()) {
        if path.extension().is_none_or(|e| e != "jsonl") {
            continue;
        }
        files += 1;
        duplicates += count_duplicates(&path).unwrap_or(0) as u64;
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if !text.is_empty() && !text.ends_with('\n') {
            torn += 1;
        }
        torn += text
            .lines()
            .filter(|l| !l.is_empty() && serde_json::from_str::<serde_json::Value>(l).is_err())
            .count() as u64;
    }
    (files, duplicates, torn)
}

/// Children of this process that are zombies.
pub fn zombies() -> u64 {
    let me = std::process::id();
    crate::procfs::all()
        .iter()
        .filter(|p| p.state == 'Z' && p.ppid == me)
        .count() as u64
}

/// This process's resident memory (bytes) and open descriptors.
pub fn own_resources() -> (u64, u64) {
    let me = std::process::id();
    (crate::procfs::own_rss_bytes(), crate::procfs::fd_count(me))
}

/// The value of the counter series `name{labels}` in a Prometheus text rendering (0 if
/// absent). `labels` is the exact label set as rendered, e.g. `reason="crash"`.
pub fn counter(rendered: &str, name: &str, labels: &str) -> u64 {
    // Every series of `name` whose labels include each of `labels` (`k="v"` pairs joined by
    // commas; none: every series): a series may carry more labels than a check names
    // (`backend` on turns).
    let wanted: Vec<&str> = labels.split(',').filter(|l| !l.is_empty()).collect();
    rendered
        .lines()
        .filter_map(|l| l.strip_prefix(name))
        .filter_map(|rest| {
            let (series_labels, value) = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            let have: Vec<&str> = series_labels.split(',').collect();
            wanted.iter().all(|w| have.contains(w)).then_some(value)
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_marker_is_the_highest_turn() {
        let text = "chaos-marker c3-t0. hi chaos-marker c3-t12. x chaos-marker c3-t2.";
        assert_eq!(newest_marker(text), Some((3, 12)));
        assert_eq!(newest_marker("nothing"), None);
    }

    fn request(texts: &[String]) -> RecordedRequest {
        use copilot_pool::scripted_model::{Answer, Transport};
        let messages: Vec<serde_json::Value> = texts
            .iter()
            .map(|t| serde_json::json!({"role": "user", "content": t}))
            .collect();
        RecordedRequest {
            transport: Transport::Http,
            method: "POST".to_owned(),
            path: "/v1/chat/completions".to_owned(),
            query: None,
            session_id: None,
            headers: Vec::new(),
            body: serde_json::json!({ "messages": messages }),
            answer: Answer::NotFound,
        }
    }

    fn record(turn: u32, ended: &str) -> TurnRecord {
        TurnRecord {
            turn,
            ended: Ended::Status(ended.to_owned()),
            open_reason: None,
            millis: 0,
        }
    }

    #[test]
    fn a_request_missing_an_earlier_idle_turn_is_a_lost_history_and_other_ends_are_not() {
        let turns = BTreeMap::from([(7, vec![record(0, "idle"), record(1, "crashed")])]);
        // Turn 2 carries turn 0 (idle); turn 1 crashed, so it need not be there.
        let kept = request(&[marker(7, 0), marker(7, 2)]);
        assert_eq!(lost_histories(&[kept], &turns), (1, 0, vec![]));
        // Turn 2 without turn 0: lost.
        let lost = request(&[marker(7, 2)]);
        let (checked, lost_count, examples) = lost_histories(&[lost], &turns);
        assert_eq!((checked, lost_count), (1, 1));
        assert!(examples[0].contains("turn 0"), "{examples:?}");
        // A request of a conversation the run did not record is not checked.
        assert_eq!(lost_histories(&[request(&[marker(9, 1)])], &turns).0, 0);
    }

    #[test]
    fn duplicate_torn_and_unterminated_transcript_lines_are_counted() {
        let dir = std::env::temp_dir().join(format!("chaos-checks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch dir");
        let line = r#"{"id":"e1","type":"a"}"#;
        std::fs::write(dir.join("twice.jsonl"), format!("{line}\n{line}\n")).expect("write");
        std::fs::write(
            dir.join("torn.jsonl"),
            format!("{line}\n{{\"id\":\"e2\",\"ty"),
        )
        .expect("write");
        std::fs::write(dir.join("notes.txt"), "not a transcript").expect("write");
        let (files, duplicates, torn) = transcript_damage(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(files, 2);
        assert_eq!(duplicates, 1, "e1 twice in one transcript");
        // The broken last line is both unterminated and not JSON.
        assert_eq!(torn, 2);
    }

    #[test]
    fn a_counter_sums_every_series_of_its_name_that_has_the_labels_named() {
        let text = "# TYPE x counter\nx_total{reason=\"crash\"} 3\nx_total{reason=\"crashy\"} 9\nx_total 4\nx_total_more{reason=\"crash\"} 5\ny_total{outcome=\"aborted\",backend=\"copilot\"} 2\ny_total{outcome=\"aborted\",backend=\"claude-cli\"} 1\ny_total{outcome=\"idle\",backend=\"copilot\"} 7\n";
        assert_eq!(counter(text, "x_total", "reason=\"crash\""), 3);
        // A series with more labels than the check names is counted; every one that has them.
        assert_eq!(counter(text, "y_total", "outcome=\"aborted\""), 3);
        assert_eq!(
            counter(text, "y_total", "outcome=\"aborted\",backend=\"copilot\""),
            2
        );
        // No labels named: every series of the name.
        assert_eq!(counter(text, "x_total", ""), 16);
        assert_eq!(counter(text, "z_total", ""), 0);
    }
}
