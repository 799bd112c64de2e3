//! The transcript mirror: per conversation, an append-only JSONL file
//! (`<dir>/copilot-<sessionId>.jsonl`) recording the user, assistant and tool messages of a
//! Copilot CLI session, so a gateway keeps its own record independent of the CLI's state.
//!
//! This module owns the file format, entry identities (the CLI event id, or a content hash),
//! de-duplication across re-emissions and process restarts, durability (one `write_all` per
//! line in append mode, then `fsync`), repair of a torn last line on open, and the choice
//! between best-effort and strict persistence.
//!
//! One writer per file is assumed (the pool serializes a conversation's turns); several
//! [`Transcript`]s appending to the same file concurrently could duplicate ids.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

/// The longest session id accepted.
pub const MAX_SESSION_ID_LEN: usize = 128;

/// How many characters of a rejected session id an error shows.
const SHOWN_ID_CHARS: usize = 80;

/// How many hex characters of the content hash an id without event id carries.
const HASH_HEX_CHARS: usize = 16;

/// What happens when a line cannot be persisted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TranscriptMode {
    /// Log a warning, count the failure in [`Transcript::failed_writes`], and carry on
    /// (`append` returns `Ok(false)`).
    #[default]
    BestEffort,
    /// Return [`TranscriptError::PersistenceFailed`]; the caller aborts the turn.
    Strict,
}

/// Who a message is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The user's prompt.
    User,
    /// The assistant's reply.
    Assistant,
    /// A tool's result.
    Tool,
}

impl Role {
    /// The role as written in the file: `user`, `assistant` or `tool`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One message to mirror.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The CLI event id, when the caller has one; it becomes the entry's identity.
    pub event_id: Option<&'a str>,
    /// Who the message is from.
    pub role: Role,
    /// The message text.
    pub content: &'a str,
    /// The tool's name, for tool messages.
    pub tool_name: Option<&'a str>,
    /// The tool call this result answers, for tool messages.
    pub tool_call_id: Option<&'a str>,
}

impl<'a> Entry<'a> {
    /// An entry without event id or tool fields.
    pub fn new(role: Role, content: &'a str) -> Self {
        Entry {
            event_id: None,
            role,
            content,
            tool_name: None,
            tool_call_id: None,
        }
    }

    /// The same entry identified by the CLI event id `event_id`.
    pub fn with_event_id(mut self, event_id: &'a str) -> Self {
        self.event_id = Some(event_id);
        self
    }
}

/// Why a transcript could not be opened, read or written.
#[derive(Debug, thiserror::Error)]
pub enum TranscriptError {
    /// The session id is not safe as part of a file name.
    #[error(
        "invalid session id {shown:?} for a transcript file name: it must be 1 to 128 \
         characters from [A-Za-z0-9._-] and must not start with '.'; pass the CLI's session \
         id unchanged, or map it to an id of that form"
    )]
    InvalidSessionId {
        /// The rejected id, truncated to 80 characters.
        shown: String,
    },
    /// The transcript directory could not be created.
    #[error(
        "could not create the transcript directory {path:?}: {source}; make sure its parent \
         exists and is writable, or configure another transcript directory"
    )]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The transcript file could not be opened, read or repaired.
    #[error(
        "could not open, read or repair the transcript {path:?}: {source}; make sure it is a \
         regular file readable and writable by this user (and that the disk is not full or \
         read-only), or move it aside to start a new transcript"
    )]
    Open {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A line could not be written durably (strict mode only).
    #[error(
        "could not persist a transcript entry to {path:?}: {source}; the turn was not \
         recorded, so free disk space or fix the file's permissions and retry the turn, or \
         run with the best-effort transcript mode"
    )]
    PersistenceFailed {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

/// Checks that `session_id` is 1 to 128 characters from `[A-Za-z0-9._-]` not starting
/// with `.`, so it is safe inside a file name.
pub fn validate_session_id(session_id: &str) -> Result<(), TranscriptError> {
    let bytes = session_id.as_bytes();
    let valid = !bytes.is_empty()
        && bytes.len() <= MAX_SESSION_ID_LEN
        && bytes[0] != b'.'
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(TranscriptError::InvalidSessionId {
            shown: session_id.chars().take(SHOWN_ID_CHARS).collect(),
        })
    }
}

