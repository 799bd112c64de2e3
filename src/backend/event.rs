//! What a CLI backend's turn emits, in the pool's vocabulary: the SSE event names of the
//! daemon's turn stream (`assistant.message_delta`, `assistant.message`, `tool.call`,
//! `permission.request`, `turn.end`), the turn's outcome ([`CliTurnOutcome`], with
//! [`TurnEnd`] and [`Usage`] reused from the Copilot path) and how a started turn failed
//! ([`TurnFailure`]), the one [`AbortHandle`] type every runner's turn hands out, and what
//! installing a lease's gateway tools did to a runner ([`GatewayToolsChange`]).

use std::sync::Arc;

use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::kinds::TurnEnd;
use crate::turn::Usage;

/// Ends a running turn of any CLI runner from anywhere (cloneable, `Send`). What "end"
/// means is the runner's: the live Claude runner asks its process to interrupt the turn (a
/// process that does not within its grace is killed); the one-shot runner kills the turn's
/// process group. Either way the turn ends `aborted` and the stored session stays, so the
/// next turn resumes it.
#[derive(Debug, Clone)]
pub struct AbortHandle(Arc<Notify>);

impl AbortHandle {
    /// A handle on `notify`, which the runner's turn waits on.
    pub(crate) fn new(notify: Arc<Notify>) -> Self {
        Self(notify)
    }

    /// Ends the turn (see the type).
    pub fn abort(&self) {
        self.0.notify_one();
    }
}

/// One event of a CLI backend's turn. The last event of every turn is [`BackendEvent::TurnEnd`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum BackendEvent {
    /// A piece of the assistant's text as it streams.
    MessageDelta {
        /// The new text.
        delta: String,
    },
    /// A complete assistant message (the final one is also the outcome's text).
    Message {
        /// Its text.
        text: String,
    },
    /// The CLI's model called one of the CLI's own tools (informational: the CLI runs it,
    /// after asking permission where its rules say so).
    ToolCall {
        /// The tool-use id.
        id: String,
        /// The tool's name (`Bash`, `Write`, ...).
        name: String,
        /// Its input.
        input: Value,
    },
    /// The CLI asked for permission to run a tool, and the permission policy decided.
    PermissionRequest {
        /// The tool's name.
        tool_name: String,
        /// The tool's input.
        input: Value,
        /// Whether the policy approved it.
        approved: bool,
    },
    /// The turn is over.
    TurnEnd(CliTurnOutcome),
}

impl BackendEvent {
    /// The SSE event name, as the daemon's turn stream spells it.
    pub fn name(&self) -> &'static str {
        match self {
            BackendEvent::MessageDelta { .. } => "assistant.message_delta",
            BackendEvent::Message { .. } => "assistant.message",
            BackendEvent::ToolCall { .. } => "tool.call",
            BackendEvent::PermissionRequest { .. } => "permission.request",
            BackendEvent::TurnEnd(_) => "turn.end",
        }
    }

    /// The event's data as JSON (the shape an SSE `data:` line would carry).
    pub fn data(&self) -> Value {
        match self {
            BackendEvent::MessageDelta { delta } => json!({ "deltaContent": delta }),
            BackendEvent::Message { text } => json!({ "content": text }),
            BackendEvent::ToolCall { id, name, input } => {
                json!({ "toolCallId": id, "toolName": name, "arguments": input })
            }
            BackendEvent::PermissionRequest {
                tool_name,
                input,
                approved,
            } => json!({ "toolName": tool_name, "input": input, "approved": approved }),
            BackendEvent::TurnEnd(outcome) => serde_json::to_value(outcome).unwrap_or(Value::Null),
        }
    }
}

/// The HTTP status of a failed model call as a CLI reports it in its result (Claude Code's
/// `api_error_status`, `null` when no call failed): an error status (400–599), else `None`.
pub fn reported_status(result: &Value) -> Option<u16> {
    result["api_error_status"]
        .as_u64()
        .and_then(|s| u16::try_from(s).ok())
        .filter(|s| (400..=599).contains(s))
}

/// How a started turn failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum TurnFailure {
    /// The CLI ended the turn with an error (`is_error`), e.g. the model endpoint is
    /// unreachable after the bounded retries.
    // Every text of the CLI's shown with its URLs' user information and query left out
    // (`secret::without_url_credentials`): a CLI names the endpoint it failed on.
    #[error(
        "the CLI reported an error: {}; check the model endpoint and key the backend \
         was given",
        crate::secret::without_url_credentials(.message)
    )]
    Cli {
        /// Its message (the `result` text).
        message: String,
        /// Why it stopped (`terminal_reason`), when it said.
        reason: Option<String>,
        /// The HTTP status of the failed model call, when the CLI reports it as a field
        /// (Claude Code's `api_error_status`; [`reported_status`]).
        status: Option<u16>,
    },
    /// The CLI process exited or its output ended during the turn.
    #[error(
        "the CLI process ended during the turn ({exit}); the next turn restarts it and \
         resumes the stored session. The end of its stderr: {}",
        crate::secret::without_url_credentials(.stderr_tail)
    )]
    Crashed {
        /// How it ended (`exit code 1`, `signal 9 (SIGKILL)`, or `still running` when only
        /// its output closed).
        exit: String,
        /// The last lines of its stderr.
        stderr_tail: String,
    },
    /// The turn ran past its time limit: a one-shot turn's process group was killed, a live
    /// process was interrupted (and killed if it did not stop within its grace).
    #[error(
        "the turn ran past its limit of {limit_secs} s and was stopped; raise the turn \
         timeout (a turn's `timeout_ms`, the pool's absolute turn timeout), or check why the \
         CLI stalls (its stderr: {})",
        crate::secret::without_url_credentials(.stderr_tail)
    )]
    TimedOut {
        /// The limit, in seconds.
        limit_secs: u64,
        /// The last lines of its stderr.
        stderr_tail: String,
    },
    /// The turn's retained output passed a limit; the process was stopped.
    #[error(
        "the turn's output passed the limit of {limit} {unit}; raise \
         `outputLimits.{key}` (at most {cap}) or ask for a shorter answer"
    )]
    OutputLimit {
        /// `bytes` or `lines`.
        unit: &'static str,
        /// The configuration key (`maxTurnRawChars`, `maxTurnLines`).
        key: &'static str,
        /// The limit in force.
        limit: u64,
        /// The highest value the key accepts.
        cap: u64,
    },
    /// Gemini CLI ended the run without an answer: its documented exit codes (41 auth, 42
    /// input or an unknown resume id, 53 turn limit, 55 untrusted folder) and its other
    /// failures (a dead or failing endpoint), typed by [`crate::backend::gemini::parse_output`].
    #[error("{error}")]
    Gemini {
        /// The typed failure, with the CLI's own message.
        error: crate::backend::gemini::GeminiError,
    },
}

