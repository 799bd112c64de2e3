//! Typed params and results of the JSON-RPC methods copilot-pool speaks.
//!
//! Client → server methods implement [`Method`] (name, params, result). Server → client
//! requests have typed params here and are dispatched by the worker. Shapes follow the
//! runtime's shipped `schemas/api.schema.json` where it lists the method (checked by
//! `tests/schema.rs`), and the SDK's hand-written client otherwise (`session.create`,
//! `session.resume`, `session.detach`, …, reference §5.1). Every optional field is skipped when
//! absent, and unknown fields in results are ignored, so newer runtimes do not break us.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::kinds::{AgentMode, ProviderType, ReasoningEffort, SendMode, WireApi};
use crate::secret::Secret;

/// The only protocol version this crate speaks (SDK 1.0.14 accepts 3 only).
pub const PROTOCOL_VERSION: u32 = 3;

/// A client → server method with typed params and result.
pub trait Method {
    /// The JSON-RPC method name.
    const NAME: &'static str;
    /// The params object.
    type Params: Serialize + Send + Sync;
    /// The result.
    type Result: DeserializeOwned + Send;
}

macro_rules! method {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $params:ty, $result:ty) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub enum $ty {}
        impl Method for $ty {
            const NAME: &'static str = $name;
            type Params = $params;
            type Result = $result;
        }
    };
}

/// Params of a method that takes none (sent as `{}`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Empty {}

// ---------------------------------------------------------------------------------------------
// Handshake and liveness.

method!(
    /// `connect`: the handshake; the result carries the protocol version.
    Connect, "connect", ConnectParams, ConnectResult
);
method!(
    /// `ping`: liveness.
    Ping, "ping", PingParams, PingResult
);
method!(
    /// `status.get`: runtime version and protocol version.
    StatusGet, "status.get", Empty, StatusResult
);
method!(
    /// `auth.getStatus`: whether the process is authenticated.
    AuthGetStatus, "auth.getStatus", Empty, AuthStatus
);
method!(
    /// `llmInference.setProvider`: route every model HTTP request through this connection.
    LlmSetProvider, "llmInference.setProvider", Empty, AnsweredResult
);
method!(
    /// `runtime.shutdown`: ask the runtime to shut down (the launcher waits for stdin EOF).
    RuntimeShutdown, "runtime.shutdown", Empty, Value
);

/// Params of `connect`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectParams {
    /// Connection token (TCP mode only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<Secret>,
    /// Task kinds this client supports (`agent`, `client`, `shell`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub supported_task_kinds: Option<Vec<String>>,
    /// Who we are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_info: Option<ClientInfo>,
}

/// `clientInfo` of `connect`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientInfo {
    /// Integration name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extension_name: Option<String>,
    /// Integration version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extension_version: Option<String>,
}

/// Result of `connect`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectResult {
    /// Always true on success.
    pub ok: bool,
    /// The server's protocol version; must equal [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The runtime's version string, e.g. `1.0.85`.
    pub version: String,
    /// Task kinds the server accepted.
    #[serde(default)]
    pub task_kinds: Option<Vec<String>>,
}

/// Params of `ping`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PingParams {
    /// Echoed back as `pong: <message>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Result of `ping`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PingResult {
    /// `pong: <message>`.
    pub message: String,
    /// Server time (epoch ms).
    #[serde(default)]
    pub timestamp: Option<Value>,
    /// The server's protocol version.
    #[serde(default)]
    pub protocol_version: Option<u32>,
}

/// Result of `status.get`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusResult {
    /// Runtime version.
    pub version: String,
    /// Protocol version.
    pub protocol_version: u32,
}

/// Result of `auth.getStatus`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthStatus {
    /// Whether the process holds usable GitHub credentials.
    pub is_authenticated: bool,
    /// `user`, `env`, `gh-cli`, `hmac`, `api-key` or `token`.
    #[serde(default)]
    pub auth_type: Option<String>,
    /// GitHub host.
    #[serde(default)]
    pub host: Option<String>,
    /// GitHub login.
    #[serde(default)]
    pub login: Option<String>,
    /// Human-readable status.
    #[serde(default)]
    pub status_message: Option<String>,
}

