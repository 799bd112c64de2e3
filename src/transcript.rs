//! The transcript mirror: per conversation, an append-only JSONL file
//! (`<dir>/copilot-<sessionId>.jsonl`) recording the user, assistant and tool messages of a
//! Copilot CLI session, so a gateway keeps its own record independent of the CLI's state.
//!
//! This module owns the file format, entry identities (the CLI event id, or a content hash),
//! de-duplication across re-emissions and process restarts, durability (one `write_all` per
//! line in append mode, then `fsync`), repair of a torn last line on open, the choice
//! between best-effort and strict persistence, and the [`TranscriptCache`] that lets a reopen
//! read only what was appended since the last close.
//!
//! [`Transcript::open`] reads the whole file. [`Transcript::open_cached`] starts from what the
//! cache remembers of the file (its identity, the length read so far, the ids in it, and the
//! length and SHA-256 of its last line) and reads only that last line, to check it, and the
//! lines after it; it falls back to a full read when the file was replaced, shrank, or its
//! last remembered line changed, or when the last writer lost track of it (a failed write it
//! could not cut back, a write from someone else). A same-length rewrite of earlier lines in
//! place goes unnoticed: the mirror is append-only, and nothing but a full read could tell.
//! Both block on the disk: async callers run them on a blocking thread
//! (`TranscriptSettings::open` in `crate::turn` does).
//!
//! One writer per file is assumed (the pool serializes a conversation's turns); several
//! [`Transcript`]s appending to the same file concurrently could duplicate ids.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::faults::{self, SharedDiskFaults, Store};
use crate::rpc::{EventKind, SessionEvent};

/// The longest session id accepted.
pub const MAX_SESSION_ID_LEN: usize = 128;

/// How many characters of a rejected session id an error shows.
const SHOWN_ID_CHARS: usize = 80;

/// How many hex characters of the content hash an id without event id carries.
const HASH_HEX_CHARS: usize = 16;

/// How many files a [`TranscriptCache`] remembers by default.
pub const DEFAULT_CACHED_FILES: usize = 256;

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

/// What a runtime session event adds to a conversation's record: the main agent's user
/// messages, its assistant messages with text, its tool results (the result's `content`,
/// else the error), and the summary of a successful compaction (the fallback prelude starts
/// from it). One place, for the mirror (a running turn, an aborted turn's drain:
/// `crate::turn::driver`) and for reading the runtime's own event log where no mirror is kept
/// (`crate::fallback::read_copilot_events_tail`).
pub(crate) struct EventEntry<'a> {
    /// Who the message is from.
    pub(crate) role: Role,
    /// Its text.
    pub(crate) content: std::borrow::Cow<'a, str>,
    /// The tool call a tool result answers.
    pub(crate) tool_call_id: Option<&'a str>,
}

impl<'a> EventEntry<'a> {
    /// The entry `event` adds, if any.
    pub(crate) fn of(event: &'a SessionEvent) -> Option<Self> {
        use std::borrow::Cow;
        if event.agent_id().is_some() {
            return None;
        }
        let entry = |role, content, tool_call_id| EventEntry {
            role,
            content,
            tool_call_id,
        };
        match &event.kind {
            EventKind::AssistantMessage(m) if !m.content.is_empty() => Some(entry(
                Role::Assistant,
                Cow::Borrowed(m.content.as_str()),
                None,
            )),
            EventKind::UserMessage(m) => {
                Some(entry(Role::User, Cow::Borrowed(m.content.as_str()), None))
            }
            EventKind::ToolExecutionComplete(t) => {
                let content = match t
                    .result
                    .as_ref()
                    .and_then(|r| r.get("content"))
                    .and_then(serde_json::Value::as_str)
                {
                    Some(text) => Cow::Borrowed(text),
                    None => Cow::Owned(t.error.as_ref().map(|e| e.to_string()).unwrap_or_default()),
                };
                Some(entry(Role::Tool, content, Some(t.tool_call_id.as_str())))
            }
            EventKind::CompactionComplete(c) if c.success => c
                .summary_content
                .as_deref()
                .filter(|s| !s.is_empty())
                .map(|summary| entry(Role::Summary, Cow::Borrowed(summary), None)),
            _ => None,
        }
    }
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
    /// The summary a compaction wrote in place of the messages it removed.
    Summary,
}

