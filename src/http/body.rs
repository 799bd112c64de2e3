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
use utoipa::ToSchema;

use super::AppState;
use super::error::{error, pool_error};
use super::object::{self, Object};
use crate::auth::LeaseAuth;
use crate::json_values::value_limit;
use crate::pool::LeaseRequest;
use crate::rpc::messages::{AzureOptions, ProviderConfig};
use crate::secret::Secret;
use crate::session_options::SessionOptions;

/// A request body must arrive within this long; a client that announces more than it sends
/// cannot hold a connection open.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Reads a request body with the size limit (its bytes and the JSON values they hold) and
/// the time limit.
pub(super) async fn read_body(state: &AppState, body: Body) -> Result<Bytes, Response> {
    let limit = state.config.max_body_bytes;
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, limit)).await {
        // Bodies are parsed into values: one dense with them (`[0,0,…]`) would take many
        // times its bytes, so their count is bounded too.
        Ok(Ok(bytes)) if crate::json_values::holds_more_than(&bytes, value_limit(limit)) => {
            Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!(
                    "the body holds more than {} JSON values (elements, members and keys: \
                     one per {} bytes of max_body_bytes, at least {}); send large data as \
                     one string or as attachments by path, or raise max_body_bytes in the \
                     daemon's config",
                    value_limit(limit),
                    crate::json_values::BYTES_PER_VALUE,
                    crate::json_values::MIN_VALUE_LIMIT
                ),
            ))
        }
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
                    format!(
                        "the body exceeds max_body_bytes ({limit} bytes); send large files \
                         as attachments by path, or raise max_body_bytes in the daemon's \
                         config"
                    ),
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

/// Parses a JSON body; the error names the field serde complained about, never the value it
/// found there (a wrong-typed field may hold a secret).
/// The body must be a JSON object ([`super::object`]).
pub(super) fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Response> {
    parse_json::<Object<T>>(body).map(|o| o.0)
}

fn parse_json<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!(
                "invalid JSON body: {}",
                crate::secret::json_error_without_values(&e)
            ),
        )
    })
}

/// A conversation's BYOK provider, snake_case (the runtime's `provider` object, mapped by
/// [`provider_config`]; the shapes and their checks are [`crate::provider`]'s).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct ProviderBody {
    #[serde(rename = "type", default)]
    kind: Option<crate::kinds::ProviderType>,
    /// An `http://` or `https://` URL.
    #[schema(pattern = "^https?://")]
    base_url: String,
    #[serde(default)]
    #[schema(value_type = Option<String>, format = Password)]
    api_key: Option<Secret>,
    #[serde(default)]
    #[schema(value_type = Option<String>, format = Password)]
    bearer_token: Option<Secret>,
    #[serde(default)]
    wire_api: Option<crate::kinds::WireApi>,
    #[serde(default, deserialize_with = "object::optional")]
    azure: Option<AzureBody>,
    #[serde(default)]
    headers: Option<BTreeMap<String, String>>,
    #[serde(default)]
    model_id: Option<String>,
    #[serde(default)]
    wire_model: Option<String>,
    /// Limits are read as any JSON value so a bad one is refused naming its field.
    #[serde(default)]
    #[schema(value_type = Option<u64>, minimum = 1, maximum = 100_000_000)]
    max_prompt_tokens: Option<Value>,
    #[serde(default)]
    #[schema(value_type = Option<u64>, minimum = 1, maximum = 100_000_000)]
    max_output_tokens: Option<Value>,
    #[serde(default)]
    #[schema(value_type = Option<u64>, minimum = 1, maximum = 100_000_000)]
    max_context_window_tokens: Option<Value>,
}

/// `provider.azure`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct AzureBody {
    #[serde(default)]
    api_version: Option<String>,
}

/// The credentials of a conversation; the levels and their precedence are
/// [`crate::auth::resolve`]'s.
#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
struct AuthBody {
    #[serde(default)]
    use_logged_in_user: bool,
    #[serde(default)]
    #[schema(value_type = Option<String>, format = Password)]
    github_token: Option<Secret>,
    #[serde(default)]
    profile_id: Option<String>,
    #[serde(default)]
    profile_version: Option<String>,
    /// The gateway-resolved level: a token from one of the gateway's auth profiles.
    #[serde(default)]
    #[schema(value_type = Option<String>, format = Password)]
    resolved_token: Option<Secret>,
    #[serde(default)]
    auth_profile_id: Option<String>,
}