/// `{success, error?}`, the result of many session methods.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SuccessResult {
    /// Whether the operation succeeded.
    pub success: bool,
    /// Why not, when it did not.
    #[serde(default)]
    pub error: Option<String>,
}

/// `{success}` without an error text (answers to pending requests, `setProvider`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AnsweredResult {
    /// Whether the runtime took the answer.
    pub success: bool,
}

// ---------------------------------------------------------------------------------------------
// Sessions.

method!(
    /// `session.create`: a new conversation.
    SessionCreate, "session.create", SessionConfig, SessionOpened
);
method!(
    /// `session.resume`: attach a stored conversation to this process.
    SessionResume, "session.resume", SessionConfig, SessionOpened
);
method!(
    /// `session.send`: start a turn; returns at once, the turn runs asynchronously.
    SessionSend, "session.send", SendParams, SendResult
);
method!(
    /// `session.abort`: stop the running turn (also releases unanswered tool calls).
    SessionAbort, "session.abort", AbortParams, SuccessResult
);
method!(
    /// `session.detach`: free the in-memory session; its state stays on disk.
    SessionDetach, "session.detach", SessionIdParams, SuccessResult
);
method!(
    /// `session.delete`: remove the session from disk.
    SessionDelete, "session.delete", SessionIdParams, SuccessResult
);
method!(
    /// `session.list`: sessions stored under this process's home.
    SessionList, "session.list", SessionListParams, SessionListResult
);
method!(
    /// `session.getLastId`: the most recently used session.
    SessionGetLastId, "session.getLastId", Empty, LastIdResult
);
method!(
    /// `session.getMessages`: the persisted events of a session.
    SessionGetMessages, "session.getMessages", SessionIdParams, MessagesResult
);
method!(
    /// `session.history.compact`: summarise the conversation to free context.
    SessionCompact, "session.history.compact", CompactParams, CompactResult
);
method!(
    /// `session.tools.handlePendingToolCall`: answer an `external_tool.requested` event.
    HandlePendingToolCall, "session.tools.handlePendingToolCall", ToolCallAnswer, AnsweredResult
);
method!(
    /// `session.permissions.handlePendingPermissionRequest`: answer a `permission.requested` event.
    HandlePendingPermission,
    "session.permissions.handlePendingPermissionRequest",
    PermissionAnswer,
    AnsweredResult
);

/// The BYOK provider of a session (`provider` in `session.create`/`session.resume`), with
/// the runtime's field names (`ProviderConfig` of the pinned package's `api.schema.json`;
/// `tests/schema.rs` checks them). The runtime does not persist it: it must be sent again on
/// every resume. `Debug` shows no secret: keys are `Secret`s and custom header values are
/// redacted. The shapes it takes (OpenAI chat completions or responses, Azure OpenAI,
/// Anthropic messages, OpenAI-compatible local servers) and their checks are
/// [`crate::provider`]'s.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderConfig {
    /// `openai` (the runtime's default), `azure` or `anthropic`.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<ProviderType>,
    /// `completions` (the runtime's default) or `responses`; openai and azure only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wire_api: Option<WireApi>,
    /// Base URL of the endpoint, e.g. `https://api.openai.com/v1`,
    /// `https://<resource>.openai.azure.com`, `https://api.anthropic.com`.
    pub base_url: String,
    /// API key: `Authorization: Bearer` for openai, `api-key` for azure, `x-api-key` for
    /// anthropic. Optional for local servers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<Secret>,
    /// Bearer token, sent as `Authorization: Bearer` (wins over the API key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bearer_token: Option<Secret>,
    /// Azure options (type azure only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub azure: Option<AzureOptions>,
    /// Extra headers sent with every model request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
    /// The well-known model id the runtime looks up behaviour and default limits by (falls
    /// back to the session's model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,
    /// The model name sent to the provider (an Azure deployment, a local model tag); falls
    /// back to `model_id`, then the session's model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wire_model: Option<String>,
    /// Prompt tokens at most (the runtime compacts before it would send more).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_prompt_tokens: Option<u64>,
    /// Output tokens at most per model call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// The model's context window in tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_context_window_tokens: Option<u64>,
}