impl Role {
    /// The role as written in the file: `user`, `assistant`, `tool` or `summary`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            Role::Summary => "summary",
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
    format!("{role}:{}", crate::ids::hex(&digest[..HASH_HEX_CHARS / 2]))
}

/// An entry id as the de-duplication remembers it: the first 8 bytes of its SHA-256. A
/// transcript of millions of lines (and the cache keeps up to 256 of them) holds 8 bytes per
/// line instead of the id's text; two ids of one file sharing a digest (odds ~n²/2⁶⁵: about
/// 3 in 100 million for a million lines) would drop the second one's line.
type IdDigest = u64;

fn id_digest(id: &str) -> IdDigest {
    let digest = Sha256::digest(id.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
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

/// What a [`TranscriptCache`] remembers of one file between a close and the next open.
struct Known {
    identity: FileIdentity,
    /// The length read or written so far: the end of the last complete line.
    len: u64,
    /// The line that ends at `len` (none for an empty file).
    last_line: Option<LineFingerprint>,
    /// How many lines end before `len` (for the line numbers of warnings).
    lines: u64,
    /// The ids of the valid lines before `len` ([`IdDigest`]s).
    seen: HashSet<IdDigest>,
    /// When it was last put back (the least recent is forgotten first).
    used: u64,
}

/// Which file a path named: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileIdentity {
    dev: u64,
    ino: u64,
}

impl FileIdentity {
    fn of(meta: &fs::Metadata) -> Self {
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

/// A line's length and SHA-256, to recognise it without keeping it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LineFingerprint {
    len: u64,
    digest: [u8; 32],
}

impl LineFingerprint {
    fn of(line: &[u8]) -> Self {
        LineFingerprint {
            len: line.len() as u64,
            digest: Sha256::digest(line).into(),
        }
    }
}

impl Known {
    /// Whether this still describes `file`: the same file, at least as long, with the
    /// remembered last line still ending at the remembered length. Returns how many bytes it
    /// read to tell.
    fn describes(&self, file: &File, identity: FileIdentity, file_len: u64) -> (bool, u64) {
        if self.identity != identity || self.len > file_len {
            return (false, 0);
        }
        let Some(last) = self.last_line else {
            return (self.len == 0, 0);
        };
        let (Some(start), Ok(size)) = (self.len.checked_sub(last.len), usize::try_from(last.len))
        else {
            return (false, 0);
        };
        let mut bytes = vec![0u8; size];
        match file.read_exact_at(&mut bytes, start) {
            Ok(()) => (LineFingerprint::of(&bytes) == last, last.len),
            Err(_) => (false, last.len),
        }
    }
}

/// Remembers, per transcript file, what has been read of it (the ids, the length, the
/// length and SHA-256 of the last line), so that [`Transcript::open_cached`] reads only the
/// lines appended since the last [`Transcript`] of that file was dropped. Cheap to clone
/// (shared); safe to use from several threads. Holds at most a fixed number of files,
/// forgetting the least recently closed.
///
/// An open takes the file's entry out of the cache and the drop of its [`Transcript`] puts
/// it back, so a file is never described by a stale entry while it is open.
#[derive(Clone)]
pub struct TranscriptCache {
    inner: Arc<Mutex<CacheState>>,
}

struct CacheState {
    files: HashMap<PathBuf, Known>,
    capacity: usize,
    clock: u64,
}

impl TranscriptCache {
    /// A cache of at most [`DEFAULT_CACHED_FILES`] files.
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_CACHED_FILES)
    }

    /// A cache of at most `files` files (0 remembers nothing: every open reads the file).
    pub fn with_capacity(files: usize) -> Self {
        TranscriptCache {
            inner: Arc::new(Mutex::new(CacheState {
                files: HashMap::new(),
                capacity: files,
                clock: 0,
            })),
        }
    }

    /// How many files it remembers now.
    pub fn len(&self) -> usize {
        self.state().files.len()
    }

    /// Whether it remembers no file.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn state(&self) -> std::sync::MutexGuard<'_, CacheState> {
        // The state is consistent after every statement: a panic elsewhere cannot break it.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&self, path: &Path) -> Option<Known> {
        self.state().files.remove(path)
    }

    fn put(&self, path: PathBuf, mut known: Known) {
        let mut state = self.state();
        if state.capacity == 0 {
            return;
        }
        state.clock += 1;
        known.used = state.clock;
        state.files.insert(path, known);
        while state.files.len() > state.capacity {
            let oldest = state
                .files
                .iter()
                .min_by_key(|(_, known)| known.used)
                .map(|(path, _)| path.clone());
            match oldest {
                Some(path) => state.files.remove(&path),
                None => break,
            };
        }
    }
}