/// The identity of `entry`: its event id if it has one, else `"<role>:"` followed by the
/// first 16 hex characters of `sha256(role + "\n" + content)`.
pub fn entry_id(entry: &Entry<'_>) -> String {
    if let Some(event_id) = entry.event_id {
        return event_id.to_owned();
    }
    let role = entry.role.as_str();
    let mut hasher = Sha256::new();
    hasher.update(role.as_bytes());
    hasher.update(b"\n");
    hasher.update(entry.content.as_bytes());
    let digest = hasher.finalize();
    let mut id = String::with_capacity(role.len() + 1 + HASH_HEX_CHARS);
    id.push_str(role);
    id.push(':');
    for byte in digest.iter().take(HASH_HEX_CHARS / 2) {
        id.push(hex_digit(byte >> 4));
        id.push(hex_digit(byte & 0x0f));
    }
    id
}

fn hex_digit(nibble: u8) -> char {
    char::from(b"0123456789abcdef"[usize::from(nibble & 0x0f)])
}

/// The scope string of a session: `copilot:<sessionId>`.
pub fn scope_for(session_id: &str) -> String {
    format!("copilot:{session_id}")
}

/// The transcript file of a session: `<dir>/copilot-<sessionId>.jsonl`.
pub fn transcript_path(dir: &Path, session_id: &str) -> Result<PathBuf, TranscriptError> {
    validate_session_id(session_id)?;
    Ok(dir.join(format!("copilot-{session_id}.jsonl")))
}

/// One line as written.
#[derive(serde::Serialize)]
struct Record<'a> {
    id: &'a str,
    scope: &'a str,
    role: Role,
    content: &'a str,
    ts_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
}

/// The part of a line read back.
#[derive(serde::Deserialize)]
struct IdOnly {
    id: String,
}

/// The append-only transcript of one session. See the module documentation.
#[derive(Debug)]
pub struct Transcript {
    path: PathBuf,
    scope: String,
    file: File,
    /// Ids already in the file.
    seen: HashSet<String>,
    mode: TranscriptMode,
    failed_writes: u64,
    /// A failed write may have left a partial line that could not be cut off: the next
    /// line starts with a newline so it is not glued to it.
    torn: bool,
}