/// A gateway tool of a turn (its calls arrive as `tool.call` events).
#[derive(Deserialize, ToSchema, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct ToolBody {
    /// The tool's name: not empty, unique in the turn, not `catalog_search`.
    #[schema(min_length = 1)]
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// The JSON schema of the tool's arguments (default: an object without properties).
    #[serde(default = "empty_schema")]
    pub parameters: Value,
}

fn empty_schema() -> Value {
    json!({"type": "object", "properties": {}})
}

/// The body of reset: the conversation's settings (as its turns send them; they must match,
/// or a new session would be opened).
#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct ConversationBody {
    #[serde(default, deserialize_with = "object::optional")]
    auth: Option<AuthBody>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default, deserialize_with = "object::optional")]
    provider: Option<ProviderBody>,
    #[serde(default)]
    reasoning_effort: Option<crate::kinds::ReasoningEffort>,
    /// The runtime's own `session.create` fields (camelCase), checked against its schema.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    session: Option<Value>,
}

/// The body of compact: the conversation's settings (as for reset), and what the summary
/// should focus on or keep.
#[derive(Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CompactBody {
    /// What the summary should focus on or keep.
    #[serde(default)]
    custom_instructions: Option<String>,
    #[serde(default, deserialize_with = "object::optional")]
    auth: Option<AuthBody>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default, deserialize_with = "object::optional")]
    provider: Option<ProviderBody>,
    #[serde(default)]
    reasoning_effort: Option<crate::kinds::ReasoningEffort>,
    /// The runtime's own `session.create` fields (camelCase), checked against its schema.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    session: Option<Value>,
}

impl CompactBody {
    /// The custom instructions and the conversation's settings (every field named, so a new
    /// setting of a conversation does not compile until compact takes it too).
    pub(super) fn into_parts(self) -> (Option<String>, ConversationBody) {
        let conversation = ConversationBody {
            auth: self.auth,
            model: self.model,
            provider: self.provider,
            reasoning_effort: self.reasoning_effort,
            session: self.session,
        };
        (self.custom_instructions, conversation)
    }
}

