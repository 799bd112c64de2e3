//! Durable `session_key` → CLI session id records: one JSON file per binding under
//! `<state_dir>/bindings` (the Copilot runtime's conversations) or another directory of the
//! state directory (a namespace of its own: the CLI backends' are in `cli-bindings`), named
//! by the SHA-256 of the session key (caller strings never reach a path), written atomically
//! (temp file, fsync, rename, fsync of the directory). Unreadable or foreign files are
//! treated as absent, never as fatal. Bindings move between stores once
//! (`BindingStore::take_once_from`) when a version of the pool moves a namespace. Each
//! store keeps an index by agent and CLI session id (`by_session`) so finding which
//! conversation holds a session reads one file.

mod agent_tally;
mod by_session;

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::faults::{self, SharedDiskFaults, Store};
use crate::ids::{CliSessionId, sha256_hex as hex_sha256};

use agent_tally::AgentTally;
pub(crate) use agent_tally::Reservation;
use by_session::SessionIndex;

/// The version of the stored JSON this code reads and writes.
pub const SCHEMA_VERSION: u32 = 1;

/// The suffix of binding files.
const EXTENSION: &str = "json";

/// A temp file this old is a write cut short (a write takes milliseconds); a younger one is
/// left alone when a store opens.
const LEFTOVER_TEMP_AGE: Duration = Duration::from_secs(60);

/// The directory of the Copilot runtime's bindings in the state directory.
const COPILOT_BINDINGS: &str = "bindings";

/// The directory of the CLI backends' bindings in the state directory (opened by
/// `pool::cli`, which moves the ones earlier versions kept among the Copilot runtime's).
pub const CLI_BINDINGS_DIR: &str = "cli-bindings";

/// Which CLI session a caller's session key is bound to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// The caller's session key.
    pub session_key: String,
    /// The session id the CLI gave the session.
    pub cli_session_id: CliSessionId,
    /// The pool key the session was created under; resuming under another key is unsafe.
    pub compat_key: String,
    /// When the binding was last written, in milliseconds since the Unix epoch.
    pub updated_at_ms: u64,
    /// The conversation's working directory when the binding was written (where its inline
    /// attachments are, and where a CLI files its transcript), so a deletion that names none
    /// finds them; absent in bindings written before the pool recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_directory: Option<PathBuf>,
}

/// The stored form: the binding with a schema version.
#[derive(Serialize)]
struct StoredRef<'a> {
    schema_version: u32,
    #[serde(flatten)]
    binding: &'a Binding,
}

/// Just the version, read before the rest.
#[derive(Deserialize)]
struct VersionProbe {
    schema_version: Option<u32>,
}

