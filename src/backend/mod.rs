//! Backends: which kind of agent CLI holds a conversation (issue 17). Owns the backend
//! notion ([`BackendKind`]), the configuration surface of CLI backends
//! ([`CliBackendConfig`], submodule `config`), the event vocabulary every backend's turn
//! speaks ([`BackendEvent`], the names of the daemon's SSE events), the two CLI runners:
//! Claude Code as one live stdio process per conversation ([`claude_live`]) and a process
//! per turn for `cli-oneshot` backends such as Codex ([`oneshot`]), what Gemini CLI needs
//! around its runs ([`gemini`]: its settings file, its `stream-json` (or JSON) output and
//! exit codes, where its transcripts live), the images a CLI turn takes ([`image`]), and
//! the loopback MCP bridge that serves a conversation's gateway tools to a CLI backend
//! (`mcp_bridge`, feature `mcp-bridge`).
//!
//! The pool leases both runners' conversations (`crate::pool::Pool::lease_cli`) as
//! [`CliConversation`]s: one enum over the runners, so a new runner is one more arm; their
//! turns share one [`AbortHandle`] type.

pub mod claude_live;
mod config;
mod conversation;
mod event;
pub mod gemini;
pub mod image;
#[cfg(feature = "mcp-bridge")]
pub mod mcp_bridge;
pub mod oneshot;

pub use config::{
    CliBackendConfig, ConfigError, DEFAULT_MAX_TURN_LINES, DEFAULT_MAX_TURN_RAW_CHARS, ImageMode,
    InputMode, MAX_TURN_LINES_CAP, MAX_TURN_RAW_CHARS_CAP, MODEL_PLACEHOLDER, OutputFormat,
    OutputLimits, PROMPT_PLACEHOLDER, SESSION_ID_PLACEHOLDER, SafetySwitches, SessionMode,
    SystemPromptWhen, TextRewrite, TextTransforms, claude_effort, claude_permission_mode,
    codex_effort, names_config_key, names_flag,
};
pub use conversation::{CliConversation, CliStartError, CliTurn, ONESHOT_LIMIT_MARGIN};
pub use event::{
    AbortHandle, BackendEvent, CliTurnOutcome, GatewayToolsChange, TurnFailure, reported_status,
};

use serde::{Deserialize, Serialize};

/// The longest single argument Linux accepts (`MAX_ARG_STRLEN`, 128 KiB with its NUL): a
/// prompt or system prompt a CLI runner passes as one argument must fit, or the spawn fails
/// with `E2BIG`.
const MAX_ARG_BYTES: usize = 128 * 1024 - 1;

/// How a backend runs its agent CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// The Copilot runtime's JSON-RPC server: many conversations per process (the pool's
    /// workers).
    Copilot,
    /// A process per turn; session continuity through resume arguments.
    CliOneshot,
    /// One long-lived stdio process per conversation, stream-json in and out.
    CliLive,
}

impl BackendKind {
    /// `copilot`, `cli-oneshot` or `cli-live` (a bounded metrics label later).
    pub fn label(self) -> &'static str {
        match self {
            BackendKind::Copilot => "copilot",
            BackendKind::CliOneshot => "cli-oneshot",
            BackendKind::CliLive => "cli-live",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_kinds_read_and_print_as_the_issue_spells_them() {
        for kind in [
            BackendKind::Copilot,
            BackendKind::CliOneshot,
            BackendKind::CliLive,
        ] {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.label()));
            assert_eq!(serde_json::from_str::<BackendKind>(&json).unwrap(), kind);
        }
        assert!(serde_json::from_str::<BackendKind>("\"cli_live\"").is_err());
    }
}