impl Default for TranscriptCache {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for TranscriptCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("TranscriptCache")
            .field("files", &state.files.len())
            .field("capacity", &state.capacity)
            .finish()
    }
}

/// The append-only transcript of one session. See the module documentation.
#[derive(Debug)]
pub struct Transcript {
    path: PathBuf,
    scope: String,
    file: File,
    /// Ids already in the file ([`IdDigest`]s: 8 bytes each, however long the id).
    seen: HashSet<IdDigest>,
    mode: TranscriptMode,
    failed_writes: u64,
    /// A failed write may have left a partial line that could not be cut off: the next
    /// line starts with a newline so it is not glued to it.
    torn: bool,
    identity: FileIdentity,
    /// The end of the last complete line, as read and written through this transcript.
    len: u64,
    /// The line that ends at `len`.
    last_line: Option<LineFingerprint>,
    /// How many lines end before `len`.
    lines: u64,
    /// Where to put what is known of the file when this is dropped.
    cache: Option<TranscriptCache>,
    /// The file no longer matches `len`/`last_line` (someone else wrote, or a failed write could
    /// not be cut back): the cache is not told about it, so the next open reads it all.
    untracked: bool,
    /// How many bytes of the file the open read.
    bytes_read: u64,
    /// Writes this plan fails on purpose (chaos runs); `None`: none.
    faults: Option<SharedDiskFaults>,
}

impl Transcript {
    /// Opens (creating if missing) the transcript of `session_id` in `dir`, creating `dir`
    /// with mode 0700 if missing. Reads the ids of every complete line; a partial last line
    /// left by a crash is truncated away, and lines that are not valid JSON are skipped.
    ///
    /// Blocks on the disk (reads the whole file): call it from a blocking thread.
    pub fn open(
        dir: &Path,
        session_id: &str,
        mode: TranscriptMode,
    ) -> Result<Self, TranscriptError> {
        Self::open_with(dir, session_id, mode, None)
    }

    /// [`open`](Self::open), reading only the lines appended since the last [`Transcript`]
    /// of this file opened through `cache` was dropped (the whole file the first time, or
    /// when the cache no longer describes it: see the module documentation). What it finds
    /// is the same as [`open`](Self::open) would; the drop puts it back into `cache`.
    ///
    /// Blocks on the disk: call it from a blocking thread.
    pub fn open_cached(
        dir: &Path,
        session_id: &str,
        mode: TranscriptMode,
        cache: &TranscriptCache,
    ) -> Result<Self, TranscriptError> {
        Self::open_with(dir, session_id, mode, Some(cache))
    }