/// `POST /v1/turns`: the conversation's settings, flattened beside the turn's own fields.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct TurnBody {
    /// The agent: lowercase letters, digits, `_` and `-`, starting with a letter or digit.
    #[schema(pattern = "^[a-z0-9][a-z0-9_-]*$", min_length = 1, max_length = 64)]
    pub agent_id: String,
    /// The gateway's key of the conversation (1 to 512 bytes).
    #[schema(min_length = 1, max_length = 512)]
    pub session_key: String,
    /// The user's message.
    pub prompt: String,
    #[serde(default, deserialize_with = "object::optional")]
    auth: Option<AuthBody>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default, deserialize_with = "object::optional")]
    provider: Option<ProviderBody>,
    #[serde(default)]
    reasoning_effort: Option<crate::kinds::ReasoningEffort>,
    /// The runtime's own `session.create` fields (camelCase), checked against its schema.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    session: Option<Value>,
    #[serde(default, deserialize_with = "object::each")]
    pub tools: Vec<ToolBody>,
    /// The turn's absolute time limit: above 0, at most the daemon's own.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub timeout_ms: Option<u64>,
    /// Files, directories and inline content sent with the prompt. A CLI backend takes
    /// images only (PNG, JPEG, GIF or WebP: a whole file by path named `.png`, `.jpg`,
    /// `.jpeg`, `.gif` or `.webp`, or inline with an image `media_type`; anything else is a
    /// 400): Claude Code gets each as an image block of the message, Codex as `--image`,
    /// Gemini CLI as an `@path` reference (inside the agent's work directory only).
    #[serde(default, deserialize_with = "object::each")]
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
    /// The backend that holds the conversation: `copilot` (default) or a CLI backend id
    /// configured in the daemon (`[backends.<id>]`, e.g. `claude-cli`). Each backend keeps
    /// its own session of the conversation. A CLI backend's turn streams the same events
    /// (`assistant.message_delta`, `assistant.message`, `tool.call` for the CLI's own
    /// tools, `permission.request` answered by the gateway, `turn.end` with usage); its
    /// model endpoint and key are `provider.base_url` and `provider.api_key`, and its auth
    /// identity `auth.auth_profile_id` (else `auth.profile_id`, else the key itself).
    /// `tools` reach `claude-cli` and `codex-cli` through a loopback MCP bridge: each call
    /// is a `tool.call` with a `request_id`, answered as for `copilot`; other CLI backends
    /// refuse them. Hooks are not offered to CLI backends; of `attachments`, images only.
    #[serde(default)]
    #[schema(example = "claude-cli")]
    pub backend: Option<String>,
    /// Backends to run the turn on next, in order, when the one before fails with a
    /// retryable class (`auth`: the model answered 401/403; `rate_limit`: 429; `timeout`;
    /// `crash`) before any of its output (assistant text, a tool call) was streamed. Each id
    /// is `copilot` or a configured CLI backend, at most 4, none twice (nor `backend`
    /// itself). The next backend runs the same prompt and attachments after a prelude from
    /// the failed conversation's transcript (a Copilot conversation's mirror, `[turns]
    /// transcript_dir`, or Claude Code's own): its compaction summary first, then its newest
    /// messages within `prelude_chars`. The stream shows
    /// `backend.fallback`, then the next backend's events; `turn.end` names the backend that
    /// answered. With a CLI backend in the chain, hooks, attachments other than images and
    /// `mode`/`agent_mode` are refused, and gateway tools unless every CLI backend of the
    /// chain takes them, as for a CLI turn.
    #[serde(default)]
    #[schema(max_items = 4, example = json!(["claude-cli"]))]
    pub fallback: Vec<String>,
    /// The prelude's budget in characters (default 8000, at most 200000).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 200_000)]
    pub prelude_chars: Option<usize>,
    /// Session event types not to stream: each a type (`session.usage_info`) or a prefix
    /// ending in `*` (`model.*`, the runtime's internal events, in no schema, with a whole
    /// snapshot of the conversation every turn). The daemon's own events (`tool.call`,
    /// `permission.request`, `user_input.request`, `hook.request`, `hook.notification`,
    /// `backend.fallback`, `turn.end`) always come. At most 32; default: every event.
    /// Omitted `model.*` events and `system.message`, which the daemon does not read
    /// either, are dropped where the runtime's output is read, unparsed.
    #[serde(default)]
    #[schema(max_items = 32, example = json!(["model.*"]))]
    pub omit_events: Vec<String>,
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

/// An optional body of compact or reset: empty (or `null`) is the default (no settings).
pub(super) fn optional_body<T: Default + for<'de> Deserialize<'de>>(
    body: &Bytes,
) -> Result<T, Response> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(T::default());
    }
    Ok(parse_json::<Option<Object<T>>>(body)?
        .map(|o| o.0)
        .unwrap_or_default())
}

fn provider_config(p: ProviderBody) -> Result<ProviderConfig, Response> {
    let provider = ProviderConfig {
        kind: p.kind,
        wire_api: p.wire_api,
        base_url: p.base_url,
        api_key: p.api_key,
        bearer_token: p.bearer_token,
        azure: p.azure.map(|a| AzureOptions {
            api_version: a.api_version,
        }),
        headers: p.headers,
        model_id: p.model_id,
        wire_model: p.wire_model,
        max_prompt_tokens: token_limit("provider.max_prompt_tokens", p.max_prompt_tokens)?,
        max_output_tokens: token_limit("provider.max_output_tokens", p.max_output_tokens)?,
        max_context_window_tokens: token_limit(
            "provider.max_context_window_tokens",
            p.max_context_window_tokens,
        )?,
    };
    // The library's checks: a Rust embedder gets the same errors.
    crate::pool::validate_provider(&provider).map_err(|e| pool_error(&e))?;
    Ok(provider)
}