impl Transcript {
    /// Opens (creating if missing) the transcript of `session_id` in `dir`, creating `dir`
    /// with mode 0700 if missing. Reads the ids of every complete line; a partial last line
    /// left by a crash is truncated away, and lines that are not valid JSON are skipped.
    pub fn open(
        dir: &Path,
        session_id: &str,
        mode: TranscriptMode,
    ) -> Result<Self, TranscriptError> {
        let path = transcript_path(dir, session_id)?;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| TranscriptError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        let open_err = |source| TranscriptError::Open {
            path: path.clone(),
            source,
        };
        let mut options = OpenOptions::new();
        options.read(true).append(true).mode(0o600);
        let (file, created) = match options.clone().create_new(true).open(&path) {
            Ok(file) => (file, true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                (options.open(&path).map_err(open_err)?, false)
            }
            Err(e) => return Err(open_err(e)),
        };
        if created {
            // Make the new directory entry durable too.
            if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
                tracing::warn!(dir = %dir.display(), error = %e, "could not fsync the transcript directory");
            }
        }
        let scan = scan(&file, &path).map_err(open_err)?;
        if scan.complete_len < scan.total_len {
            let dropped = scan.total_len - scan.complete_len;
            tracing::warn!(
                path = %path.display(),
                dropped_bytes = dropped,
                "transcript ends with a partial line (interrupted write); truncating it"
            );
            file.set_len(scan.complete_len).map_err(open_err)?;
            file.sync_data().map_err(open_err)?;
        }
        let seen = scan.ids.into_iter().collect();
        Ok(Transcript {
            path,
            scope: scope_for(session_id),
            file,
            seen,
            mode,
            failed_writes: 0,
            torn: false,
        })
    }

    /// Appends `entry` unless its id ([`entry_id`]) is already in the file. Returns
    /// `Ok(true)` if a line was written and synced, `Ok(false)` if the id was already there
    /// or (best-effort mode) the write failed, and [`TranscriptError::PersistenceFailed`]
    /// if the write failed in strict mode.
    pub fn append(&mut self, entry: &Entry<'_>) -> Result<bool, TranscriptError> {
        let id = entry_id(entry);
        if self.seen.contains(&id) {
            return Ok(false);
        }
        match self.write_line(&id, entry) {
            Ok(()) => {
                self.seen.insert(id);
                Ok(true)
            }
            Err(source) => {
                self.failed_writes += 1;
                match self.mode {
                    TranscriptMode::BestEffort => {
                        tracing::warn!(
                            path = %self.path.display(),
                            id = %id,
                            error = %source,
                            failed_writes = self.failed_writes,
                            "could not persist a transcript entry; continuing (best-effort mode)"
                        );
                        Ok(false)
                    }
                    TranscriptMode::Strict => Err(TranscriptError::PersistenceFailed {
                        path: self.path.clone(),
                        source,
                    }),
                }
            }
        }
    }

    /// Writes the line of `entry` with one `write_all`, then `fsync`s; on failure, cuts
    /// the file back to its previous length so no partial or unsynced line stays behind.
    fn write_line(&mut self, id: &str, entry: &Entry<'_>) -> io::Result<()> {
        let record = Record {
            id,
            scope: &self.scope,
            role: entry.role,
            content: entry.content,
            ts_ms: now_ms(),
            tool_name: entry.tool_name,
            tool_call_id: entry.tool_call_id,
        };
        let mut line = Vec::with_capacity(entry.content.len() + 128);
        if self.torn {
            line.push(b'\n');
        }
        serde_json::to_writer(&mut line, &record).map_err(io::Error::other)?;
        line.push(b'\n');
        let before = self.file.metadata()?.len();
        let result = self
            .file
            .write_all(&line)
            .and_then(|()| self.file.sync_data());
        match result {
            Ok(()) => {
                self.torn = false;
                Ok(())
            }
            Err(e) => {
                let rollback = self
                    .file
                    .set_len(before)
                    .and_then(|()| self.file.sync_data());
                match rollback {
                    Ok(()) => {}
                    Err(rollback_error) => {
                        self.torn = true;
                        tracing::warn!(
                            path = %self.path.display(),
                            error = %rollback_error,
                            "could not cut a failed transcript write back; the next line starts on a new line"
                        );
                    }
                }
                Err(e)
            }
        }
    }

    /// The transcript file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The scope string, `copilot:<sessionId>`.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The persistence mode.
    pub fn mode(&self) -> TranscriptMode {
        self.mode
    }

    /// How many distinct entries the file holds.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether the file holds no entry.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// Whether an entry with `id` is in the file.
    pub fn contains(&self, id: &str) -> bool {
        self.seen.contains(id)
    }

    /// How many writes failed since this `Transcript` was opened (both modes).
    pub fn failed_writes(&self) -> u64 {
        self.failed_writes
    }

    /// Test only: sends further writes to `/dev/full`, where they fail with ENOSPC.
    #[cfg(test)]
    fn fail_writes(&mut self) {
        self.file = OpenOptions::new()
            .append(true)
            .open("/dev/full")
            .expect("open /dev/full");
    }
}

/// How many distinct ids appear on more than one complete line of the transcript at
/// `path` (a correct transcript has none). Invalid lines and a partial last line are
/// ignored.
pub fn count_duplicates(path: &Path) -> Result<usize, TranscriptError> {
    let file = File::open(path).map_err(|source| TranscriptError::Open {
        path: path.to_owned(),
        source,
    })?;
    let scan = scan(&file, path).map_err(|source| TranscriptError::Open {
        path: path.to_owned(),
        source,
    })?;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for id in scan.ids {
        *counts.entry(id).or_default() += 1;
    }
    Ok(counts.values().filter(|&&n| n > 1).count())
}

/// What reading a transcript found.
struct Scan {
    /// The ids of the complete, valid lines, in file order (with repeats).
    ids: Vec<String>,
    /// The length up to and including the last newline.
    complete_len: u64,
    /// The file's length.
    total_len: u64,
}

