//! Request bodies: read with a size and a time limit, parsed into the library's types, and
//! the lease request of a conversation (validated here with the library's checks, so a Rust
//! embedder and an HTTP caller get the same errors).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::error::{error, pool_error};
use crate::auth::LeaseAuth;
use crate::confine::{ConfineError, confine};
use crate::pool::LeaseRequest;
use crate::rpc::messages::ProviderConfig;
use crate::secret::Secret;
use crate::session_options::SessionOptions;

/// A request body must arrive within this long; a client that announces more than it sends
/// cannot hold a connection open.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Reads a request body with the size limit and the time limit.
pub(super) async fn read_body(state: &AppState, body: Body) -> Result<Bytes, Response> {
    let limit = state.config.max_body_bytes;
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            let mut too_large = false;
            while let Some(c) = cause {
                too_large |= c.is::<http_body_util::LengthLimitError>();
                cause = c.source();
            }
            if too_large {
                Err(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "too_large",
                    format!("the body exceeds max_body_bytes ({limit} bytes)"),
                ))
            } else {
                Err(error(
                    StatusCode::BAD_REQUEST,
                    "bad_body",
                    format!("could not read the body: {e}"),
                ))
            }
        }
        Err(_) => Err(error(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            "the body did not arrive in time",
        )),
    }
}

/// Parses a JSON body; the error names the field serde complained about.
pub(super) fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("invalid JSON body: {e}"),
        )
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProviderBody {
    #[serde(rename = "type", default)]
    kind: Option<crate::kinds::ProviderType>,
    base_url: String,
    #[serde(default)]
    api_key: Option<Secret>,
    #[serde(default)]
    bearer_token: Option<Secret>,
    #[serde(default)]
    wire_api: Option<crate::kinds::WireApi>,
    #[serde(default)]
    headers: Option<BTreeMap<String, String>>,
}

/// The credentials of a conversation; the levels and their precedence are
/// [`crate::auth::resolve`]'s.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct AuthBody {
    #[serde(default)]
    use_logged_in_user: bool,
    #[serde(default)]
    github_token: Option<Secret>,
    #[serde(default)]
    profile_id: Option<String>,
    #[serde(default)]
    profile_version: Option<String>,
    /// The gateway-resolved level: a token from one of the gateway's auth profiles.
    #[serde(default)]
    resolved_token: Option<Secret>,
    #[serde(default)]
    auth_profile_id: Option<String>,
}

/// A gateway tool of a turn.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ToolBody {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "empty_schema")]
    pub parameters: Value,
}

fn empty_schema() -> Value {
    json!({"type": "object", "properties": {}})
}

/// What identifies and configures a conversation (shared by turns, compact and reset).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct ConversationBody {
    #[serde(default)]
    auth: Option<AuthBody>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    provider: Option<ProviderBody>,
    #[serde(default)]
    reasoning_effort: Option<crate::kinds::ReasoningEffort>,
    /// The runtime's own `session.create` fields (camelCase), checked against its schema.
    #[serde(default)]
    session: Option<Value>,
}

/// `POST /v1/turns`: the conversation's settings, flattened beside the turn's own fields.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TurnBody {
    pub agent_id: String,
    pub session_key: String,
    pub prompt: String,
    #[serde(default)]
    auth: Option<AuthBody>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    provider: Option<ProviderBody>,
    #[serde(default)]
    reasoning_effort: Option<crate::kinds::ReasoningEffort>,
    #[serde(default)]
    session: Option<Value>,
    #[serde(default)]
    pub tools: Vec<ToolBody>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Files, directories and inline content sent with the prompt.
    #[serde(default)]
    pub attachments: Vec<super::attachments::AttachmentBody>,
    /// `enqueue` or `immediate`.
    #[serde(default)]
    pub mode: Option<crate::kinds::SendMode>,
    /// The agent mode (`agentMode`, as the SDKs spell it, is accepted too).
    #[serde(default, alias = "agentMode")]
    pub agent_mode: Option<crate::kinds::AgentMode>,
    /// The hooks the gateway answers or is told about (over the event stream).
    #[serde(default)]
    pub hooks: Vec<crate::kinds::HookName>,
}

impl TurnBody {
    /// The conversation's settings, leaving the turn's own fields.
    pub(super) fn take_conversation(&mut self) -> ConversationBody {
        ConversationBody {
            auth: self.auth.take(),
            model: self.model.take(),
            provider: self.provider.take(),
            reasoning_effort: self.reasoning_effort.take(),
            session: self.session.take(),
        }
    }
}

/// The body of compact/reset: the conversation's settings (they must match its turns, or a
/// new session would be opened), optional.
pub(super) fn conversation_body(body: &Bytes) -> Result<ConversationBody, Response> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(ConversationBody::default());
    }
    parse(body)
}

fn provider_config(p: ProviderBody) -> Result<ProviderConfig, Response> {
    let provider = ProviderConfig {
        kind: p.kind,
        wire_api: p.wire_api,
        base_url: p.base_url,
        api_key: p.api_key,
        bearer_token: p.bearer_token,
        headers: p.headers,
    };
    // The library's checks: a Rust embedder gets the same errors.
    crate::pool::validate_provider(&provider).map_err(|e| pool_error(&e))?;
    Ok(provider)
}

/// The agent's working directory (the library's layout, beside its home).
fn work_dir(state: &AppState, agent_id: &str) -> Result<PathBuf, Response> {
    crate::home::work_dir(&state.pool.config().agents_base_dir, agent_id)
        .map_err(|e| error(StatusCode::BAD_REQUEST, "bad_request", e.to_string()))
}

