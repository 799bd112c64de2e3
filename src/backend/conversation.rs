//! One conversation of a CLI backend, whatever runner holds it: [`CliConversation`] is the
//! one type the pool parks, leases and closes, and [`CliTurn`] its running turn. Each
//! runner is one enum arm (the live Claude Code process today; the process-per-turn runner
//! is the next arm), so the pool never matches on a backend kind itself.
//!
//! Also owns where a runner's CLI keeps its own transcript of a session
//! ([`CliConversation::transcript_path`]), which the pool checks before it resumes one.

use std::path::{Path, PathBuf};

use super::claude_live::{AbortHandle, ClaudeLive, ClaudeLiveError, ClaudeTurn};
use super::event::BackendEvent;
use crate::process::ExitInfo;

/// A conversation held by a CLI runner.
#[derive(Debug)]
#[non_exhaustive]
pub enum CliConversation {
    /// One live Claude Code process per conversation (stream-json on stdio).
    Live(ClaudeLive),
}

/// Why a turn of a [`CliConversation`] could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliStartError {
    /// The live runner could not start its process.
    #[error(transparent)]
    Live(#[from] ClaudeLiveError),
}

impl CliConversation {
    /// Sends `prompt` as the next user message (starting or resuming the CLI first when it
    /// is not running). Read the turn with [`CliTurn::next`] to its `turn.end`.
    pub async fn start_turn(&mut self, prompt: &str) -> Result<CliTurn<'_>, CliStartError> {
        match self {
            CliConversation::Live(live) => Ok(CliTurn::Live(live.start_turn(prompt).await?)),
        }
    }

    /// The CLI session id to store (learned from the CLI, or the one it was started with).
    pub fn session_id(&self) -> Option<&str> {
        match self {
            CliConversation::Live(live) => live.session_id(),
        }
    }

    /// The pid (= process group id) of the CLI process while one runs.
    pub fn pid(&self) -> Option<u32> {
        match self {
            CliConversation::Live(live) => live.pid(),
        }
    }

    /// Ends the conversation's process (gracefully first), if one runs.
    pub async fn close(self) -> Option<ExitInfo> {
        match self {
            CliConversation::Live(live) => live.close().await,
        }
    }

    /// Where the CLI of a live (Claude Code) conversation keeps session `session_id`'s
    /// transcript: `<home>/.claude/projects/<cwd slug>/<id>.jsonl`, the slug being the
    /// working directory (resolved as the process sees it) with every character that is
    /// not an ASCII letter or digit replaced by `-` (reference `cli-backends.md` §3.5).
    pub fn transcript_path(home: &Path, cwd: &Path, session_id: &str) -> PathBuf {
        let cwd = std::fs::canonicalize(cwd).unwrap_or_else(|_| cwd.to_path_buf());
        let slug: String = cwd
            .to_string_lossy()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        home.join(".claude")
            .join("projects")
            .join(slug)
            .join(format!("{session_id}.jsonl"))
    }
}

/// A running turn of a [`CliConversation`]. Dropping it before its `turn.end` kills the
/// CLI process (its output would leak into the next turn); the next turn resumes.
#[non_exhaustive]
pub enum CliTurn<'a> {
    /// A turn of the live Claude Code process.
    Live(ClaudeTurn<'a>),
}

impl CliTurn<'_> {
    /// The next event; `None` after the [`BackendEvent::TurnEnd`].
    pub async fn next(&mut self) -> Option<BackendEvent> {
        match self {
            CliTurn::Live(turn) => turn.next().await,
        }
    }

    /// A handle that interrupts this turn (it ends `aborted`).
    pub fn abort_handle(&self) -> AbortHandle {
        match self {
            CliTurn::Live(turn) => turn.abort_handle(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transcript_slug_replaces_every_non_alphanumeric_character() {
        // The reference's examples (paths that do not exist are used as they are).
        let home = Path::new("/h");
        assert_eq!(
            CliConversation::transcript_path(home, Path::new("/srv/ws/claude"), "id1"),
            Path::new("/h/.claude/projects/-srv-ws-claude/id1.jsonl")
        );
        assert_eq!(
            CliConversation::transcript_path(home, Path::new("/srv/ws/claude.v2_x y"), "id2"),
            Path::new("/h/.claude/projects/-srv-ws-claude-v2-x-y/id2.jsonl")
        );
    }
}
