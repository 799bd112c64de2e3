//! One conversation of a CLI backend, whatever runner holds it: [`CliConversation`] is the
//! one type the pool parks, leases and closes, and [`CliTurn`] its running turn. Each
//! runner is one enum arm (the live Claude Code process; the process-per-turn runner of
//! Codex, Gemini CLI and generic `cli-oneshot` backends), so the pool never matches on a
//! backend kind beyond choosing the arm. Both arms' turns hand out the one
//! [`AbortHandle`] type.
//!
//! Also carries a lease's gateway tools to the runner's MCP bridge
//! ([`CliConversation::set_gateway_tools`]) and takes their handlers out when the lease
//! ends, and owns where each runner's CLI keeps its own transcript of a session
//! ([`CliConversation::find_transcript`]), which the pool checks before it resumes one.

use std::path::{Path, PathBuf};

use super::BackendKind;
use super::claude_live::{ClaudeLive, ClaudeLiveError, ClaudeTurn};
use super::event::{AbortHandle, BackendEvent};
use super::oneshot::{Dialect, Oneshot, OneshotError, OneshotTurn};
use crate::process::ExitInfo;

/// What a one-shot run may take beyond its lease's turn limit: the lease's timer ends the
/// turn first (as `timeout`, with the lease's limit), the runner's own deadline only backs it.
pub const ONESHOT_LIMIT_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// A conversation held by a CLI runner.
#[derive(Debug)]
#[non_exhaustive]
pub enum CliConversation {
    /// One live Claude Code process per conversation (stream-json on stdio).
    Live(Box<ClaudeLive>),
    /// A process per turn (`cli-oneshot`: Codex, Gemini CLI, generic CLIs); between turns
    /// it holds the stored session and no process.
    Oneshot(Box<Oneshot>),
}