    fn open_with(
        dir: &Path,
        session_id: &str,
        mode: TranscriptMode,
        cache: Option<&TranscriptCache>,
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
        // Never through a link planted at its name, and never waiting on a FIFO there: the
        // file is checked to be a regular one once open.
        let flags = nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK;
        options
            .read(true)
            .append(true)
            .mode(0o600)
            .custom_flags(flags.bits());
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
        let meta = file.metadata().map_err(open_err)?;
        if !meta.file_type().is_file() {
            return Err(open_err(io::Error::other("it is not a regular file")));
        }
        let identity = FileIdentity::of(&meta);
        let mut bytes_read = 0;
        // A file taken out of the cache stays out while open (the drop puts it back).
        let known = cache.and_then(|cache| cache.take(&path)).filter(|known| {
            let (describes, read) = known.describes(&file, identity, meta.len());
            bytes_read += read;
            describes
        });
        let from = match known {
            Some(known) => Scanned {
                seen: known.seen,
                len: known.len,
                last_line: known.last_line,
                lines: known.lines,
            },
            None => Scanned::default(),
        };
        let scan = scan(&file, &path, from.len, from.lines).map_err(open_err)?;
        bytes_read += scan.total_len - from.len;
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
        let mut seen = from.seen;
        seen.extend(scan.ids);
        let last_line = scan.last_line.or(from.last_line);
        Ok(Transcript {
            path,
            scope: scope_for(session_id),
            file,
            seen,
            mode,
            failed_writes: 0,
            torn: false,
            identity,
            len: scan.complete_len,
            last_line,
            lines: scan.lines,
            cache: cache.cloned(),
            untracked: false,
            bytes_read,
            faults: None,
        })
    }

    /// Fails the writes `plan` says to fail, as a failing disk would (chaos runs).
    pub fn set_disk_faults(&mut self, plan: Option<SharedDiskFaults>) {
        self.faults = plan;
    }