/// A token limit of a provider body: a whole number (the library checks its range), else a
/// 400 naming the field.
fn token_limit(field: &str, value: Option<Value>) -> Result<Option<u64>, Response> {
    let Some(value) = value else {
        return Ok(None);
    };
    match value.as_u64() {
        Some(limit) => {
            crate::provider::check_token_limit(field, limit)
                .map_err(|e| error(StatusCode::BAD_REQUEST, "bad_request", e.to_string()))?;
            Ok(Some(limit))
        }
        None => Err(error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!(
                "{field} must be a whole number of tokens from 1 to {} (it is {})",
                crate::provider::MAX_TOKEN_LIMIT,
                match &value {
                    Value::Number(n) => n.to_string(),
                    other => crate::session_options::json_type(other).to_owned(),
                }
            ),
        )),
    }
}

/// The agent's working directory (the library's layout, beside its home).
fn work_dir(state: &AppState, agent_id: &str) -> Result<PathBuf, Response> {
    crate::home::work_dir(&state.pool.config().agents_base_dir, agent_id)
        .map_err(|e| error(StatusCode::BAD_REQUEST, "bad_request", e.to_string()))
}

/// Creates the agent's working directory, mode 0700. Called only for a request that passed
/// authentication and validation and is about to run a turn.
pub(super) async fn create_work_dir(work: &Path) -> Result<(), Response> {
    // Two mkdirs and three stats of a directory that exists after the agent's first turn:
    // done here, as the lease's home is, where a hop to the blocking threads cost the turn
    // two context switches.
    crate::home::create_work_dir(work)
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, "io", e.to_string()))
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
    if !crate::confine::names_directories(options.fields()) {
        return Ok(options);
    }
    let roots =
        crate::home::conversation_roots(work.to_path_buf(), &state.config.allowed_work_roots);
    // Resolving paths is file work: off the async threads.
    let confined = tokio::task::spawn_blocking(move || confine_directories(options, &roots))
        .await
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    confined.map_err(bad)
}

/// Replaces every directory the options name by its resolved path, refusing any outside
/// `roots` ([`crate::confine::confine_session_directories`]).
fn confine_directories(
    mut options: SessionOptions,
    roots: &[PathBuf],
) -> Result<SessionOptions, String> {
    crate::confine::confine_session_directories(options.fields_mut(), "session.", roots)
        .map_err(|e| e.to_string())?;
    Ok(options)
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

/// A conversation's agent id and session key checked as the library checks them (a Rust
/// embedder gets the same errors), and its session key not an SDK session's: a 400 naming
/// the field.
pub(super) fn check_conversation(agent_id: &str, session_key: &str) -> Result<(), Response> {
    crate::pool::validate_session_key(session_key).map_err(|e| pool_error(&e))?;
    refuse_sdk_session(session_key)?;
    crate::home::validate_agent_id(agent_id).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("agent_id: {e}"),
        )
    })
}

/// The lease request for a conversation; the working directory is the agent's own unless
/// its `session` names another one (not created here: compact and reset must not create it).
pub(super) async fn lease_request(
    state: &AppState,
    agent_id: &str,
    session_key: &str,
    conv: ConversationBody,
) -> Result<LeaseRequest, Response> {
    let (mut req, options) = place_request(state, agent_id, session_key, conv.session).await?;
    req.auth = lease_auth(
        conv.auth.unwrap_or_default(),
        state.config.env_tokens.clone(),
        !state.config.allow_logged_in_user,
    );
    req.model = conv.model;
    req.provider = conv.provider.map(provider_config).transpose()?;
    if let Some(provider) = &req.provider {
        // The model guard's rules, with the pool's allow_private_endpoints (never the request's).
        state
            .pool
            .check_provider(provider)
            .map_err(|e| pool_error(&e))?;
    }
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
    req.handlers.max_unread_event_bytes = state.config.max_unread_event_bytes;
    req.handlers.transcript = state.config.transcript.clone();
    Ok(req)
}