/// Why a turn of a [`CliConversation`] could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliStartError {
    /// The live runner could not start its process.
    #[error(transparent)]
    Live(#[from] ClaudeLiveError),
    /// The one-shot runner could not start the turn's process.
    #[error(transparent)]
    Oneshot(#[from] OneshotError),
}

impl CliStartError {
    /// Whether the turn's own input was refused (its prompt, system message or images: the
    /// caller's to fix), not the backend's start (its command, configuration, home, the OS).
    /// Nothing was started either way.
    pub fn is_callers(&self) -> bool {
        use ClaudeLiveError as L;
        use OneshotError as O;
        matches!(
            self,
            CliStartError::Oneshot(
                O::PromptTooLong { .. }
                    | O::PromptTooLongForStdin { .. }
                    | O::SystemMessageTooLong { .. }
                    | O::Image(_),
            ) | CliStartError::Live(L::Image(_) | L::SystemMessageTooLong { .. })
        )
    }
}

impl CliConversation {
    /// Sends `prompt` as the next user message (starting or resuming the CLI first when it
    /// is not running). Read the turn with [`CliTurn::next`] to its `turn.end`.
    pub async fn start_turn(&mut self, prompt: &str) -> Result<CliTurn<'_>, CliStartError> {
        self.start_turn_with_images(prompt, &[]).await
    }

    /// [`CliConversation::start_turn`] with image files (absolute paths, named as images:
    /// see [`super::image`]), passed as each runner does: Claude Code's `image` content
    /// blocks, a one-shot backend's `imageArg` / `imageMode` or its prompt.
    pub async fn start_turn_with_images(
        &mut self,
        prompt: &str,
        images: &[PathBuf],
    ) -> Result<CliTurn<'_>, CliStartError> {
        match self {
            CliConversation::Live(live) => Ok(CliTurn::Live(
                live.start_turn_with_images(prompt, images).await?,
            )),
            CliConversation::Oneshot(oneshot) => Ok(CliTurn::Oneshot(Box::new(
                oneshot.start_turn_with_images(prompt, images).await?,
            ))),
        }
    }

    /// Whether this conversation serves gateway tools to its CLI through the MCP bridge
    /// (Claude Code live, Codex; not Gemini CLI nor generic one-shot CLIs, nor a build
    /// without the `mcp-bridge` feature).
    pub fn serves_gateway_tools(&self) -> bool {
        match self {
            CliConversation::Live(_) => cfg!(feature = "mcp-bridge"),
            CliConversation::Oneshot(oneshot) => oneshot.serves_gateway_tools(),
        }
    }

    /// Makes `tools` (a lease's, with their handlers) the conversation's gateway tools: their
    /// handlers are swapped into the running CLI's bridge when it lists the same tools, else
    /// the CLI is started again with a bridge listing these (see
    /// [`super::GatewayToolsChange`]).
    #[cfg(feature = "mcp-bridge")]
    pub async fn set_gateway_tools(
        &mut self,
        tools: Vec<crate::turn::GatewayTool>,
    ) -> super::GatewayToolsChange {
        match self {
            CliConversation::Live(live) => live.set_gateway_tools(tools).await,
            CliConversation::Oneshot(oneshot) => oneshot.set_gateway_tools(tools),
        }
    }

    /// A lease's settings for its turns: its permission policy, reasoning effort, model and
    /// system prompt (a conversation kept between leases runs each lease's, never the ones
    /// it was opened with, as far as its backend passes them: a system prompt given only to
    /// a session's first run, `systemPromptWhen = "first"`, stays the session's first).
    /// Claude Code's process is restarted (resuming the session) when its `--effort`,
    /// `--permission-mode`, model or (passed at every start) system prompt must change
    /// (`true` then); a one-shot conversation applies them to its next run (Codex: `-c
    /// model_reasoning_effort`; other dialects have no effort mapping and ignore it, see
    /// `OneshotConfig::reasoning_effort`).
    pub async fn set_lease_settings(
        &mut self,
        permission: std::sync::Arc<dyn crate::permission::PermissionPolicy>,
        reasoning_effort: Option<crate::kinds::ReasoningEffort>,
        model: Option<String>,
        system_prompt: Option<String>,
    ) -> bool {
        match self {
            CliConversation::Live(live) => {
                live.set_model(model, system_prompt);
                live.set_lease_settings(permission, reasoning_effort).await
            }
            CliConversation::Oneshot(oneshot) => {
                oneshot.set_model(model, system_prompt);
                oneshot.set_reasoning_effort(reasoning_effort);
                false
            }
        }
    }

    /// The lease's limit on each turn (`None`: none of its own): a one-shot run may take it
    /// and [`ONESHOT_LIMIT_MARGIN`] more, so the lease's timer, not the runner's default
    /// ([`crate::backend::oneshot::DEFAULT_TURN_TIMEOUT`]), ends a long turn. Claude Code's
    /// turns have no limit of their own.
    pub fn set_turn_limit(&mut self, limit: Option<std::time::Duration>) {
        if let CliConversation::Oneshot(oneshot) = self {
            oneshot.set_turn_timeout(
                limit.map_or(crate::backend::oneshot::DEFAULT_TURN_TIMEOUT, |limit| {
                    limit.saturating_add(ONESHOT_LIMIT_MARGIN)
                }),
            );
        }
    }

    /// How long a one-shot run may take (`None` for Claude Code, whose turns have no limit
    /// of their own).
    #[cfg(test)]
    pub(crate) fn own_turn_limit(&self) -> Option<std::time::Duration> {
        match self {
            CliConversation::Live(_) => None,
            CliConversation::Oneshot(oneshot) => Some(oneshot.turn_timeout()),
        }
    }

    /// Takes a lease's gateway tool handlers out (the lease ended): a call before the next
    /// [`CliConversation::set_gateway_tools`] is an `isError` result at once.
    #[cfg(feature = "mcp-bridge")]
    pub fn clear_gateway_handlers(&mut self) {
        match self {
            CliConversation::Live(live) => live.clear_gateway_handlers(),
            CliConversation::Oneshot(oneshot) => oneshot.clear_gateway_handlers(),
        }
    }

    /// The CLI session id to store (learned from the CLI, or the one it was started with).
    pub fn session_id(&self) -> Option<&str> {
        match self {
            CliConversation::Live(live) => live.session_id(),
            CliConversation::Oneshot(oneshot) => oneshot.session_id(),
        }
    }

    /// The directory its CLI runs in, where Claude Code and Gemini CLI file the session.
    pub fn working_directory(&self) -> &std::path::Path {
        match self {
            CliConversation::Live(live) => live.working_directory(),
            CliConversation::Oneshot(oneshot) => oneshot.working_directory(),
        }
    }

    /// The pid (= process group id) of the CLI process while one runs (a one-shot
    /// conversation runs none between turns; see [`CliTurn::pid`] during one).
    pub fn pid(&self) -> Option<u32> {
        match self {
            CliConversation::Live(live) => live.pid(),
            CliConversation::Oneshot(_) => None,
        }
    }

    /// Ends the conversation's process (gracefully first), if one runs.
    pub async fn close(self) -> Option<ExitInfo> {
        match self {
            CliConversation::Live(live) => live.close().await,
            // Its turns' processes end with their turns.
            CliConversation::Oneshot(_) => None,
        }
    }

    /// Whether the CLI of backend `backend_id` (of `kind`) still has session `session_id`'s
    /// transcript, run with `home` in `cwd`: `Ok(Some(path))` when found, `Ok(None)` when the
    /// runner has no transcript it knows to check (generic one-shot CLIs), `Err(path)` (the
    /// file or folder looked in) when it is missing. Per runner: Claude Code's
    /// [`CliConversation::transcript_path`]; Codex's rollout under `<home>/.codex/sessions`;
    /// Gemini CLI's chat file ([`super::gemini::transcript_path`]). Blocking (small file
    /// reads).
    pub fn find_transcript(
        dialect: Dialect,
        kind: BackendKind,
        home: &Path,
        cwd: &Path,
        session_id: &str,
    ) -> Result<Option<PathBuf>, PathBuf> {
        Self::runner_dialect(kind, dialect)
            .transcript(home, cwd, session_id)
            .transpose()
    }

    /// The dialect of the runner of a backend of `kind` configured with `dialect`: the live
    /// runner is Claude Code's, whatever the configuration says.
    pub fn runner_dialect(kind: BackendKind, dialect: Dialect) -> Dialect {
        match kind {
            BackendKind::CliOneshot => dialect,
            _ => Dialect::Claude,
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
    /// A turn of the one-shot runner (its own process).
    Oneshot(Box<OneshotTurn<'a>>),
}

impl CliTurn<'_> {
    /// The next event; `None` after the [`BackendEvent::TurnEnd`].
    pub async fn next(&mut self) -> Option<BackendEvent> {
        match self {
            CliTurn::Live(turn) => turn.next().await,
            CliTurn::Oneshot(turn) => turn.next().await,
        }
    }

    /// A handle that interrupts this turn (it ends `aborted`).
    pub fn abort_handle(&self) -> AbortHandle {
        match self {
            CliTurn::Live(turn) => turn.abort_handle(),
            CliTurn::Oneshot(turn) => turn.abort_handle(),
        }
    }

    /// The pid (= process group id) of the process serving this turn, while it runs.
    pub fn pid(&self) -> Option<u32> {
        match self {
            CliTurn::Live(turn) => turn.pid(),
            CliTurn::Oneshot(turn) => turn.pid(),
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