/// `provider.azure`: Azure OpenAI options.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AzureOptions {
    /// The API version (`api-version`): with it the runtime calls the versioned deployment
    /// route, without it the GA versionless `/openai/v1` route.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
}

impl std::fmt::Debug for ProviderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderConfig")
            .field("kind", &self.kind)
            .field("wire_api", &self.wire_api)
            .field("base_url", &crate::secret::RedactedUrl(&self.base_url))
            .field("api_key", &self.api_key)
            .field("bearer_token", &self.bearer_token)
            .field("azure", &self.azure)
            .field(
                "headers",
                &self.headers.as_ref().map(|h| h.keys().collect::<Vec<_>>()),
            )
            .field("model_id", &self.model_id)
            .field("wire_model", &self.wire_model)
            .field("max_prompt_tokens", &self.max_prompt_tokens)
            .field("max_output_tokens", &self.max_output_tokens)
            .field("max_context_window_tokens", &self.max_context_window_tokens)
            .finish()
    }
}

impl ProviderConfig {
    /// An OpenAI chat-completions provider at `base_url`.
    pub fn openai(base_url: impl Into<String>, api_key: Option<Secret>) -> Self {
        Self {
            kind: Some(ProviderType::OpenAi),
            wire_api: Some(WireApi::Completions),
            base_url: base_url.into(),
            api_key,
            ..Self::default()
        }
    }

    /// An OpenAI responses-API provider at `base_url`.
    pub fn openai_responses(base_url: impl Into<String>, api_key: Option<Secret>) -> Self {
        Self {
            wire_api: Some(WireApi::Responses),
            ..Self::openai(base_url, api_key)
        }
    }

    /// An Azure OpenAI provider: `base_url` is the resource (`https://<name>.openai.azure.com`),
    /// `deployment` the wire model; with `api_version` the runtime calls the versioned
    /// deployment route.
    pub fn azure(
        base_url: impl Into<String>,
        api_key: Option<Secret>,
        deployment: impl Into<String>,
        api_version: Option<String>,
    ) -> Self {
        Self {
            kind: Some(ProviderType::Azure),
            wire_api: Some(WireApi::Completions),
            base_url: base_url.into(),
            api_key,
            azure: api_version.map(|v| AzureOptions {
                api_version: Some(v),
            }),
            wire_model: Some(deployment.into()),
            ..Self::default()
        }
    }

    /// An Anthropic messages provider at `base_url` (`https://api.anthropic.com`).
    pub fn anthropic(base_url: impl Into<String>, api_key: Option<Secret>) -> Self {
        Self {
            kind: Some(ProviderType::Anthropic),
            base_url: base_url.into(),
            api_key,
            ..Self::default()
        }
    }

    /// An OpenAI-compatible local server (ollama, vLLM, llama.cpp's `llama-server`) at
    /// `base_url` (e.g. `http://127.0.0.1:11434/v1`), serving `wire_model`, without a key.
    pub fn openai_compatible(base_url: impl Into<String>, wire_model: impl Into<String>) -> Self {
        Self {
            wire_model: Some(wire_model.into()),
            ..Self::openai(base_url, None)
        }
    }

    /// The provider type the runtime uses (`openai` when unset).
    pub fn kind_or_default(&self) -> ProviderType {
        self.kind.unwrap_or(ProviderType::OpenAi)
    }

    /// The wire API the runtime uses for openai and azure (`completions` when unset);
    /// `None` for anthropic, which has one.
    pub fn wire_api_or_default(&self) -> Option<WireApi> {
        match self.kind_or_default() {
            ProviderType::Anthropic => None,
            ProviderType::OpenAi | ProviderType::Azure => {
                Some(self.wire_api.unwrap_or(WireApi::Completions))
            }
        }
    }
}

/// A client tool the model may call; answered through `handlePendingToolCall`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolDefinition {
    /// Tool name (must not collide with a built-in unless `overrides_built_in_tool`).
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// JSON schema of the arguments.
    pub parameters: Value,
    /// Run without a permission prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skip_permission: Option<bool>,
    /// Replace the built-in tool of the same name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overrides_built_in_tool: Option<bool>,
}