/// Reads every line of `file` from the start.
fn scan(file: &File, path: &Path) -> io::Result<Scan> {
    let mut reader = BufReader::new(file);
    let mut ids = Vec::new();
    let mut line = Vec::new();
    let mut complete_len = 0u64;
    let mut total_len = 0u64;
    let mut line_no = 0u64;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        total_len += n as u64;
        if line.last() != Some(&b'\n') {
            // The partial last line: the caller decides.
            break;
        }
        complete_len = total_len;
        line_no += 1;
        let text = &line[..line.len() - 1];
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<IdOnly>(text) {
            Ok(record) => ids.push(record.id),
            Err(e) => tracing::warn!(
                path = %path.display(),
                line = line_no,
                error = %e,
                "skipping a transcript line that is not a valid entry"
            ),
        }
    }
    Ok(Scan {
        ids,
        complete_len,
        total_len,
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids_in(path: &Path) -> Vec<String> {
        let text = fs::read_to_string(path).unwrap();
        text.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["id"].as_str().unwrap().to_owned()
            })
            .collect()
    }

    #[test]
    fn event_id_wins_and_hash_form() {
        let e = Entry::new(Role::User, "hello").with_event_id("evt-1");
        assert_eq!(entry_id(&e), "evt-1");

        let user = entry_id(&Entry::new(Role::User, "hello"));
        assert!(user.starts_with("user:"), "{user}");
        let hex = &user["user:".len()..];
        assert_eq!(hex.len(), 16);
        assert!(
            hex.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        // The first 8 digest bytes, hex-encoded independently.
        let full = Sha256::digest(b"user\nhello");
        let expected: String = full[..8].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, expected);

        let assistant = entry_id(&Entry::new(Role::Assistant, "hello"));
        assert!(assistant.starts_with("assistant:"));
        assert_ne!(user[5..], assistant[10..]);
        assert_ne!(
            entry_id(&Entry::new(Role::Tool, "hello")),
            entry_id(&Entry::new(Role::User, "hello"))
        );
        assert_eq!(user, entry_id(&Entry::new(Role::User, "hello")));
    }

    #[test]
    fn line_format() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Transcript::open(dir.path(), "s-1", TranscriptMode::Strict).unwrap();
        assert_eq!(t.scope(), "copilot:s-1");
        assert_eq!(t.path(), dir.path().join("copilot-s-1.jsonl"));
        assert!(t.is_empty());
        let tool = Entry {
            event_id: Some("e9"),
            role: Role::Tool,
            content: "out",
            tool_name: Some("bash"),
            tool_call_id: Some("call-1"),
        };
        assert!(t.append(&tool).unwrap());
        assert!(t.append(&Entry::new(Role::User, "hi")).unwrap());
        let text = fs::read_to_string(t.path()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines[0]["id"], "e9");
        assert_eq!(lines[0]["scope"], "copilot:s-1");
        assert_eq!(lines[0]["role"], "tool");
        assert_eq!(lines[0]["content"], "out");
        assert_eq!(lines[0]["tool_name"], "bash");
        assert_eq!(lines[0]["tool_call_id"], "call-1");
        assert!(lines[0]["ts_ms"].as_u64().unwrap() > 0);
        assert_eq!(lines[1]["role"], "user");
        assert!(lines[1].get("tool_name").is_none());
        assert!(lines[1].get("tool_call_id").is_none());
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn no_duplicate_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let a = Entry::new(Role::User, "q").with_event_id("e1");
        let b = Entry::new(Role::Assistant, "answer");
        {
            let mut t = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
            assert!(t.append(&a).unwrap());
            assert!(!t.append(&a).unwrap());
            assert!(t.append(&b).unwrap());
        }
        let mut t = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
        assert_eq!(t.len(), 2);
        assert!(!t.append(&a).unwrap());
        assert!(!t.append(&b).unwrap());
        assert!(t.append(&Entry::new(Role::Assistant, "more")).unwrap());
        assert_eq!(count_duplicates(t.path()).unwrap(), 0);
        assert_eq!(ids_in(t.path()).len(), 3);
    }

    #[test]
    fn partial_last_line_is_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let path;
        {
            let mut t = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
            assert!(t.append(&Entry::new(Role::User, "one")).unwrap());
            path = t.path().to_owned();
        }
        let good_len = fs::metadata(&path).unwrap().len();
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"id":"torn","scope":"copilot:s","ro"#)
            .unwrap();
        drop(f);

        let mut t = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), good_len);
        assert_eq!(t.len(), 1);
        assert!(t.append(&Entry::new(Role::Assistant, "two")).unwrap());
        let ids = ids_in(&path);
        assert_eq!(ids.len(), 2);
        assert!(ids[1].starts_with("assistant:"));
    }

    #[test]
    fn invalid_middle_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("copilot-s.jsonl");
        fs::write(
            &path,
            "{\"id\":\"a\"}\nnot json\n{\"no_id\":1}\n\n{\"id\":\"b\"}\n",
        )
        .unwrap();
        let mut t = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
        assert_eq!(t.len(), 2);
        assert!(
            !t.append(&Entry::new(Role::User, "x").with_event_id("b"))
                .unwrap()
        );
        assert!(
            t.append(&Entry::new(Role::User, "x").with_event_id("c"))
                .unwrap()
        );
        let text = fs::read_to_string(&path).unwrap();
        let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(last["id"], "c");
        assert_eq!(count_duplicates(&path).unwrap(), 0);
    }

    #[test]
    fn strict_mode_fails_and_does_not_mark_seen() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
        t.fail_writes();
        let e = Entry::new(Role::User, "q").with_event_id("e1");
        let err = t.append(&e).unwrap_err();
        assert!(
            matches!(err, TranscriptError::PersistenceFailed { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("retry"));
        assert_eq!(t.failed_writes(), 1);
        assert!(!t.contains("e1"));
        assert!(t.is_empty());

        let mut t = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
        assert!(t.append(&e).unwrap());
    }

    #[test]
    fn best_effort_mode_counts_and_continues() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Transcript::open(dir.path(), "s", TranscriptMode::BestEffort).unwrap();
        assert_eq!(t.mode(), TranscriptMode::default());
        t.fail_writes();
        let e = Entry::new(Role::Assistant, "a");
        assert!(!t.append(&e).unwrap());
        assert!(!t.append(&e).unwrap());
        assert_eq!(t.failed_writes(), 2);
        assert!(t.is_empty());
    }

    #[test]
    fn invalid_session_ids_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let long = "a".repeat(129);
        for bad in [
            "",
            ".hidden",
            "..",
            "a/b",
            "a b",
            "é",
            "x\0y",
            long.as_str(),
        ] {
            let err = Transcript::open(dir.path(), bad, TranscriptMode::Strict).unwrap_err();
            assert!(
                matches!(err, TranscriptError::InvalidSessionId { .. }),
                "{bad:?}: {err}"
            );
        }
        let ok = "a".repeat(128);
        for good in ["a", "A.b_c-9", "1.", ok.as_str()] {
            validate_session_id(good).unwrap();
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn creates_dir_with_mode_0700() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("a/b");
        let t = Transcript::open(&sub, "s", TranscriptMode::Strict).unwrap();
        let mode = fs::metadata(&sub).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert!(t.path().exists());
    }

    #[test]
    fn count_duplicates_counts_hand_written_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        fs::write(
            &path,
            "{\"id\":\"a\"}\n{\"id\":\"b\"}\n{\"id\":\"a\"}\n{\"id\":\"a\"}\n{\"id\":\"c\"}\n\
             {\"id\":\"c\"}\n{\"id\":\"d\"}\n{\"id\":\"d\"",
        )
        .unwrap();
        assert_eq!(count_duplicates(&path).unwrap(), 2);
        let missing = count_duplicates(&dir.path().join("nope")).unwrap_err();
        assert!(matches!(missing, TranscriptError::Open { .. }));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Append(usize),
        Reopen,
    }

    const POOL: &[(Option<&str>, Role, &str)] = &[
        (Some("e1"), Role::User, "hello"),
        (Some("e2"), Role::Assistant, "hello"),
        (None, Role::User, "hello"),
        (None, Role::Assistant, "hello"),
        (None, Role::Tool, "result"),
        (Some("e3"), Role::Tool, "result"),
        (None, Role::User, "second"),
    ];

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0..POOL.len()).prop_map(Op::Append),
            1 => Just(Op::Reopen),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn never_duplicates_and_keeps_first_order(ops in prop::collection::vec(op(), 0..60)) {
            let dir = tempfile::tempdir().unwrap();
            let mut t = Transcript::open(dir.path(), "prop", TranscriptMode::Strict).unwrap();
            let mut expected: Vec<String> = Vec::new();
            for op in ops {
                match op {
                    Op::Append(i) => {
                        let (event_id, role, content) = POOL[i];
                        let entry = Entry { event_id, role, content, tool_name: None, tool_call_id: None };
                        let id = entry_id(&entry);
                        let is_new = !expected.contains(&id);
                        prop_assert_eq!(t.append(&entry).unwrap(), is_new);
                        if is_new {
                            expected.push(id);
                        }
                    }
                    Op::Reopen => {
                        drop(t);
                        t = Transcript::open(dir.path(), "prop", TranscriptMode::Strict).unwrap();
                    }
                }
                prop_assert_eq!(t.len(), expected.len());
            }
            let path = t.path().to_owned();
            prop_assert_eq!(ids_in(&path), expected);
            prop_assert_eq!(count_duplicates(&path).unwrap(), 0);
        }
    }
}