/// Creates the agent's working directory, mode 0700. Called only for a request that passed
/// authentication and validation and is about to run a turn.
pub(super) async fn create_work_dir(work: &Path) -> Result<(), Response> {
    // mkdir, chmod and stat: file work, off the async threads.
    let work = work.to_path_buf();
    match tokio::task::spawn_blocking(move || crate::home::create_work_dir(&work)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "io",
            e.to_string(),
        )),
        Err(e) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            e.to_string(),
        )),
    }
}

/// The `session` object of a body: checked against the runtime's schema (the library's
/// check), its MCP servers against the daemon's policy, and its directories confined to the
/// agent's working directory and the daemon's `allowed_work_roots` (replaced by their
/// resolved paths, which is what the runtime gets).
async fn session_options(
    state: &AppState,
    work: &Path,
    session: Value,
) -> Result<SessionOptions, Response> {
    let bad = |message: String| error(StatusCode::BAD_REQUEST, "bad_request", message);
    let options = SessionOptions::from_value(session).map_err(|e| bad(e.to_string()))?;
    options
        .check_mcp_servers(state.config.allow_local_mcp_servers)
        .map_err(|e| bad(e.to_string()))?;
    let mut roots = vec![work.to_path_buf()];
    roots.extend(state.config.allowed_work_roots.iter().cloned());
    // Resolving paths is file work: off the async threads.
    let confined = tokio::task::spawn_blocking(move || confine_directories(options, &roots))
        .await
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    confined.map_err(bad)
}

/// Replaces `workingDirectory` and every `additionalDirectories` entry by its resolved
/// path, refusing any outside `roots`.
fn confine_directories(
    mut options: SessionOptions,
    roots: &[PathBuf],
) -> Result<SessionOptions, String> {
    let text = |path: PathBuf| path.to_string_lossy().into_owned();
    if let Some(Value::String(dir)) = options.get("workingDirectory") {
        let resolved =
            confine("session.workingDirectory", Path::new(dir), roots).map_err(message)?;
        options
            .set("workingDirectory", text(resolved))
            .map_err(|e| e.to_string())?;
    }
    if let Some(Value::Array(dirs)) = options.get("additionalDirectories") {
        let mut resolved = Vec::with_capacity(dirs.len());
        for (i, dir) in dirs.iter().enumerate() {
            // The schema check made every entry a string.
            let dir = dir.as_str().unwrap_or_default();
            let field = format!("session.additionalDirectories.{i}");
            resolved.push(text(
                confine(&field, Path::new(dir), roots).map_err(message)?,
            ));
        }
        options
            .set("additionalDirectories", resolved)
            .map_err(|e| e.to_string())?;
    }
    Ok(options)
}

fn message(e: ConfineError) -> String {
    e.to_string()
}

/// An SDK session (`sdk:<session id>`) is its SDK connection's: the HTTP API neither runs,
/// aborts, compacts nor resets it.
pub(super) fn refuse_sdk_session(session_key: &str) -> Result<(), Response> {
    if session_key.starts_with(crate::ids::SDK_SESSION_KEY_PREFIX) {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!(
                "session_key: keys starting with `{prefix}` name sessions of the SDK endpoint \
                 (`{prefix}<session id>`), which only the SDK connection that opened them \
                 drives; choose a session_key without that prefix for an HTTP conversation",
                prefix = crate::ids::SDK_SESSION_KEY_PREFIX
            ),
        ));
    }
    Ok(())
}

/// The lease request for a conversation; the working directory is the agent's own unless
/// its `session` names another one (not created here: compact and reset must not create it).
pub(super) async fn lease_request(
    state: &AppState,
    agent_id: &str,
    session_key: &str,
    conv: ConversationBody,
) -> Result<LeaseRequest, Response> {
    // The library's checks: a Rust embedder gets the same errors.
    crate::pool::validate_session_key(session_key).map_err(|e| pool_error(&e))?;
    refuse_sdk_session(session_key)?;
    crate::home::validate_agent_id(agent_id).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("agent_id: {e}"),
        )
    })?;
    let work = work_dir(state, agent_id)?;
    let options = match conv.session {
        Some(session) => Some(session_options(state, &work, session).await?),
        None => None,
    };
    let mut req = LeaseRequest::new(agent_id, session_key, work);
    let auth = conv.auth.unwrap_or_default();
    req.auth = LeaseAuth {
        use_logged_in_user: auth.use_logged_in_user,
        github_token: auth.github_token,
        profile_id: auth.profile_id,
        profile_version: auth.profile_version,
        resolved_api_key: auth.resolved_token,
        auth_profile_id: auth.auth_profile_id,
        env: state.config.env_tokens.clone(),
        forbid_logged_in_user: !state.config.allow_logged_in_user,
    };
    req.model = conv.model;
    req.provider = conv.provider.map(provider_config).transpose()?;
    // The library's check: a request nothing could serve is refused before anything exists.
    crate::auth::resolve_for_lease(&req.auth, req.provider.is_some())
        .map_err(|e| pool_error(&e.into()))?;
    req.reasoning_effort = conv.reasoning_effort;
    if let Some(options) = options {
        // The library's merge: a model or reasoning effort given in both places must agree.
        req.apply_session_options(options)
            .map_err(|e| pool_error(&e))?;
    }
    req.handlers.timeouts = state.config.timeouts;
    req.handlers.transcript = state.config.transcript.clone();
    Ok(req)
}