/// Params of `session.create` and `session.resume` (the SDK's `SessionConfig` on the wire).
/// Fields this crate does not model go in `extra` and are sent as they are. `Debug` shows
/// the names of the `extra` fields, not their values (a client's config may carry keys in
/// any of them).
#[derive(Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionConfig {
    /// The session id (we always choose it, so events can be routed before the reply).
    pub session_id: String,
    /// Model id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// How hard the model thinks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Client name stored with the session.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_name: Option<String>,
    /// BYOK provider (needed on create and on every resume).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<ProviderConfig>,
    /// Per-session GitHub identity.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub git_hub_token: Option<Secret>,
    /// Client tools.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolDefinition>,
    /// Allow-list of tools (`custom:*`, `builtin:bash`, names).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub available_tools: Option<Vec<String>>,
    /// Deny-list of tools.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub excluded_tools: Option<Vec<String>>,
    /// `excluded` (what the SDK always sends).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_filter_precedence: Option<String>,
    /// Ask the client for permissions (`permission.requested` events) instead of denying.
    pub request_permission: bool,
    /// Let the model ask the user (`userInput.request`).
    pub request_user_input: bool,
    /// Send `hooks.invoke` requests.
    pub hooks: bool,
    /// Stream deltas.
    pub streaming: bool,
    /// The session's working directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub working_directory: Option<String>,
    /// System message (`{mode:"append"|"replace", content}` …).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_message: Option<Value>,
    /// `direct` (what the SDK always sends).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub env_value_mode: Option<String>,
    /// Resume only: do not continue work that was pending when the session was detached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continue_pending_work: Option<bool>,
    /// Anything else, sent as is.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl std::fmt::Debug for SessionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionConfig")
            .field("session_id", &self.session_id)
            .field("model", &self.model)
            .field("reasoning_effort", &self.reasoning_effort)
            .field("provider", &self.provider)
            .field("git_hub_token", &self.git_hub_token)
            .field(
                "tools",
                &self.tools.iter().map(|t| &t.name).collect::<Vec<_>>(),
            )
            .field("request_permission", &self.request_permission)
            .field("request_user_input", &self.request_user_input)
            .field("hooks", &self.hooks)
            .field("streaming", &self.streaming)
            .field("working_directory", &self.working_directory)
            .field("extra", &self.extra.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Result of `session.create` / `session.resume`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionOpened {
    /// The session id.
    pub session_id: String,
    /// Where the session's state lives on disk.
    #[serde(default)]
    pub workspace_path: Option<String>,
    /// `interactive`, …
    #[serde(default)]
    pub mode: Option<String>,
    /// Everything else the runtime answered (`capabilities`, `modelState`, …), kept so the
    /// answer can be passed on whole.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Params of `session.send`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendParams {
    /// Target session.
    pub session_id: String,
    /// The user message.
    pub prompt: String,
    /// Files, directories and inline blobs sent with the message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<Attachment>,
    /// `enqueue` (the runtime's default) or `immediate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<SendMode>,
    /// The agent mode of the message (default: the session's current mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_mode: Option<AgentMode>,
}

/// One attachment of `session.send` (the schema's `Attachment`, the variants this crate
/// sends).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum Attachment {
    /// A file by absolute path; the runtime reads it (an image goes to the model as one).
    #[serde(rename_all = "camelCase")]
    File {
        /// Absolute path.
        path: String,
        /// The name shown for it.
        display_name: String,
        /// Only these lines of it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        line_range: Option<LineRange>,
    },
    /// A directory by absolute path.
    #[serde(rename_all = "camelCase")]
    Directory {
        /// Absolute path.
        path: String,
        /// The name shown for it.
        display_name: String,
    },
    /// Inline content.
    #[serde(rename_all = "camelCase")]
    Blob {
        /// The content, base64.
        data: String,
        /// Its media type.
        mime_type: String,
        /// The name shown for it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        display_name: Option<String>,
    },
}

/// Lines `start..=end` of a file attachment (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
pub struct LineRange {
    /// First line (1-based).
    pub start: u32,
    /// Last line (inclusive).
    pub end: u32,
}

/// Result of `session.send`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendResult {
    /// Id of the user message.
    pub message_id: String,
}

/// Params of `session.abort`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AbortParams {
    /// Target session.
    pub session_id: String,
    /// Why: echoed in the turn's `abort` event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<AbortReason>,
}

