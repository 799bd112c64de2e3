//! The bindings of a store indexed by agent and CLI session id, on disk, so "which other
//! conversation of this agent holds this CLI session?" reads one file instead of every
//! binding: `<store>/by-session/<sha256(agent "\0" cli_session_id)>` holds the session key
//! of a conversation bound to that session.
//!
//! The index is a hint the store checks, never a source of truth: an entry is written
//! (durably) *before* the binding it indexes, so a binding on disk has its entry whatever
//! the moment a crash came; an entry whose conversation was since bound to another session,
//! or removed, is stale, and the store reads the binding it names to tell
//! ([`super::BindingStore::bound_elsewhere`]). Each read-then-write of an entry is done
//! under the store's lock, so one writer cannot undo another's in a process (two pools
//! writing one state directory at once are not ordered). One entry per agent and session:
//! when two conversations are bound to one session (which the pool refuses, so only a race
//! can do it), the entry names the first while it holds it, and the second has none once
//! the first leaves. Bindings written before the index existed are indexed once, when a
//! store first opens (marker [`BUILT`]); a state directory an older version wrote to after
//! that (a rollback) should have its `by-session` folder removed, to be built again.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use crate::ids::{CliSessionId, ConversationId, sha256_hex};

/// The index's directory in a store's directory.
pub(super) const DIR: &str = "by-session";

/// Written in the index's directory once every binding written before the index has its
/// entry (the number is the index's layout version).
pub(super) const BUILT: &str = ".built-1";

/// A store's index (its directory).
#[derive(Debug, Clone)]
pub(super) struct SessionIndex {
    dir: PathBuf,
}

impl SessionIndex {
    /// The index of the store in `store_dir`; its directory is made by [`super::create_private_dir`].
    pub(super) fn at(store_dir: &Path) -> Self {
        Self {
            dir: store_dir.join(DIR),
        }
    }

    /// The index's directory.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the bindings written before the index have their entries.
    pub(super) fn is_built(&self) -> bool {
        self.dir.join(BUILT).exists()
    }

    /// The marker of a built index.
    pub(super) fn built_marker(&self) -> PathBuf {
        self.dir.join(BUILT)
    }

    /// The entry of `session_key`'s agent and `id`; `None` for a key with no agent (no
    /// other conversation can share its agent).
    pub(super) fn entry(&self, session_key: &str, id: &CliSessionId) -> Option<PathBuf> {
        let (agent, _) = ConversationId::split_key(session_key)?;
        let name = sha256_hex(&format!("{agent}\0{}", id.as_str()));
        Some(self.dir.join(name))
    }

    /// The session key the entry at `path` names, `None` when there is none (or it is not
    /// text: a torn write reads as absent, and its binding was never written after it).
    pub(super) fn read(path: &Path) -> io::Result<Option<String>> {
        match fs::read(path) {
            Ok(bytes) => Ok(String::from_utf8(bytes).ok().filter(|key| !key.is_empty())),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// Removes the entry at `path` if it names `session_key` (a conversation that moved to
    /// another session, or was removed); best effort: a stale entry left is only a hint.
    pub(super) fn remove_if_names(path: &Path, session_key: &str) {
        if let Ok(Some(named)) = Self::read(path)
            && named == session_key
        {
            let _ = fs::remove_file(path);
        }
    }

    /// Syncs the index's directory (an entry renamed into place is durable after this).
    pub(super) fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }
}