/// Why the binding store failed.
#[derive(Debug, thiserror::Error)]
pub enum BindingError {
    /// The bindings directory could not be created.
    #[error(
        "could not create the bindings directory {path:?}: {source}; make sure the state \
         directory is writable, or pass another state directory"
    )]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A file operation failed.
    #[error(
        "could not {op} the binding file {path:?}: {source}; check the permissions and free \
         space of the state directory"
    )]
    Io {
        /// What was being done ("read", "write", "remove", "list", ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A binding could not be encoded (should not happen).
    #[error("could not encode a binding as JSON: {0}; this is a bug, please report it")]
    Encode(#[source] serde_json::Error),
}

impl BindingError {
    /// The underlying OS error as text (the whole message when there is none).
    pub fn os_error(&self) -> String {
        match self {
            BindingError::CreateDir { source, .. } | BindingError::Io { source, .. } => {
                source.to_string()
            }
            BindingError::Encode(e) => e.to_string(),
        }
    }
}

/// The bindings of one state directory. Cheap to share between threads by reference;
/// every operation goes to the file system.
#[derive(Debug, Clone)]
pub struct BindingStore {
    dir: PathBuf,
    /// The bindings by agent and CLI session id.
    index: SessionIndex,
    /// Held around each read-then-write of an index entry (a write over a stale entry, the
    /// removal of one that names the key that left it), so one cannot undo another's in
    /// this process. Shared by the store's clones.
    index_lock: std::sync::Arc<std::sync::Mutex<()>>,
    /// Writes this plan fails on purpose (chaos runs); `None`: none.
    faults: Option<SharedDiskFaults>,
    /// Each agent's conversations, when the store counts them
    /// ([`BindingStore::with_agent_tally`]). Shared by the store's clones.
    tally: Option<std::sync::Arc<AgentTally>>,
}

impl BindingStore {
    /// Opens the store of the Copilot runtime's conversations, `<state_dir>/bindings`,
    /// creating it (mode 0700) if missing, and removes temp files that a write cut short (a
    /// crash between write and rename) left.
    pub fn open(state_dir: &Path) -> Result<Self, BindingError> {
        Self::open_named(state_dir, COPILOT_BINDINGS)
    }

    /// Opens the store `<state_dir>/<name>`, as [`BindingStore::open`] does: a namespace of
    /// its own, where no key can name a binding of another store.
    pub(crate) fn open_named(state_dir: &Path, name: &str) -> Result<Self, BindingError> {
        let dir = state_dir.join(name);
        create_private_dir(&dir).map_err(|source| BindingError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        let index = SessionIndex::at(&dir);
        create_private_dir(index.dir()).map_err(|source| BindingError::CreateDir {
            path: index.dir().to_path_buf(),
            source,
        })?;
        let store = Self {
            dir,
            index,
            index_lock: Default::default(),
            faults: None,
            tally: None,
        };
        store.remove_leftover_temp_files(&store.dir)?;
        store.remove_leftover_temp_files(store.index.dir())?;
        store.build_index_once()?;
        Ok(store)
    }

    /// The store `<state_dir>/bindings` to read only (`copilot-pool doctor` beside a running
    /// daemon): nothing is made, removed or indexed. Its reads fail where the directory is
    /// missing.
    pub fn open_to_read(state_dir: &Path) -> Self {
        let dir = state_dir.join(COPILOT_BINDINGS);
        Self {
            index: SessionIndex::at(&dir),
            dir,
            index_lock: Default::default(),
            faults: None,
            tally: None,
        }
    }

    /// Gives every binding an index entry, once: bindings written before the index existed
    /// have none (and bindings written since have theirs before their file). Done again at
    /// the next open if cut short (the marker is written last).
    fn build_index_once(&self) -> Result<(), BindingError> {
        if self.index.is_built() {
            return Ok(());
        }
        let bindings = self.list()?;
        for binding in &bindings {
            self.write_entry(binding, false)?;
        }
        // One sync of the whole file system for the entries, rather than one per entry.
        let index_error = |source: nix::Error| BindingError::Io {
            op: "sync the index of",
            path: self.index.dir().to_path_buf(),
            source: source.into(),
        };
        let dir = File::open(self.index.dir()).map_err(|source| BindingError::Io {
            op: "open the index of",
            path: self.index.dir().to_path_buf(),
            source,
        })?;
        nix::unistd::syncfs(&dir).map_err(index_error)?;
        write_marker(&self.index.built_marker())?;
        self.sync_index_dir()?;
        if !bindings.is_empty() {
            tracing::info!(
                bindings = bindings.len(),
                dir = %self.dir.display(),
                "Indexed the bindings by CLI session id (once, for bindings an earlier version wrote)."
            );
        }
        Ok(())
    }

    /// The store counting each agent's conversations from now on (what
    /// [`BindingStore::reserve_new`] checks): every binding is read once, here, to learn its
    /// agent. Disk work: off the async threads.
    pub(crate) fn with_agent_tally(mut self) -> Result<Self, BindingError> {
        let bindings = self.list()?;
        let tally = AgentTally::of(bindings.iter().map(|b| b.session_key.as_str()));
        self.tally = Some(std::sync::Arc::new(tally));
        Ok(self)
    }

    /// A place in its agent's count for the new conversation `session_key` while it is
    /// opened (given back when the [`Reservation`] drops; by then its binding counts), when
    /// the agent keeps fewer than `max` conversations; else the number it keeps. `Ok(None)`:
    /// none is needed (a store that does not count, a key bound already).
    pub(crate) fn reserve_new(
        &self,
        session_key: &str,
        max: usize,
    ) -> Result<Option<Reservation>, usize> {
        match &self.tally {
            Some(tally) => tally.reserve(session_key, max),
            None => Ok(None),
        }
    }

    /// Counts `session_key` as bound (its binding found on disk by a lease that held a place
    /// for it: a binding the count missed). Nothing is read or written.
    pub(crate) fn note_bound(&self, session_key: &str) {
        if let Some(tally) = &self.tally {
            tally.bound(session_key);
        }
    }

    /// Fails the writes `plan` says to fail, as a failing disk would (chaos runs).
    pub fn with_disk_faults(mut self, plan: Option<SharedDiskFaults>) -> Self {
        self.faults = plan;
        self
    }

    /// Removes `.<hash>.<uuid>.tmp` files from `dir` (the store's or its index's) older than
    /// [`LEFTOVER_TEMP_AGE`]: a younger one may be a write in progress of another writer (a
    /// second pool on this state directory, or the daemon while `doctor` opens it).
    fn remove_leftover_temp_files(&self, dir: &Path) -> Result<(), BindingError> {
        let list_error = |source| BindingError::Io {
            op: "list",
            path: dir.to_path_buf(),
            source,
        };
        for entry in fs::read_dir(dir).map_err(list_error)? {
            let path = entry.map_err(list_error)?.path();
            let is_temp = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp"));
            let is_old = || {
                fs::symlink_metadata(&path)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|modified| modified.elapsed().ok())
                    .is_some_and(|age| age >= LEFTOVER_TEMP_AGE)
            };
            if is_temp && is_old() {
                match fs::remove_file(&path) {
                    Ok(()) => {
                        tracing::info!(path = %path.display(), "Removed a binding temp file left by an interrupted write.")
                    }
                    Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                    Err(source) => {
                        return Err(BindingError::Io {
                            op: "remove the leftover temp file",
                            path,
                            source,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The directory holding the binding files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The binding of `session_key`, or `None` if there is none (or its file is unreadable
    /// as a binding of this key).
    pub fn get(&self, session_key: &str) -> Result<Option<Binding>, BindingError> {
        let path = self.path_for(session_key);
        let Some(binding) = read_binding(&path)? else {
            return Ok(None);
        };
        if binding.session_key != session_key {
            tracing::warn!(
                path = %path.display(),
                "binding file holds another session key; treating it as absent"
            );
            return Ok(None);
        }
        Ok(Some(binding))
    }

    /// Whether the conversation's binding still names `read`'s CLI session (`None`: it has
    /// no binding now): a deletion pinned by `read` checks this once it holds the
    /// conversation.
    pub(crate) fn names_the_same_session(
        &self,
        read: &Binding,
    ) -> Result<Option<bool>, BindingError> {
        Ok(self
            .get(&read.session_key)?
            .map(|now| now.cli_session_id == read.cli_session_id))
    }

    /// Whether a binding file for `session_key` exists (one `stat`, nothing parsed).
    pub fn is_present(&self, session_key: &str) -> Result<bool, BindingError> {
        let path = self.path_for(session_key);
        match fs::metadata(&path) {
            Ok(_) => Ok(true),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(source) => Err(BindingError::Io {
                op: "check",
                path,
                source,
            }),
        }
    }

    /// Stores `binding`, replacing any binding of its session key, atomically and durably.
    /// Its index entry is written first, so a binding on disk always has one.
    pub fn put(&self, binding: &Binding) -> Result<(), BindingError> {
        // Best effort: an unreadable previous binding leaves its entry, a stale hint.
        let previous = self.get(&binding.session_key).ok().flatten();
        self.write_entry(binding, true)?;
        let written = self.write_binding(binding);
        // Counted once its file is in place, even where only the directory's sync failed
        // (a later lease resumes by it and writes nothing again).
        if let Some(tally) = &self.tally
            && (written.is_ok() || self.path_for(&binding.session_key).exists())
        {
            tally.bound(&binding.session_key);
        }
        written?;
        if let Some(previous) = previous.filter(|p| p.cli_session_id != binding.cli_session_id) {
            self.forget_entry(&previous);
        }
        Ok(())
    }

    fn write_binding(&self, binding: &Binding) -> Result<(), BindingError> {
        let stored = StoredRef {
            schema_version: SCHEMA_VERSION,
            binding,
        };
        let mut json = serde_json::to_vec_pretty(&stored).map_err(BindingError::Encode)?;
        json.push(b'\n');
        let target = self.path_for(&binding.session_key);
        let temp = self.dir.join(format!(
            ".{}.{}.tmp",
            hex_sha256(&binding.session_key),
            uuid::Uuid::new_v4().simple()
        ));
        let write_error = |source| BindingError::Io {
            op: "write",
            path: temp.clone(),
            source,
        };
        let written = faults::check(self.faults.as_ref(), Store::Bindings)
            .and_then(|()| write_synced(&temp, &json))
            .map_err(write_error)
            .and_then(|()| {
                fs::rename(&temp, &target).map_err(|source| BindingError::Io {
                    op: "rename into place",
                    path: target.clone(),
                    source,
                })
            });
        if let Err(err) = written {
            let _ = fs::remove_file(&temp);
            crate::metrics::storage_write_failed(Store::Bindings);
            return Err(err);
        }
        self.sync_dir()
    }

    /// Removes the binding of `session_key`; removing an absent binding is not an error.
    pub fn remove(&self, session_key: &str) -> Result<(), BindingError> {
        let previous = self.get(session_key).ok().flatten();
        let path = self.path_for(session_key);
        match fs::remove_file(&path) {
            Ok(()) => {
                if let Some(tally) = &self.tally {
                    tally.unbound(session_key);
                }
                self.sync_dir()?;
                if let Some(previous) = previous {
                    self.forget_entry(&previous);
                }
                Ok(())
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                // Gone already (removed behind the store's back): not counted either.
                if let Some(tally) = &self.tally {
                    tally.unbound(session_key);
                }
                Ok(())
            }
            Err(source) => Err(BindingError::Io {
                op: "remove",
                path,
                source,
            }),
        }
    }

    /// Every readable binding, sorted by session key. Unreadable files are skipped.
    pub fn list(&self) -> Result<Vec<Binding>, BindingError> {
        let list_error = |source| BindingError::Io {
            op: "list",
            path: self.dir.clone(),
            source,
        };
        let mut bindings = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(list_error)? {
            let entry = entry.map_err(list_error)?;
            let path = entry.path();
            let Some(stem) = binding_file_stem(&path) else {
                continue;
            };
            let Some(binding) = read_binding(&path)? else {
                continue;
            };
            if hex_sha256(&binding.session_key) != stem {
                tracing::warn!(
                    path = %path.display(),
                    "binding file name does not match its session key; skipping it"
                );
                continue;
            }
            bindings.push(binding);
        }
        bindings.sort_by(|a, b| a.session_key.cmp(&b.session_key));
        Ok(bindings)
    }

    /// The binding of another conversation of `session_key`'s agent bound to the CLI
    /// session `id`, if there is one: one index entry and the binding it names are read.
    pub(crate) fn bound_elsewhere(
        &self,
        session_key: &str,
        id: &CliSessionId,
    ) -> Result<Option<Binding>, BindingError> {
        let Some(entry) = self.index.entry(session_key, id) else {
            return Ok(None);
        };
        let named = SessionIndex::read(&entry).map_err(|source| BindingError::Io {
            op: "read the index entry",
            path: entry.clone(),
            source,
        })?;
        let Some(named) = named.filter(|named| named != session_key) else {
            return Ok(None);
        };
        Ok(self
            .get(&named)?
            .filter(|binding| binding.cli_session_id == *id))
    }

    /// Writes `binding`'s index entry unless it already names its key, or names another
    /// conversation still bound to that session (the first holder stays named). `synced`:
    /// durable before this returns (every put; a build syncs once at its end).
    fn write_entry(&self, binding: &Binding, synced: bool) -> Result<(), BindingError> {
        let Some(entry) = self
            .index
            .entry(&binding.session_key, &binding.cli_session_id)
        else {
            return Ok(());
        };
        let entry_error = |op, source| BindingError::Io {
            op,
            path: entry.clone(),
            source,
        };
        // Whether the entry may stay as it is: it names this key, or another conversation
        // still bound to the session (the first holder stays named).
        let stays = |store: &Self| -> Result<bool, BindingError> {
            Ok(
                match SessionIndex::read(&entry)
                    .map_err(|e| entry_error("read the index entry", e))?
                {
                    Some(named) if named == binding.session_key => true,
                    Some(named) => store
                        .get(&named)?
                        .is_some_and(|other| other.cli_session_id == binding.cli_session_id),
                    None => false,
                },
            )
        };
        if stays(self)? {
            return Ok(());
        }
        // Written (and synced) before the lock: only the check and the rename are held.
        let temp = self.index.dir().join(format!(
            ".{}.{}.tmp",
            hex_sha256(&binding.session_key),
            uuid::Uuid::new_v4().simple()
        ));
        let written = faults::check(self.faults.as_ref(), Store::Bindings)
            .and_then(|()| {
                if synced {
                    write_synced(&temp, binding.session_key.as_bytes())
                } else {
                    write_private(&temp, binding.session_key.as_bytes()).map(drop)
                }
            })
            .map_err(|e| entry_error("write the index entry", e));
        let placed = written.and_then(|()| {
            let _held = self
                .index_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if stays(self)? {
                return Ok(false);
            }
            fs::rename(&temp, &entry)
                .map(|()| true)
                .map_err(|e| entry_error("rename into place", e))
        });
        match placed {
            Ok(true) => {}
            Ok(false) => {
                let _ = fs::remove_file(&temp);
                return Ok(());
            }
            Err(err) => {
                let _ = fs::remove_file(&temp);
                crate::metrics::storage_write_failed(Store::Bindings);
                return Err(err);
            }
        }
        if synced {
            self.sync_index_dir()?;
        }
        Ok(())
    }

    /// Removes `previous`'s index entry if it names its key (best effort).
    fn forget_entry(&self, previous: &Binding) {
        if let Some(entry) = self
            .index
            .entry(&previous.session_key, &previous.cli_session_id)
        {
            let _held = self
                .index_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            SessionIndex::remove_if_names(&entry, &previous.session_key);
        }
    }

    fn sync_index_dir(&self) -> Result<(), BindingError> {
        self.index.sync_dir().map_err(|source| BindingError::Io {
            op: "sync the index directory of",
            path: self.index.dir().to_path_buf(),
            source,
        })
    }

    fn path_for(&self, session_key: &str) -> PathBuf {
        self.dir
            .join(format!("{}.{EXTENSION}", hex_sha256(session_key)))
    }

    fn sync_dir(&self) -> Result<(), BindingError> {
        File::open(&self.dir)
            .and_then(|dir| dir.sync_all())
            .map_err(|source| BindingError::Io {
                op: "sync the directory of",
                path: self.dir.clone(),
                source,
            })
    }

    /// Moves the bindings of `from` that `belongs_here` picks into this store, once: the
    /// move is done when this store holds the file `marker` (written last, so a move cut
    /// short is done again at the next open), and a binding that `from` gets later stays
    /// there. Each file is linked here whole (same key, same name), then removed there, so a
    /// binding is never in neither store, and one this store already holds is kept (a move
    /// cut short between the two steps left the same file in both). A file that cannot be
    /// read is left where it is, with a warning: it is no binding to anyone. Several pools
    /// opening one state directory at once each move what is still there. Returns how many
    /// this call moved.
    pub(crate) fn take_once_from(
        &self,
        from: &BindingStore,
        marker: &str,
        belongs_here: impl Fn(&Binding) -> bool,
    ) -> Result<usize, BindingError> {
        let marker = self.dir.join(marker);
        if marker.exists() {
            return Ok(0);
        }
        let list_error = |source| BindingError::Io {
            op: "list",
            path: from.dir.clone(),
            source,
        };
        let mut moved = 0;
        for entry in fs::read_dir(&from.dir).map_err(list_error)? {
            let source = entry.map_err(list_error)?.path();
            if binding_file_stem(&source).is_none() {
                continue;
            }
            let binding = match read_binding(&source) {
                Ok(Some(binding)) => binding,
                Ok(None) => continue,
                Err(error) => {
                    tracing::warn!(%error, "Left a binding file that could not be read where it is.");
                    continue;
                }
            };
            if !belongs_here(&binding) || source != from.path_for(&binding.session_key) {
                continue;
            }
            let target = self.path_for(&binding.session_key);
            self.write_entry(&binding, true)?;
            match fs::hard_link(&source, &target) {
                Ok(()) => moved += 1,
                // Held here already (the same file, from a move cut short).
                Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
                // Another pool on this state directory moved it first.
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(BindingError::Io {
                        op: "move",
                        path: target,
                        source,
                    });
                }
            }
            match fs::remove_file(&source) {
                Ok(()) => {}
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(BindingError::Io {
                        op: "remove the moved",
                        path: source,
                        source: error,
                    });
                }
            }
        }
        self.sync_dir()?;
        from.sync_dir()?;
        write_marker(&marker)?;
        self.sync_dir()?;
        Ok(moved)
    }
}

/// The hash part of a binding file's name (`<64 hex>.json`), or `None` for other files
/// (temp files, strays).
fn binding_file_stem(path: &Path) -> Option<&str> {
    if path.extension()? != EXTENSION {
        return None;
    }
    let stem = path.file_stem()?.to_str()?;
    (stem.len() == 64 && stem.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then_some(stem)
}

/// Reads a binding file: `None` if it is missing, unparsable or of another schema version.
fn read_binding(path: &Path) -> Result<Option<Binding>, BindingError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(BindingError::Io {
                op: "read",
                path: path.to_path_buf(),
                source,
            });
        }
    };
    // Errors are logged by category and position only: serde_json's messages can quote
    // the file's contents.
    let warn_unparsable = |err: &serde_json::Error| {
        tracing::warn!(
            path = %path.display(),
            category = ?err.classify(),
            line = err.line(),
            column = err.column(),
            "binding file is not valid; treating it as absent"
        );
    };
    let version = match serde_json::from_slice::<VersionProbe>(&bytes) {
        Ok(probe) => probe.schema_version,
        Err(err) => {
            warn_unparsable(&err);
            return Ok(None);
        }
    };
    if version != Some(SCHEMA_VERSION) {
        tracing::warn!(
            path = %path.display(),
            found = ?version,
            expected = SCHEMA_VERSION,
            "binding file has another schema version; treating it as absent"
        );
        return Ok(None);
    }
    match serde_json::from_slice::<Binding>(&bytes) {
        Ok(binding) => Ok(Some(binding)),
        Err(err) => {
            warn_unparsable(&err);
            Ok(None)
        }
    }
}

/// Writes the empty marker file `path` (a step done once), synced; one already there is
/// kept. Its directory is the caller's to sync.
fn write_marker(path: &Path) -> Result<(), BindingError> {
    write_synced(path, b"")
        .or_else(|err| match err.kind() {
            io::ErrorKind::AlreadyExists => Ok(()),
            _ => Err(err),
        })
        .map_err(|source| BindingError::Io {
            op: "write",
            path: path.to_path_buf(),
            source,
        })
}

/// Writes `bytes` to a new file at `path` (mode 0600) and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_private(path, bytes)?.sync_all()
}

/// Writes `bytes` to a new file at `path` (mode 0600), not synced.
fn write_private(path: &Path, bytes: &[u8]) -> io::Result<File> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)?;
    Ok(file)
}

/// Creates `dir` and its parents with mode 0700; a directory we created is set to 0700
/// whatever the umask, an existing one is left alone.
fn create_private_dir(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)?;
    }
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => fs::set_permissions(dir, fs::Permissions::from_mode(0o700)),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn binding(key: &str, session: &str) -> Binding {
        Binding {
            session_key: key.to_owned(),
            cli_session_id: session.into(),
            compat_key: "compat-1".to_owned(),
            updated_at_ms: 1_700_000_000_000,
            working_directory: None,
        }
    }

    #[test]
    fn a_deletion_pinned_by_a_binding_learns_whether_it_still_names_that_session() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        let read = binding("a/k", "s-1");
        store.put(&read).unwrap();
        assert_eq!(store.names_the_same_session(&read).unwrap(), Some(true));
        // Rewritten with its working directory: the same session.
        let mut recorded = binding("a/k", "s-1");
        recorded.working_directory = Some("/w".into());
        store.put(&recorded).unwrap();
        assert_eq!(store.names_the_same_session(&read).unwrap(), Some(true));
        // A turn in between started another session.
        store.put(&binding("a/k", "s-2")).unwrap();
        assert_eq!(store.names_the_same_session(&read).unwrap(), Some(false));
        store.remove("a/k").unwrap();
        assert_eq!(store.names_the_same_session(&read).unwrap(), None);
    }

    #[test]
    fn another_conversation_of_the_agent_bound_to_a_session_is_found_by_its_index_entry() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        let id = CliSessionId::from("s-1");
        store.put(&binding("a/k1", "s-1")).unwrap();
        let owner = store.bound_elsewhere("a/k2", &id).unwrap();
        assert_eq!(owner.map(|b| b.session_key).as_deref(), Some("a/k1"));
        // Not itself, not another agent's.
        assert_eq!(store.bound_elsewhere("a/k1", &id).unwrap(), None);
        assert_eq!(store.bound_elsewhere("b/k2", &id).unwrap(), None);

        // Bound to another session: the old entry goes, the new one names it.
        store.put(&binding("a/k1", "s-2")).unwrap();
        assert_eq!(store.bound_elsewhere("a/k2", &id).unwrap(), None);
        let moved = store
            .bound_elsewhere("a/k2", &CliSessionId::from("s-2"))
            .unwrap();
        assert_eq!(moved.map(|b| b.session_key).as_deref(), Some("a/k1"));

        // Removed: no entry is left behind.
        store.remove("a/k1").unwrap();
        assert_eq!(
            store
                .bound_elsewhere("a/k2", &CliSessionId::from("s-2"))
                .unwrap(),
            None
        );
        assert_eq!(
            file_names(&tmp.path().join("bindings").join(by_session::DIR)),
            vec![by_session::BUILT.to_owned()]
        );
    }

    #[test]
    fn bindings_an_earlier_version_wrote_are_indexed_when_the_store_first_opens() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        store.put(&binding("a/k1", "s-1")).unwrap();
        store.put(&binding("b/k1", "s-2")).unwrap();
        // An earlier version's state directory: bindings, no index.
        fs::remove_dir_all(tmp.path().join("bindings").join(by_session::DIR)).unwrap();

        // Read only (doctor beside a running daemon): nothing is built.
        let read = BindingStore::open_to_read(tmp.path());
        assert_eq!(read.list().unwrap().len(), 2);
        assert!(!tmp.path().join("bindings").join(by_session::DIR).exists());

        let reopened = BindingStore::open(tmp.path()).unwrap();
        let entry = reopened
            .index
            .entry("a/k1", &CliSessionId::from("s-1"))
            .unwrap();
        assert_eq!(
            fs::metadata(&entry).unwrap().permissions().mode() & 0o777,
            0o600,
            "private, as the bindings are"
        );
        let owner = reopened
            .bound_elsewhere("a/k2", &CliSessionId::from("s-1"))
            .unwrap();
        assert_eq!(owner.map(|b| b.session_key).as_deref(), Some("a/k1"));
        let owner = reopened
            .bound_elsewhere("b/k2", &CliSessionId::from("s-2"))
            .unwrap();
        assert_eq!(owner.map(|b| b.session_key).as_deref(), Some("b/k1"));
    }

    #[test]
    fn an_index_entry_that_is_stale_torn_or_names_a_missing_binding_names_no_owner() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        let id = CliSessionId::from("s-1");
        let entry = store.index.entry("a/k2", &id).unwrap();
        // Names a conversation bound to another session.
        store.put(&binding("a/k1", "s-9")).unwrap();
        fs::write(&entry, "a/k1").unwrap();
        assert_eq!(store.bound_elsewhere("a/k2", &id).unwrap(), None);
        // Names a conversation with no binding.
        fs::write(&entry, "a/gone").unwrap();
        assert_eq!(store.bound_elsewhere("a/k2", &id).unwrap(), None);
        // Empty (a write torn by a crash before its binding was written).
        fs::write(&entry, "").unwrap();
        assert_eq!(store.bound_elsewhere("a/k2", &id).unwrap(), None);
        // A put over a stale entry takes it.
        store.put(&binding("a/k3", "s-1")).unwrap();
        let owner = store.bound_elsewhere("a/k2", &id).unwrap();
        assert_eq!(owner.map(|b| b.session_key).as_deref(), Some("a/k3"));
    }

    #[test]
    fn the_first_conversation_bound_to_a_session_stays_named_while_it_holds_it() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        let id = CliSessionId::from("s-1");
        store.put(&binding("a/k1", "s-1")).unwrap();
        store.put(&binding("a/k2", "s-1")).unwrap();
        let owner = store.bound_elsewhere("a/k3", &id).unwrap();
        assert_eq!(owner.map(|b| b.session_key).as_deref(), Some("a/k1"));
        let owner = store.bound_elsewhere("a/k1", &id).unwrap();
        assert_eq!(owner, None, "the entry names the asker itself");
    }

    #[test]
    fn temp_files_left_by_an_interrupted_write_are_removed_when_the_store_opens_not_one_being_written()
     {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        store.put(&binding("kept", "s-1")).unwrap();
        let temp = |dir: &Path, id: &str| dir.join(format!(".{}.{id}.tmp", hex_sha256("kept")));
        let old = SystemTime::now() - LEFTOVER_TEMP_AGE - Duration::from_secs(1);
        let leftover = temp(store.dir(), "0123456789abcdef");
        let index_leftover = temp(store.index.dir(), "0123456789abcdef");
        for path in [&leftover, &index_leftover] {
            fs::File::create(path)
                .and_then(|f| f.set_modified(old))
                .unwrap();
        }
        // Another writer's (a pool beside this one, or the daemon while `doctor` opens its
        // state directory), between its write and its rename.
        let in_flight = temp(store.dir(), "fedcba9876543210");
        fs::write(&in_flight, b"{\"half\":").unwrap();
        let stray = store.dir().join("notes.txt");
        fs::write(&stray, b"not ours").unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        assert!(!leftover.exists(), "the temp file is gone");
        assert!(!index_leftover.exists(), "the index's temp file is gone");
        assert!(in_flight.exists(), "a write in progress keeps its file");
        assert!(stray.exists(), "other files are left alone");
        assert_eq!(store.get("kept").unwrap(), Some(binding("kept", "s-1")));
    }

    /// The names of the files in `dir` (not its directories: the index's).
    fn file_names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_type().unwrap().is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn hex_sha256_known_vector() {
        assert_eq!(
            hex_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[derive(Debug)]
    struct FullDisk;

    impl crate::faults::DiskFaults for FullDisk {
        fn before_write(&self, store: Store) -> Option<io::Error> {
            (store == Store::Bindings).then(|| io::Error::from_raw_os_error(nix::libc::ENOSPC))
        }
    }

    #[test]
    fn an_injected_full_disk_fails_the_put_and_keeps_the_previous_binding() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        store.put(&binding("a/k", "s-1")).unwrap();
        let failing = store
            .clone()
            .with_disk_faults(Some(std::sync::Arc::new(FullDisk)));
        let error = failing.put(&binding("a/k", "s-2")).unwrap_err();
        assert!(error.to_string().contains("No space left"), "{error}");
        assert_eq!(
            store.get("a/k").unwrap().unwrap().cli_session_id.as_str(),
            "s-1"
        );
        assert_eq!(file_names(store.dir()).len(), 1, "no temp file left behind");
        assert_eq!(
            file_names(store.index.dir()).len(),
            2,
            "the marker and s-1's entry, no temp file"
        );
    }

    #[test]
    fn round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        assert_eq!(
            fs::metadata(store.dir()).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert_eq!(store.get("k1").unwrap(), None);
        assert!(store.list().unwrap().is_empty());

        let b1 = binding("k1", "s1");
        let b2 = binding("agent:main/../../etc/passwd", "s2");
        store.put(&b1).unwrap();
        store.put(&b2).unwrap();
        assert_eq!(store.get("k1").unwrap(), Some(b1.clone()));
        assert_eq!(store.get(&b2.session_key).unwrap(), Some(b2.clone()));

        let b1_new = Binding {
            cli_session_id: "s1-new".into(),
            updated_at_ms: 1_700_000_000_001,
            ..b1.clone()
        };
        store.put(&b1_new).unwrap();
        assert_eq!(store.get("k1").unwrap(), Some(b1_new.clone()));
        let mut expected = vec![b1_new.clone(), b2.clone()];
        expected.sort_by(|a, b| a.session_key.cmp(&b.session_key));
        assert_eq!(store.list().unwrap(), expected);

        store.remove("k1").unwrap();
        assert_eq!(store.get("k1").unwrap(), None);
        store.remove("k1").unwrap(); // absent: fine
        assert_eq!(store.list().unwrap(), vec![b2]);
    }

    #[test]
    fn file_names_never_contain_session_keys_and_json_has_a_version() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        store.put(&binding("../secret key", "s")).unwrap();
        let names = file_names(store.dir());
        assert_eq!(names, vec![format!("{}.json", hex_sha256("../secret key"))]);
        let text = fs::read_to_string(store.dir().join(&names[0])).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["schema_version"], 1);
        assert_eq!(value["cli_session_id"], "s");
    }

    #[test]
    fn a_binding_keeps_its_working_directory_and_one_written_before_it_was_recorded_reads_without()
    {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        let with = Binding {
            working_directory: Some(PathBuf::from("/work/agent-a/project")),
            ..binding("with", "s-1")
        };
        store.put(&with).unwrap();
        assert_eq!(store.get("with").unwrap(), Some(with));
        // As an earlier version wrote it: no such field.
        let earlier = serde_json::json!({
            "schema_version": 1, "session_key": "earlier", "cli_session_id": "s-2",
            "compat_key": "compat-1", "updated_at_ms": 1,
        });
        let path = store.dir().join(format!("{}.json", hex_sha256("earlier")));
        fs::write(&path, earlier.to_string()).unwrap();
        let read = store.get("earlier").unwrap().expect("the earlier binding");
        assert_eq!(read.working_directory, None);
        assert_eq!(read.cli_session_id.as_str(), "s-2");
        // And none is written when there is none.
        store.put(&binding("without", "s-3")).unwrap();
        let text = fs::read_to_string(store.dir().join(format!("{}.json", hex_sha256("without"))))
            .unwrap();
        assert!(!text.contains("working_directory"), "{text}");
    }

    #[test]
    fn bindings_another_store_held_move_once_and_what_it_gets_later_stays_there() {
        let tmp = tempfile::tempdir().unwrap();
        let old = BindingStore::open(tmp.path()).unwrap();
        old.put(&binding("a/k#backend=x", "s-1")).unwrap();
        old.put(&binding("a/k", "s-2")).unwrap();
        let new = BindingStore::open_named(tmp.path(), "moved").unwrap();
        let picks = |b: &Binding| b.session_key.contains("#backend=");
        assert_eq!(new.take_once_from(&old, ".marker", picks).unwrap(), 1);
        assert_eq!(new.list().unwrap(), vec![binding("a/k#backend=x", "s-1")]);
        assert_eq!(old.list().unwrap(), vec![binding("a/k", "s-2")]);
        // Done once: a binding the old store gets later is its own.
        old.put(&binding("b/k#backend=x", "s-3")).unwrap();
        let again = BindingStore::open_named(tmp.path(), "moved").unwrap();
        assert_eq!(again.take_once_from(&old, ".marker", picks).unwrap(), 0);
        assert!(old.get("b/k#backend=x").unwrap().is_some());
        assert_eq!(again.list().unwrap().len(), 1, "the marker is no binding");
    }

    #[test]
    fn a_move_cut_short_before_its_marker_is_done_again_at_the_next_open() {
        let tmp = tempfile::tempdir().unwrap();
        let old = BindingStore::open(tmp.path()).unwrap();
        let new = BindingStore::open_named(tmp.path(), "moved").unwrap();
        // One binding already moved (the crash came before its removal there: this store's
        // copy is kept), one still to move, and a file no one can read, left alone.
        new.put(&binding("a/k#backend=x", "s-1")).unwrap();
        old.put(&binding("a/k#backend=x", "s-1-earlier")).unwrap();
        old.put(&binding("a/j#backend=x", "s-2")).unwrap();
        let unreadable = old.path_for("a/i#backend=x");
        fs::create_dir(&unreadable).unwrap();
        let picks = |b: &Binding| b.session_key.contains("#backend=");
        assert_eq!(new.take_once_from(&old, ".marker", picks).unwrap(), 1);
        assert_eq!(
            new.list().unwrap(),
            vec![
                binding("a/j#backend=x", "s-2"),
                binding("a/k#backend=x", "s-1")
            ]
        );
        assert_eq!(old.get("a/k#backend=x").unwrap(), None);
        assert_eq!(old.get("a/j#backend=x").unwrap(), None);
        assert!(unreadable.is_dir());
    }

    #[test]
    fn survives_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let b = binding("k", "s");
        BindingStore::open(tmp.path()).unwrap().put(&b).unwrap();
        let reopened = BindingStore::open(tmp.path()).unwrap();
        assert_eq!(reopened.get("k").unwrap(), Some(b.clone()));
        assert_eq!(reopened.list().unwrap(), vec![b]);
    }

    #[test]
    fn corrupt_foreign_and_other_version_files_are_absent() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        store.put(&binding("good", "s")).unwrap();

        fs::write(store.path_for("corrupt"), b"{ not json").unwrap();
        assert_eq!(store.get("corrupt").unwrap(), None);

        // A valid file of another key stored under this key's name.
        let other = serde_json::to_vec(&StoredRef {
            schema_version: 1,
            binding: &binding("other", "s"),
        })
        .unwrap();
        fs::write(store.path_for("mine"), &other).unwrap();
        assert_eq!(store.get("mine").unwrap(), None);

        let v2 = serde_json::to_vec(&StoredRef {
            schema_version: 2,
            binding: &binding("future", "s"),
        })
        .unwrap();
        fs::write(store.path_for("future"), &v2).unwrap();
        assert_eq!(store.get("future").unwrap(), None);

        let unversioned = serde_json::to_vec(&binding("old", "s")).unwrap();
        fs::write(store.path_for("old"), &unversioned).unwrap();
        assert_eq!(store.get("old").unwrap(), None);

        fs::write(store.dir().join("stray.txt"), b"x").unwrap();
        let keys: Vec<String> = store
            .list()
            .unwrap()
            .into_iter()
            .map(|b| b.session_key)
            .collect();
        assert_eq!(keys, vec!["good".to_owned()]);

        // Overwriting a corrupt file works.
        store.put(&binding("corrupt", "s2")).unwrap();
        assert_eq!(
            store.get("corrupt").unwrap(),
            Some(binding("corrupt", "s2"))
        );
    }

    #[test]
    fn no_temp_files_left_after_put() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        for i in 0..5 {
            store.put(&binding("a/k", &format!("s{i}"))).unwrap();
        }
        let names = file_names(store.dir());
        assert_eq!(names, vec![format!("{}.json", hex_sha256("a/k"))]);
        // The index: the marker and the last session's entry (the others were forgotten).
        let entry = store.index.entry("a/k", &CliSessionId::from("s4")).unwrap();
        let mut expected = vec![
            by_session::BUILT.to_owned(),
            entry.file_name().unwrap().to_string_lossy().into_owned(),
        ];
        expected.sort();
        assert_eq!(file_names(store.index.dir()), expected);
    }

    #[test]
    fn concurrent_puts_of_different_keys_all_land() {
        let tmp = tempfile::tempdir().unwrap();
        let store = BindingStore::open(tmp.path()).unwrap();
        std::thread::scope(|scope| {
            for t in 0..8 {
                let store = &store;
                scope.spawn(move || {
                    for i in 0..10 {
                        store
                            .put(&binding(&format!("t{t}-k{i}"), &format!("s{t}-{i}")))
                            .unwrap();
                    }
                });
            }
        });
        let all = store.list().unwrap();
        assert_eq!(all.len(), 80);
        for t in 0..8 {
            for i in 0..10 {
                assert_eq!(
                    store.get(&format!("t{t}-k{i}")).unwrap(),
                    Some(binding(&format!("t{t}-k{i}"), &format!("s{t}-{i}")))
                );
            }
        }
        assert!(file_names(store.dir()).iter().all(|n| n.ends_with(".json")));
    }

    #[test]
    fn open_fails_with_a_file_in_the_way() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("bindings"), b"x").unwrap();
        let err = BindingStore::open(tmp.path()).unwrap_err();
        assert!(matches!(err, BindingError::CreateDir { .. }), "{err}");
        assert!(err.to_string().contains("writable"), "{err}");
    }
}