/// The runtime's `AbortReason` (`api.schema.json`): why a turn was aborted, echoed in its
/// `abort` event's `reason`. The SDKs read it as this enum (the Python SDK drops an event
/// with another value, printing an exception), so the pool sends only these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AbortReason {
    /// The session's user aborted it.
    UserInitiated,
    /// A command from outside the session: the pool's, for a gateway's abort or a drain.
    RemoteCommand,
    /// The user aborted it (the runtime's other spelling).
    UserAbort,
    /// Autopilot ran out of credit.
    AutopilotCreditLimit,
}

impl AbortReason {
    /// Every value, in the schema's order.
    pub const ALL: [AbortReason; 4] = [
        AbortReason::UserInitiated,
        AbortReason::RemoteCommand,
        AbortReason::UserAbort,
        AbortReason::AutopilotCreditLimit,
    ];
}

/// `{sessionId}`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionIdParams {
    /// Target session.
    pub session_id: String,
}

/// Params of `session.list`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SessionListParams {
    /// `{cwd?, gitRoot?, repository?, branch?}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<Value>,
}

/// Result of `session.list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionListResult {
    /// Stored sessions.
    pub sessions: Vec<SessionSummary>,
}

/// One entry of `session.list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionSummary {
    /// Session id.
    pub session_id: String,
    /// Whether it is detached from every process.
    #[serde(default)]
    pub is_detached: Option<bool>,
    /// Summary text.
    #[serde(default)]
    pub summary: Option<String>,
    /// Creation time.
    #[serde(default)]
    pub start_time: Option<Value>,
    /// Last modification.
    #[serde(default)]
    pub modified_time: Option<Value>,
}

/// Result of `session.getLastId`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastIdResult {
    /// The id, if any session exists.
    #[serde(default)]
    pub session_id: Option<String>,
}

/// Result of `session.getMessages`: persisted events, kept raw.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessagesResult {
    /// The events as stored.
    pub events: Vec<Value>,
}

/// Params of `session.history.compact`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CompactParams {
    /// Target session.
    pub session_id: String,
    /// Focus for the summary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub custom_instructions: Option<String>,
}

/// Result of `session.history.compact`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CompactResult {
    /// Whether compaction ran.
    pub success: bool,
    /// Tokens freed; negative when the summary is longer than what it replaced (a short
    /// history).
    #[serde(default)]
    pub tokens_removed: Option<i64>,
    /// Messages folded into the summary.
    #[serde(default)]
    pub messages_removed: Option<u64>,
    /// The summary.
    #[serde(default)]
    pub summary_content: Option<String>,
}

/// Params of `session.tools.handlePendingToolCall`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCallAnswer {
    /// The session the tool call belongs to.
    pub session_id: String,
    /// `requestId` of the `external_tool.requested` event.
    pub request_id: String,
    /// A string, or `{textResultForLlm, resultType, …}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Failure message instead of a result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Params of `session.permissions.handlePendingPermissionRequest`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PermissionAnswer {
    /// The session the request belongs to.
    pub session_id: String,
    /// `requestId` of the `permission.requested` event.
    pub request_id: String,
    /// A decision, e.g. `{"kind":"approve-once"}` or `{"kind":"reject"}`.
    pub result: Value,
}

// ---------------------------------------------------------------------------------------------
// Server → client requests.

/// Params of `userInput.request` (the `ask_user` tool).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UserInputRequest {
    /// The asking session.
    pub session_id: String,
    /// The question.
    pub question: String,
    /// Offered answers.
    #[serde(default)]
    pub choices: Option<Vec<String>>,
    /// Whether a free-form answer is allowed.
    #[serde(default)]
    pub allow_freeform: Option<bool>,
}

/// Result of `userInput.request`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UserInputResponse {
    /// The answer.
    pub answer: String,
    /// Whether it was typed rather than chosen.
    pub was_freeform: bool,
}

/// Params of `hooks.invoke`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HookInvocation {
    /// The session.
    pub session_id: String,
    /// `sessionStart`, `preToolUse`, `agentStop`, …
    pub hook_type: String,
    /// Hook-specific input.
    #[serde(default)]
    pub input: Value,
}