/// What one CLI backend turn produced.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct CliTurnOutcome {
    /// The final assistant text (kept after an output limit when it had already arrived).
    pub text: String,
    /// How the turn ended.
    pub end: Option<TurnEnd>,
    /// Why it failed, when it did.
    pub failure: Option<TurnFailure>,
    /// Tokens of the turn's model calls (the CLI's per-turn `usage`).
    pub usage: Usage,
    /// The CLI's session id after the turn (to store and resume with).
    pub session_id: Option<String>,
    /// The process serving this turn was started with a resume of the stored session.
    pub resumed: bool,
    /// Tool calls of the CLI's model.
    pub tool_calls: u32,
    /// Permission requests the policy decided.
    pub permission_prompts: u32,
    /// Lines of retained output.
    pub retained_lines: u64,
    /// Bytes of retained output.
    pub retained_bytes: u64,
    /// The CLI's output says nothing of its tool calls until its end (a one-shot run with
    /// output `json` or `text`): a run cut short (a crash, a time limit) may have run tools
    /// nobody saw, so it never falls back (`crate::fallback`). Not part of `turn.end`.
    #[serde(skip)]
    pub tool_calls_unseen: bool,
}

/// What a runner's `set_gateway_tools` did (a pool lease installing its gateway tools).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GatewayToolsChange {
    /// The running CLI already lists these tools: their handlers answer its calls now.
    Installed,
    /// The tools differ from what the running CLI was started with: it was closed, and the
    /// next turn starts it again (resuming the session) with a bridge listing them.
    Restart,
    /// No CLI runs now: the next turn starts one with these tools.
    NotRunning,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reported_status_is_an_http_error_status_field_and_nothing_else() {
        assert_eq!(
            reported_status(&json!({"api_error_status": 401})),
            Some(401)
        );
        assert_eq!(
            reported_status(&json!({"api_error_status": 529})),
            Some(529)
        );
        assert_eq!(reported_status(&json!({"api_error_status": null})), None);
        assert_eq!(reported_status(&json!({"api_error_status": 200})), None);
        assert_eq!(reported_status(&json!({"api_error_status": "401"})), None);
        assert_eq!(reported_status(&json!({"api_error_status": 70000})), None);
        assert_eq!(reported_status(&json!({})), None);
    }

    #[test]
    fn a_failure_shows_the_clis_text_without_the_urls_user_information_and_query() {
        let url = "http://u:sk-1@127.0.0.1:9/v1/responses?api-key=sk-2";
        for failure in [
            TurnFailure::Cli {
                message: format!("unexpected status 401, url: {url}"),
                reason: None,
                status: None,
            },
            TurnFailure::Crashed {
                exit: "exit code 1".into(),
                stderr_tail: format!("error sending request for url ({url})"),
            },
            TurnFailure::TimedOut {
                limit_secs: 1,
                stderr_tail: format!("retrying {url}"),
            },
        ] {
            let shown = failure.to_string();
            assert!(
                !shown.contains("sk-1") && !shown.contains("sk-2"),
                "{shown}"
            );
            assert!(
                shown.contains("http://127.0.0.1:9/v1/responses?…"),
                "{shown}"
            );
        }
    }

    #[test]
    fn event_names_are_the_daemons_sse_names() {
        let end = BackendEvent::TurnEnd(CliTurnOutcome {
            end: Some(TurnEnd::Crashed),
            ..CliTurnOutcome::default()
        });
        assert_eq!(end.name(), "turn.end");
        assert_eq!(end.data()["end"], "crashed");
        let delta = BackendEvent::MessageDelta { delta: "hi".into() };
        assert_eq!(delta.name(), "assistant.message_delta");
        assert_eq!(delta.data()["deltaContent"], "hi");
        let ask = BackendEvent::PermissionRequest {
            tool_name: "Bash".into(),
            input: json!({}),
            approved: false,
        };
        assert_eq!(ask.name(), "permission.request");
        let call = BackendEvent::ToolCall {
            id: "t".into(),
            name: "Bash".into(),
            input: json!({}),
        };
        assert_eq!(call.name(), "tool.call");
    }
}