    /// Appends `entry` unless its id ([`entry_id`]) is already in the file. Returns
    /// `Ok(true)` if a line was written and synced, `Ok(false)` if the id was already there
    /// or (best-effort mode) the write failed, and [`TranscriptError::PersistenceFailed`]
    /// if the write failed in strict mode.
    pub fn append(&mut self, entry: &Entry<'_>) -> Result<bool, TranscriptError> {
        let id = entry_id(entry);
        if self.seen.contains(&id_digest(&id)) {
            return Ok(false);
        }
        match self.write_line(&id, entry) {
            Ok(()) => {
                self.seen.insert(id_digest(&id));
                Ok(true)
            }
            Err(source) => {
                self.failed_writes += 1;
                crate::metrics::storage_write_failed(Store::Transcript);
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
        faults::check(self.faults.as_ref(), Store::Transcript)?;
        let before = self.file.metadata()?.len();
        if before != self.len {
            // Written by someone else (or torn): what this knows of the file is stale.
            self.untracked = true;
        }
        let result = self
            .file
            .write_all(&line)
            .and_then(|()| self.file.sync_data());
        match result {
            Ok(()) => {
                self.torn = false;
                self.len = before + line.len() as u64;
                self.lines += 1;
                self.last_line = Some(LineFingerprint::of(&line));
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
                        self.untracked = true;
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
        self.seen.contains(&id_digest(id))
    }

    /// How many writes failed since this `Transcript` was opened (both modes).
    pub fn failed_writes(&self) -> u64 {
        self.failed_writes
    }

    /// How many bytes of the file the open read: all of them for [`open`](Self::open); for a
    /// cached reopen, the last line it remembered (to check it) and the lines after it.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
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

impl Drop for Transcript {
    /// Tells the cache (if opened through one) what is known of the file now.
    fn drop(&mut self) {
        let Some(cache) = self.cache.take() else {
            return;
        };
        if self.untracked || self.torn {
            return;
        }
        cache.put(
            self.path.clone(),
            Known {
                identity: self.identity,
                len: self.len,
                last_line: self.last_line,
                lines: self.lines,
                seen: std::mem::take(&mut self.seen),
                used: 0,
            },
        );
    }
}

/// Where an open starts reading: nothing known (the start of the file) or a cache entry.
#[derive(Default)]
struct Scanned {
    seen: HashSet<IdDigest>,
    len: u64,
    last_line: Option<LineFingerprint>,
    lines: u64,
}

/// How many distinct ids appear on more than one complete line of the transcript at
/// `path` (a correct transcript has none). Invalid lines and a partial last line are
/// ignored.
pub fn count_duplicates(path: &Path) -> Result<usize, TranscriptError> {
    let file = File::open(path).map_err(|source| TranscriptError::Open {
        path: path.to_owned(),
        source,
    })?;
    let scan = scan(&file, path, 0, 0).map_err(|source| TranscriptError::Open {
        path: path.to_owned(),
        source,
    })?;
    let mut counts: HashMap<IdDigest, usize> = HashMap::new();
    for id in scan.ids {
        *counts.entry(id).or_default() += 1;
    }
    Ok(counts.values().filter(|&&n| n > 1).count())
}

/// What reading a transcript found.
struct Scan {
    /// The ids (digests) of the complete, valid lines read, in file order (with repeats).
    ids: Vec<IdDigest>,
    /// The offset just after the last newline (the start offset if none was read).
    complete_len: u64,
    /// The file's length.
    total_len: u64,
    /// The last complete line read, if any.
    last_line: Option<LineFingerprint>,
    /// How many lines end before `complete_len`, counting from the start of the file.
    lines: u64,
}

/// Reads every line of `file` from offset `start` (a line boundary after `lines_before`
/// lines) to its end.
fn scan(file: &File, path: &Path, start: u64, lines_before: u64) -> io::Result<Scan> {
    let mut file = file;
    file.seek(SeekFrom::Start(start))?;
    let mut reader = BufReader::new(file);
    let mut ids = Vec::new();
    let mut line = Vec::new();
    // The last complete line, kept by swapping buffers (hashed once, at the end).
    let mut last = Vec::new();
    let mut read_a_line = false;
    let mut complete_len = start;
    let mut total_len = start;
    let mut line_no = lines_before;
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
        read_a_line = true;
        let text = &line[..line.len() - 1];
        if !text.iter().all(u8::is_ascii_whitespace) {
            match serde_json::from_slice::<IdOnly>(text) {
                Ok(record) => ids.push(id_digest(&record.id)),
                Err(e) => tracing::warn!(
                    path = %path.display(),
                    line = line_no,
                    error = %e,
                    "skipping a transcript line that is not a valid entry"
                ),
            }
        }
        std::mem::swap(&mut line, &mut last);
    }
    Ok(Scan {
        ids,
        complete_len,
        total_len,
        last_line: read_a_line.then(|| LineFingerprint::of(&last)),
        lines: line_no,
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
    fn a_link_or_a_fifo_at_the_transcripts_name_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere.jsonl");
        fs::write(&elsewhere, "not a transcript line").unwrap();
        let path = transcript_path(dir.path(), "s-link").unwrap();
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
        let refused = Transcript::open(dir.path(), "s-link", TranscriptMode::Strict);
        assert!(matches!(refused, Err(TranscriptError::Open { .. })));
        assert_eq!(
            fs::read_to_string(&elsewhere).unwrap(),
            "not a transcript line",
            "the link's target was cut or written to"
        );
        let fifo = transcript_path(dir.path(), "s-fifo").unwrap();
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let refused = Transcript::open(dir.path(), "s-fifo", TranscriptMode::Strict);
        let message = refused.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("not a regular file"), "{message}");
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

    /// Fails every write of one store, with EIO, then lets them through once told to.
    #[derive(Debug, Default)]
    struct FailingDisk(std::sync::atomic::AtomicBool);

    impl crate::faults::DiskFaults for FailingDisk {
        fn before_write(&self, store: Store) -> Option<io::Error> {
            (store == Store::Transcript && !self.0.load(std::sync::atomic::Ordering::SeqCst))
                .then(|| io::Error::from_raw_os_error(nix::libc::EIO))
        }
    }

    #[test]
    fn an_injected_write_failure_leaves_no_line_and_the_retry_writes_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FailingDisk::default());
        let mut t = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
        t.set_disk_faults(Some(disk.clone()));
        let e = Entry::new(Role::User, "q").with_event_id("e1");
        let err = t.append(&e).unwrap_err();
        assert!(
            err.to_string().contains("I/O error") || err.to_string().contains("os error 5"),
            "{err}"
        );
        assert_eq!(t.failed_writes(), 1);
        assert_eq!(fs::metadata(t.path()).unwrap().len(), 0);
        disk.0.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(t.append(&e).unwrap());
        assert!(!t.append(&e).unwrap());
        assert_eq!(ids_in(t.path()), vec!["e1".to_owned()]);
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

    fn file_len(path: &Path) -> u64 {
        fs::metadata(path).unwrap().len()
    }

    /// The length of the file's last line, newline included.
    fn last_line_len(path: &Path) -> u64 {
        let text = fs::read_to_string(path).unwrap();
        let body = text.strip_suffix('\n').unwrap();
        (body.len() - body.rfind('\n').map_or(0, |at| at + 1) + 1) as u64
    }

    fn append_raw(path: &Path, bytes: &[u8]) {
        let mut f = OpenOptions::new().append(true).open(path).unwrap();
        f.write_all(bytes).unwrap();
    }

    #[test]
    fn a_cached_reopen_reads_only_what_was_appended_since_the_last_close() {
        let dir = tempfile::tempdir().unwrap();
        let cache = TranscriptCache::new();
        let open = || Transcript::open_cached(dir.path(), "s", TranscriptMode::Strict, &cache);
        let mut t = open().unwrap();
        for i in 0..50 {
            assert!(t.append(&Entry::new(Role::User, &format!("m{i}"))).unwrap());
        }
        let path = t.path().to_owned();
        drop(t);
        assert_eq!(cache.len(), 1);

        // Nothing new: only the last line is read (to check it), and the old ids are known.
        let last = last_line_len(&path);
        let mut t = open().unwrap();
        assert_eq!(t.bytes_read(), last, "read more than the last line");
        assert_eq!(t.len(), 50);
        assert!(!t.append(&Entry::new(Role::User, "m0")).unwrap());
        assert!(t.append(&Entry::new(Role::User, "m50")).unwrap());
        drop(t);

        // A line someone else appended after the close: read alone.
        let last = last_line_len(&path);
        let extra = b"{\"id\":\"outside\"}\n";
        append_raw(&path, extra);
        let mut t = open().unwrap();
        assert_eq!(
            t.bytes_read(),
            last + extra.len() as u64,
            "read more than the last known line and the new one"
        );
        assert!(t.contains("outside"));
        assert_eq!(t.len(), 52);
        assert!(
            !t.append(&Entry::new(Role::User, "x").with_event_id("outside"))
                .unwrap()
        );
        drop(t);

        // A full read agrees, and reads everything.
        let full = Transcript::open(dir.path(), "s", TranscriptMode::Strict).unwrap();
        assert_eq!(full.bytes_read(), file_len(&path));
        assert_eq!(full.len(), 52);
        assert_eq!(count_duplicates(&path).unwrap(), 0);
    }

    #[test]
    fn a_cached_reopen_reads_the_whole_file_when_it_was_replaced_shrank_or_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let cache = TranscriptCache::new();
        let open = || Transcript::open_cached(dir.path(), "s", TranscriptMode::Strict, &cache);
        let event = |id| Entry::new(Role::User, "q").with_event_id(id);
        let mut t = open().unwrap();
        let path = t.path().to_owned();
        for id in ["a", "b", "c"] {
            assert!(t.append(&event(id)).unwrap());
        }
        drop(t);

        // Replaced by another file (a new inode), even a longer one.
        fs::remove_file(&path).unwrap();
        let replacement = "{\"id\":\"x\",\"pad\":\"................................................................................\"}\n";
        fs::write(&path, replacement).unwrap();
        let mut t = open().unwrap();
        assert_eq!(t.bytes_read(), file_len(&path));
        assert_eq!(t.len(), 1);
        assert!(t.contains("x") && !t.contains("a"));
        assert!(t.append(&event("y")).unwrap());
        drop(t);

        // Shrank: cut back to its first line.
        let first_line_len = replacement.len() as u64;
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(first_line_len)
            .unwrap();
        let mut t = open().unwrap();
        assert_eq!(t.bytes_read(), first_line_len);
        assert!(!t.contains("y"));
        assert!(t.append(&event("y")).unwrap());
        drop(t);

        // Rewritten in place (same file, same length): its last line now holds another id.
        let text = fs::read_to_string(&path).unwrap();
        let at = text.rfind("\"id\":\"y\"").unwrap() as u64;
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(b"\"id\":\"z\"", at)
            .unwrap();
        let last = last_line_len(&path);
        let t = open().unwrap();
        // The remembered last line, then the whole file.
        assert_eq!(t.bytes_read(), last + file_len(&path));
        assert!(t.contains("z") && !t.contains("y"));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn a_cached_reopen_repairs_a_partial_line_written_after_the_last_close() {
        let dir = tempfile::tempdir().unwrap();
        let cache = TranscriptCache::new();
        let open = || Transcript::open_cached(dir.path(), "s", TranscriptMode::Strict, &cache);
        let mut t = open().unwrap();
        assert!(t.append(&Entry::new(Role::User, "one")).unwrap());
        let path = t.path().to_owned();
        drop(t);
        let good_len = file_len(&path);
        append_raw(&path, br#"{"id":"torn","scope":"copilot:s","ro"#);

        let mut t = open().unwrap();
        assert_eq!(file_len(&path), good_len);
        assert_eq!(t.len(), 1);
        assert!(t.append(&Entry::new(Role::Assistant, "two")).unwrap());
        drop(t);
        let ids = ids_in(&path);
        assert_eq!(ids.len(), 2);
        assert!(ids[1].starts_with("assistant:"));
        // What the cache kept is what a full read finds.
        let t = open().unwrap();
        assert_eq!(t.bytes_read(), last_line_len(&path));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn a_transcript_that_lost_track_of_its_file_is_read_whole_on_the_next_open() {
        let dir = tempfile::tempdir().unwrap();
        let cache = TranscriptCache::new();
        let open = |mode| Transcript::open_cached(dir.path(), "s", mode, &cache);

        // A line from someone else while open, then a write of ours.
        let mut t = open(TranscriptMode::Strict).unwrap();
        assert!(t.append(&Entry::new(Role::User, "a")).unwrap());
        let path = t.path().to_owned();
        append_raw(&path, b"{\"id\":\"meanwhile\"}\n");
        assert!(t.append(&Entry::new(Role::User, "b")).unwrap());
        drop(t);
        assert!(cache.is_empty());
        let t = open(TranscriptMode::Strict).unwrap();
        assert_eq!(t.bytes_read(), file_len(&path));
        assert!(t.contains("meanwhile"));
        assert_eq!(t.len(), 3);
        drop(t);

        // A failed write that could not be cut back (best effort goes on).
        let mut t = open(TranscriptMode::BestEffort).unwrap();
        t.fail_writes();
        assert!(!t.append(&Entry::new(Role::User, "lost")).unwrap());
        drop(t);
        assert!(cache.is_empty());
        let t = open(TranscriptMode::BestEffort).unwrap();
        assert_eq!(t.bytes_read(), file_len(&path));
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn the_cache_forgets_the_least_recently_closed_file_beyond_its_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let cache = TranscriptCache::with_capacity(2);
        let open = |id| Transcript::open_cached(dir.path(), id, TranscriptMode::Strict, &cache);
        for id in ["s1", "s2", "s3"] {
            let mut t = open(id).unwrap();
            assert!(t.append(&Entry::new(Role::User, id)).unwrap());
        }
        assert_eq!(cache.len(), 2);
        let s3 = open("s3").unwrap();
        assert_eq!(s3.bytes_read(), last_line_len(s3.path()));
        let s1 = open("s1").unwrap();
        assert_eq!(s1.bytes_read(), file_len(s1.path()));
        assert_eq!(s1.len(), 1);

        let none = TranscriptCache::with_capacity(0);
        drop(Transcript::open_cached(dir.path(), "s1", TranscriptMode::Strict, &none).unwrap());
        assert!(none.is_empty());
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

    /// Appends `POOL[i]`; it must be new exactly when `expected` does not hold its id yet.
    fn append_pool_entry(
        t: &mut Transcript,
        i: usize,
        expected: &mut Vec<String>,
    ) -> Result<(), TestCaseError> {
        let (event_id, role, content) = POOL[i];
        let entry = Entry {
            event_id,
            role,
            content,
            tool_name: None,
            tool_call_id: None,
        };
        let id = entry_id(&entry);
        let is_new = !expected.contains(&id);
        prop_assert_eq!(t.append(&entry).unwrap(), is_new);
        if is_new {
            expected.push(id);
        }
        Ok(())
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
                    Op::Append(i) => append_pool_entry(&mut t, i, &mut expected)?,
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

        #[test]
        fn cached_reopens_find_what_a_full_read_finds(ops in prop::collection::vec(cached_op(), 0..60)) {
            let dir = tempfile::tempdir().unwrap();
            let cache = TranscriptCache::new();
            let open = || Transcript::open_cached(dir.path(), "prop", TranscriptMode::Strict, &cache);
            let mut t = open().unwrap();
            let path = t.path().to_owned();
            let mut expected: Vec<String> = Vec::new();
            for op in ops {
                match op {
                    CachedOp::Append(i) => append_pool_entry(&mut t, i, &mut expected)?,
                    CachedOp::Reopen => {
                        drop(t);
                        t = open().unwrap();
                    }
                    CachedOp::Tear => {
                        drop(t);
                        append_raw(&path, br#"{"id":"torn","sco"#);
                        t = open().unwrap();
                    }
                    CachedOp::Outside(i) => {
                        drop(t);
                        let id = format!("outside-{i}");
                        if !expected.contains(&id) {
                            append_raw(&path, format!("{{\"id\":\"{id}\"}}\n").as_bytes());
                            expected.push(id);
                        }
                        t = open().unwrap();
                    }
                }
                prop_assert_eq!(t.len(), expected.len());
                for id in &expected {
                    prop_assert!(t.contains(id), "{} missing", id);
                }
            }
            drop(t);
            let full = Transcript::open(dir.path(), "prop", TranscriptMode::Strict).unwrap();
            prop_assert_eq!(full.len(), expected.len());
            prop_assert_eq!(ids_in(&path), expected);
            prop_assert_eq!(count_duplicates(&path).unwrap(), 0);
        }
    }

    #[derive(Debug, Clone)]
    enum CachedOp {
        Append(usize),
        Reopen,
        Tear,
        Outside(usize),
    }

    fn cached_op() -> impl Strategy<Value = CachedOp> {
        prop_oneof![
            5 => (0..POOL.len()).prop_map(CachedOp::Append),
            1 => Just(CachedOp::Reopen),
            1 => Just(CachedOp::Tear),
            1 => (0..4usize).prop_map(CachedOp::Outside),
        ]
    }
}