/// Params of `llmInference.httpRequestStart`. `Debug` redacts credential headers.
#[derive(Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRequestStart {
    /// Correlates the chunks and the response.
    pub request_id: String,
    /// HTTP method.
    pub method: String,
    /// The URL the runtime would have called.
    pub url: String,
    /// Headers, several values per name.
    #[serde(default)]
    pub headers: BTreeMap<String, Vec<String>>,
    /// The calling session.
    #[serde(default)]
    pub session_id: Option<String>,
}

impl std::fmt::Debug for HttpRequestStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpRequestStart")
            .field("request_id", &self.request_id)
            .field("method", &self.method)
            .field("url", &self.url)
            .field("headers", &crate::secret::RedactedHeaders(&self.headers))
            .field("session_id", &self.session_id)
            .finish()
    }
}

/// Params of `llmInference.httpRequestChunk`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRequestChunk {
    /// The request.
    pub request_id: String,
    /// Body bytes (text).
    #[serde(default)]
    pub data: String,
    /// Whether `data` is base64.
    #[serde(default)]
    pub binary: Option<bool>,
    /// Last chunk.
    #[serde(default)]
    pub end: Option<bool>,
    /// The runtime gave up on the request.
    #[serde(default)]
    pub cancel: Option<bool>,
}

method!(
    /// `llmInference.httpResponseStart`: the status and headers of a tunnelled response.
    HttpResponseStart, "llmInference.httpResponseStart", HttpResponseStartParams, AcceptedResult
);
method!(
    /// `llmInference.httpResponseChunk`: a piece of a tunnelled response body.
    HttpResponseChunk, "llmInference.httpResponseChunk", HttpResponseChunkParams, AcceptedResult
);

/// Params of `llmInference.httpResponseStart`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpResponseStartParams {
    /// The request being answered.
    pub request_id: String,
    /// HTTP status.
    pub status: u16,
    /// Headers, several values per name.
    pub headers: BTreeMap<String, Vec<String>>,
}

/// Params of `llmInference.httpResponseChunk`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpResponseChunkParams {
    /// The request being answered.
    pub request_id: String,
    /// Body text.
    pub data: String,
    /// Last chunk.
    pub end: bool,
    /// The body broke off with this error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `{accepted}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AcceptedResult {
    /// Whether the runtime took the frame.
    pub accepted: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_config_puts_extra_fields_and_secrets_on_the_wire() {
        let mut extra = Map::new();
        extra.insert(
            "infiniteSessions".into(),
            serde_json::json!({"enabled": true}),
        );
        let config = SessionConfig {
            session_id: "s1".into(),
            model: Some("m".into()),
            reasoning_effort: Some(ReasoningEffort::XHigh),
            provider: Some(ProviderConfig::openai(
                "http://127.0.0.1:1/v1",
                Some("key-1".into()),
            )),
            extra,
            ..Default::default()
        };
        let wire = serde_json::to_value(&config).unwrap();
        assert_eq!(wire["sessionId"], "s1");
        assert_eq!(wire["provider"]["apiKey"], "key-1");
        assert_eq!(wire["provider"]["type"], "openai");
        assert_eq!(wire["provider"]["wireApi"], "completions");
        assert_eq!(wire["reasoningEffort"], "xhigh");
        assert_eq!(wire["infiniteSessions"]["enabled"], true);
        assert_eq!(wire["requestPermission"], false);
        assert!(wire.get("gitHubToken").is_none());
        assert!(!format!("{config:?}").contains("key-1"));
        let mut provider = ProviderConfig::openai("http://h/v1", None);
        provider.headers = Some([("X-Tenant-Token".to_owned(), "tt-secret".to_owned())].into());
        assert!(!format!("{provider:?}").contains("tt-secret"));
        let start: HttpRequestStart = serde_json::from_value(serde_json::json!({
            "requestId": "r", "method": "POST", "url": "http://h/v1/chat/completions",
            "headers": {"authorization": ["Bearer sk-secret"], "accept": ["*/*"]}
        }))
        .unwrap();
        let text = format!("{start:?}");
        assert!(
            !text.contains("sk-secret") && text.contains("*/*"),
            "{text}"
        );
    }
}