/// Where a conversation lives, without credentials: its agent and session key checked, its
/// working directory (the agent's, made on demand by a turn) and the options `session`
/// carries, checked but not applied. [`lease_request`] goes on from here; deleting a CLI
/// backend's conversation needs no more ([`ConversationBody::place`]).
async fn place_request(
    state: &AppState,
    agent_id: &str,
    session_key: &str,
    session: Option<Value>,
) -> Result<(LeaseRequest, Option<SessionOptions>), Response> {
    check_conversation(agent_id, session_key)?;
    let work = work_dir(state, agent_id)?;
    let options = match session {
        Some(session) => Some(session_options(state, &work, session).await?),
        None => None,
    };
    Ok((LeaseRequest::new(agent_id, session_key, work), options))
}

impl ConversationBody {
    /// Whether the body names no credentials (no `auth`, no `provider`): a reset of the
    /// conversation then goes by its name alone ([`crate::pool::Pool::lease_to_delete`]),
    /// which needs none, whatever the daemon's own fallbacks would give a turn; one that
    /// carries them leases the conversation with them, as its turns do.
    pub(super) fn names_no_credentials(&self) -> bool {
        self.auth.is_none() && self.provider.is_none()
    }

    /// The conversation's place alone (see [`place_request`]), its options applied: the
    /// credentials, model and provider are not looked at.
    pub(super) async fn place(
        self,
        state: &AppState,
        agent_id: &str,
        session_key: &str,
    ) -> Result<LeaseRequest, Response> {
        let (mut req, options) = place_request(state, agent_id, session_key, self.session).await?;
        if let Some(options) = options {
            req.apply_session_options(options)
                .map_err(|e| pool_error(&e))?;
        }
        Ok(req)
    }
}

/// The fuzzer's entry (`crate::fuzzing::http_body`): `data` parsed as each request body and
/// put through every check that needs no pool. Paths are confined to a root that does not
/// exist, so nothing on the machine is touched.
pub(crate) fn fuzz_request_bodies(data: &[u8]) {
    let body = Bytes::copy_from_slice(data);
    let root = PathBuf::from("/nonexistent/copilot-pool-fuzz/work");
    if let Ok(mut turn) = parse::<TurnBody>(&body) {
        let _ = super::turns::check_tools(&turn.tools);
        let _ = crate::pool::validate_session_key(&turn.session_key);
        let _ = refuse_sdk_session(&turn.session_key);
        let _ = crate::home::validate_agent_id(&turn.agent_id);
        let attachments = std::mem::take(&mut turn.attachments);
        let limits = super::attachments::AttachmentLimits::default();
        let _ = super::attachments::check(attachments, &root, &[], &limits);
        fuzz_conversation(turn.take_conversation(), &root);
    }
    if let Ok(compact) = optional_body::<CompactBody>(&body) {
        let (_, conversation) = compact.into_parts();
        fuzz_conversation(conversation, &root);
    }
    if let Ok(conversation) = optional_body::<ConversationBody>(&body) {
        fuzz_conversation(conversation, &root);
    }
}

/// A body's `auth` as the lease's credentials, with the daemon's environment tokens and
/// whether the logged-in user is refused.
fn lease_auth(
    auth: AuthBody,
    env: BTreeMap<String, Secret>,
    forbid_logged_in_user: bool,
) -> LeaseAuth {
    LeaseAuth {
        use_logged_in_user: auth.use_logged_in_user,
        github_token: auth.github_token,
        profile_id: auth.profile_id,
        profile_version: auth.profile_version,
        resolved_api_key: auth.resolved_token,
        auth_profile_id: auth.auth_profile_id,
        env,
        forbid_logged_in_user,
    }
}

fn fuzz_conversation(conv: ConversationBody, root: &Path) {
    let provider = conv.provider.and_then(|p| provider_config(p).ok());
    if let Some(session) = conv.session
        && let Ok(options) = SessionOptions::from_value(session)
    {
        let _ = options.check_mcp_servers(false);
        let _ = confine_directories(options, &[root.to_path_buf()]);
    }
    let auth = lease_auth(conv.auth.unwrap_or_default(), BTreeMap::new(), true);
    let _ = crate::auth::resolve_for_lease(&auth, provider.is_some());
}
