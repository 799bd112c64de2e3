//! The MCP bridge (issue 17, item 9): a turn's gateway tools served to a CLI backend (Claude
//! Code, Codex) by a loopback MCP server, so a Claude or Codex turn calls the same gateway
//! tools, answered by the same [`ToolHandler`](crate::turn::ToolHandler)s, as a Copilot turn.
//!
//! Owns that server: MCP streamable HTTP (the official SDK, `rmcp`, stateless with JSON
//! responses) on `127.0.0.1` at an ephemeral port, path `/mcp`, and the per-backend settings
//! that point a CLI at it ([`McpBridge::claude_args`], [`McpBridge::codex_overrides`]).
//!
//! Invariants:
//! * every request must carry `Authorization: Bearer <token>`, a random per-run token held as
//!   a [`Secret`]; any other request gets 401 and does not count as activity. The token is
//!   never logged and never put in argv: the CLIs read it from their environment;
//! * `tools/list` lists exactly the [`GatewayTool`]s the bridge was started with (name,
//!   description, `inputSchema` = the tool's JSON schema), for the bridge's whole life (a CLI
//!   reads the list once); `tools/call` runs the handler of the tool in the **installed
//!   table** with the tool's timeout (else the bridge's), sequential tools one at a time as in
//!   a Copilot turn; a handler error, an unknown tool, a timeout or a panic is an `isError`
//!   result, never a protocol error or a panic of the server;
//! * the installed table is swappable: a pool lease installs its own handlers for the same
//!   listed tools ([`McpBridge::install`], refused when names, descriptions or schemas differ:
//!   the CLI would be offered a stale list), and takes them out when it ends
//!   ([`McpBridge::uninstall`]); a call that arrives while none are installed is an `isError`
//!   result at once, never a wait;
//! * with [`McpBridgeConfig::calls_need_approval`] (a conversation whose tools are asked
//!   about), a call runs only once its tool and arguments were approved
//!   ([`McpBridge::approve`], by the CLI's permission prompt), one call per approval: the
//!   token is in the CLI's environment, which its shell tools inherit, so the bridge cannot
//!   rely on the CLI having asked;
//! * the server stops by itself after `idle_ttl` without an authenticated request while no
//!   call is running, and when the [`McpBridge`] handle is dropped.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{NotificationContext, RequestContext};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Value, json};
use tokio::sync::{RwLock, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::metrics::{self, ToolOutcome};
use crate::panic_guard::call_guarded;
use crate::secret::Secret;
use crate::turn::{GatewayTool, ToolCall, ToolConcurrency};

/// The MCP server name the CLIs see (tools appear to Claude as `mcp__gateway__<tool>`).
pub const DEFAULT_SERVER_NAME: &str = "gateway";
/// The environment variable that carries the bearer token to the CLI.
pub const TOKEN_ENV: &str = "COPILOT_POOL_MCP_TOKEN";
/// Default idle TTL (the reference's `mcp.sessionIdleTtlMs`, 10 minutes).
pub const DEFAULT_IDLE_TTL: Duration = Duration::from_secs(600);
/// Default per-call limit when a tool has none (a Copilot turn's default tool timeout).
pub const DEFAULT_TOOL_TIMEOUT: Duration = Duration::from_secs(600);
/// The path of the MCP endpoint.
const MCP_PATH: &str = "/mcp";

/// How to run a bridge.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct McpBridgeConfig {
    /// The MCP server name in the CLI's config: letters, digits, `_` and `-`.
    pub server_name: String,
    /// The server stops after this long without an authenticated request (none running).
    pub idle_ttl: Duration,
    /// The limit of a call whose tool sets no timeout of its own.
    pub tool_timeout: Duration,
    /// The conversation's working directory, passed to each [`ToolCall`].
    pub working_directory: Option<String>,
    /// The bridge's connections: the agent's own processes can reach its port (the CLI's
    /// sandbox opens it), so their number and how long one may sit without a request are
    /// bounded (default: 64 connections, each tool call in progress holding one; a request
    /// head within 10 s; closed after 60 s without a byte either way; a call in progress is
    /// never cut). A library setting: `copilot-pool serve` uses the default.
    pub connections: crate::listener::ConnectionLimits,
    /// True: a call runs only once the conversation's permission policy approved that very
    /// call, its tool and its arguments ([`McpBridge::approve`], from the CLI's permission
    /// prompt), each approval good for one call. Any other call is an `isError` result: one
    /// a process of the agent's made with the token from the CLI's environment (its shell
    /// tools inherit it), or one its CLI cannot ask about (`codex exec`). False (default):
    /// every call runs, as a Copilot turn runs gateway tools with `skipPermission`.
    pub calls_need_approval: bool,
}

/// The bridge's default connection limits: a CLI makes a few connections at most.
fn default_connections() -> crate::listener::ConnectionLimits {
    crate::listener::ConnectionLimits {
        header_read_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(60),
        max_connections: 64,
        setting: "McpBridgeConfig::connections (the MCP bridge's cap, a library setting; \
                  `copilot-pool serve` keeps its default of 64)",
    }
}

impl Default for McpBridgeConfig {
    fn default() -> Self {
        Self {
            server_name: DEFAULT_SERVER_NAME.to_owned(),
            idle_ttl: DEFAULT_IDLE_TTL,
            tool_timeout: DEFAULT_TOOL_TIMEOUT,
            working_directory: None,
            connections: default_connections(),
            calls_need_approval: false,
        }
    }
}

/// Why a bridge could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum McpBridgeError {
    /// The server name is not usable in a CLI's config.
    #[error(
        "MCP server name {0:?} is not valid: use 1 to 64 ASCII letters, digits, `_` or `-` \
         (the default is `gateway`)"
    )]
    ServerName(String),
    /// Two tools share a name.
    #[error("two gateway tools are named {0:?}: tool names must be unique in a conversation")]
    DuplicateTool(String),
    /// A tool's `parameters` is not a JSON object (MCP needs an object schema).
    #[error(
        "gateway tool {0:?} has `parameters` that is not a JSON object: give it a JSON schema \
         object such as {{\"type\":\"object\",\"properties\":{{}}}}"
    )]
    Schema(String),
    /// The tools to install are not the ones the bridge lists (a CLI would see a stale list).
    #[error(
        "the MCP bridge lists other tools than these (names, descriptions or schemas differ): \
         start the CLI again with a new bridge for them"
    )]
    ToolsDiffer,
    /// The loopback port could not be bound.
    #[error("could not listen on 127.0.0.1 for the MCP bridge: {0}; is the loopback interface up?")]
    Bind(#[source] std::io::Error),
}

/// The CLI arguments and environment that point Claude Code at a bridge.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaudeMcpArgs {
    /// `--mcp-config=<json>`, `--strict-mcp-config` and, unless the tools are to be asked
    /// about, `--allowedTools=mcp__<server>__*`.
    pub args: Vec<String>,
    /// `COPILOT_POOL_MCP_TOKEN=<token>` for the child's environment.
    pub env: Vec<(String, Secret)>,
}

/// Resolves when a bridge's server has stopped; see [`McpBridge::stop_signal`].
#[derive(Debug, Clone)]
pub struct StopSignal(watch::Receiver<bool>);

impl StopSignal {
    /// Waits for the stop (returns at once if it already happened).
    pub async fn wait(mut self) {
        // An error means the server task is gone, which is a stop too.
        let _ = self.0.wait_for(|stopped| *stopped).await;
    }
}

/// The handlers that answer calls now, by tool name (`None`: no lease holds the
/// conversation; calls are refused).
type Installed = Option<Arc<HashMap<String, GatewayTool>>>;

/// What is shared between the handle, the HTTP layer and the MCP handler.
struct Shared {
    token: Secret,
    /// The handlers installed now (swapped per lease).
    installed: Mutex<Installed>,
    /// What `tools/list` offers (fixed for the bridge's life), and its signature.
    listed: Vec<Tool>,
    signature: Vec<ToolSignature>,
    config: McpBridgeConfig,
    session_id: Mutex<String>,
    sequential: Arc<RwLock<()>>,
    /// Time of the last authenticated request.
    last_activity: Mutex<Instant>,
    /// Authenticated requests being served now.
    in_flight: AtomicUsize,
    /// The calls approved and not yet made, tool and arguments, oldest first (at most
    /// [`MAX_APPROVALS`]; read with [`McpBridgeConfig::calls_need_approval`]).
    approvals: Mutex<std::collections::VecDeque<(String, Value)>>,
}

/// Approved calls a bridge keeps for their call at most (the oldest goes first).
const MAX_APPROVALS: usize = 64;

/// A running bridge. Dropping it stops the server.
pub struct McpBridge {
    shared: Arc<Shared>,
    addr: SocketAddr,
    cancel: CancellationToken,
    stopped: watch::Receiver<bool>,
}

impl std::fmt::Debug for McpBridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpBridge")
            .field("addr", &self.addr)
            .field("server_name", &self.shared.config.server_name)
            .field("tools", &self.shared.listed.len())
            .field("running", &self.is_running())
            .finish_non_exhaustive()
    }
}

impl Drop for McpBridge {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl McpBridge {
    /// Starts a bridge serving `tools` on a fresh loopback port with a fresh token.
    pub async fn start(
        tools: Vec<GatewayTool>,
        config: McpBridgeConfig,
    ) -> Result<Self, McpBridgeError> {
        let name = &config.server_name;
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(McpBridgeError::ServerName(name.clone()));
        }
        check_tools(&tools)?;
        let signature = signature(&tools);
        let mut listed = Vec::new();
        for tool in &tools {
            if let Value::Object(schema) = &tool.parameters {
                listed.push(Tool::new(
                    tool.name.clone(),
                    tool.description.clone(),
                    Arc::new(schema.clone()),
                ));
            }
        }
        let by_name = table(tools);
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(McpBridgeError::Bind)?;
        let addr = listener.local_addr().map_err(McpBridgeError::Bind)?;
        let shared = Arc::new(Shared {
            token: Secret::new(format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            )),
            installed: Mutex::new(Some(Arc::new(by_name))),
            listed,
            signature,
            config,
            session_id: Mutex::new(String::new()),
            sequential: Arc::new(RwLock::new(())),
            last_activity: Mutex::new(Instant::now()),
            in_flight: AtomicUsize::new(0),
            approvals: Mutex::default(),
        });
        let cancel = CancellationToken::new();
        let handler_shared = shared.clone();
        let service = StreamableHttpService::new(
            move || {
                Ok(Bridge {
                    shared: handler_shared.clone(),
                })
            },
            Arc::new(NeverSessionManager::default()),
            StreamableHttpServerConfig::default()
                .with_legacy_session_mode(false)
                .with_json_response(true)
                .with_sse_keep_alive(None)
                .with_cancellation_token(cancel.child_token()),
        );
        let router = Router::new()
            .nest_service(MCP_PATH, service)
            .layer(middleware::from_fn_with_state(shared.clone(), authenticate));
        let (stopped_tx, stopped) = watch::channel(false);
        let server_cancel = cancel.clone();
        let limits = shared.config.connections;
        tokio::spawn(async move {
            let shutdown = server_cancel.clone().cancelled_owned();
            let serve = crate::listener::serve(listener, router, limits, shutdown);
            tokio::select! {
                () = serve => {}
                // A connection that does not close within a second of the stop is dropped.
                () = async {
                    server_cancel.cancelled().await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                } => {}
            }
            server_cancel.cancel();
            let _ = stopped_tx.send(true);
        });
        tokio::spawn(idle_watch(shared.clone(), cancel.clone()));
        tracing::debug!(%addr, tools = shared.listed.len(), "MCP bridge started");
        Ok(Self {
            shared,
            addr,
            cancel,
            stopped,
        })
    }

    /// `http://127.0.0.1:<port>/mcp`.
    pub fn url(&self) -> String {
        format!("http://{}{MCP_PATH}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bearer token of this run (pass it to the CLI through its environment only).
    pub fn token(&self) -> &Secret {
        &self.shared.token
    }

    /// The MCP server name.
    pub fn server_name(&self) -> &str {
        &self.shared.config.server_name
    }

    /// False once the server has stopped (idle TTL, or [`McpBridge::stop`]).
    pub fn is_running(&self) -> bool {
        !*self.stopped.borrow() && !self.cancel.is_cancelled()
    }

    /// Resolves once the server has stopped accepting requests.
    pub async fn stopped(&self) {
        self.stop_signal().wait().await;
    }

    /// Keeps the bridge from idling out until the hold is dropped: a turn holds its bridge
    /// for its whole life, since its CLI may call a tool at any time (and checks the bridge
    /// still runs after taking the hold: one stopped before it stays stopped).
    pub fn hold(&self) -> BridgeHold {
        BridgeHold::new(self.shared.clone())
    }

    /// A signal of the server's stop that outlives this handle (to see a drop take effect).
    pub fn stop_signal(&self) -> StopSignal {
        StopSignal(self.stopped.clone())
    }

    /// Stops the server (as dropping the handle does).
    pub fn stop(&self) {
        self.cancel.cancel();
    }

    /// Whether `tools` are the ones this bridge lists (names, descriptions, schemas; their
    /// order, handlers, timeouts and concurrency do not count), so [`McpBridge::install`]
    /// takes them.
    pub fn lists(&self, tools: &[GatewayTool]) -> bool {
        signature(tools) == self.shared.signature
    }

    /// Answers calls with `tools`' handlers from now on (a call already running finishes
    /// with the handler it started with). Refused with [`McpBridgeError::ToolsDiffer`] when
    /// they are not the tools the bridge lists ([`McpBridge::lists`]).
    pub fn install(&self, tools: Vec<GatewayTool>) -> Result<(), McpBridgeError> {
        if !self.lists(&tools) {
            return Err(McpBridgeError::ToolsDiffer);
        }
        let table = Arc::new(table(tools));
        if let Ok(mut installed) = self.shared.installed.lock() {
            *installed = Some(table);
        }
        Ok(())
    }

    /// Takes the installed handlers out: until the next [`McpBridge::install`], every call
    /// is an `isError` result at once (no lease holds the conversation to answer it).
    pub fn uninstall(&self) {
        if let Ok(mut installed) = self.shared.installed.lock() {
            *installed = None;
        }
    }

    /// Records that the conversation's permission policy approved one call of `tool` (its
    /// name as the bridge lists it) with `arguments`: with
    /// [`McpBridgeConfig::calls_need_approval`], the next such call runs, once.
    pub fn approve(&self, tool: &str, arguments: &Value) {
        if let Ok(mut approvals) = self.shared.approvals.lock() {
            if approvals.len() == MAX_APPROVALS {
                approvals.pop_front();
            }
            approvals.push_back((tool.to_owned(), arguments.clone()));
        }
    }

    /// Drops the approvals no call used (a turn that ended before its CLI made the call).
    pub fn forget_approvals(&self) {
        if let Ok(mut approvals) = self.shared.approvals.lock() {
            approvals.clear();
        }
    }

    /// The CLI session id that later [`ToolCall`]s carry.
    pub fn set_session_id(&self, session_id: &str) {
        if let Ok(mut id) = self.shared.session_id.lock()
            && *id != session_id
        {
            session_id.clone_into(&mut id);
        }
    }

    /// Claude Code's `--mcp-config` (an `http` server whose `Authorization` header is
    /// `Bearer ${COPILOT_POOL_MCP_TOKEN}`, expanded by Claude from its environment, with
    /// `alwaysLoad` so the tools are in every request rather than behind ToolSearch),
    /// `--strict-mcp-config` (no other MCP server from the agent's home or project), and,
    /// when `allow_without_asking`, `--allowedTools=mcp__<server>__*`: the gateway's tools
    /// are trusted as a Copilot turn trusts them (`skipPermission`); otherwise each call is
    /// a `can_use_tool` request for the conversation's permission policy (whose approval
    /// the bridge then requires, [`McpBridgeConfig::calls_need_approval`]).
    pub fn claude_args(&self, allow_without_asking: bool) -> ClaudeMcpArgs {
        let name = self.server_name();
        let config = json!({
            "mcpServers": {
                name: {
                    "type": "http",
                    "url": self.url(),
                    // Offered to the model directly, as a Copilot turn offers them, not
                    // deferred behind Claude's ToolSearch.
                    "alwaysLoad": true,
                    "headers": {"Authorization": format!("Bearer ${{{TOKEN_ENV}}}")},
                }
            }
        });
        let mut args = vec![
            format!("--mcp-config={config}"),
            "--strict-mcp-config".to_owned(),
        ];
        if allow_without_asking {
            args.push(format!("--allowedTools=mcp__{name}__*"));
        }
        ClaudeMcpArgs {
            args,
            env: vec![(TOKEN_ENV.to_owned(), self.token().clone())],
        }
    }

    /// Codex's `-c` overrides for `mcp_servers.<server>` (`url`,
    /// `bearer_token_env_var = "COPILOT_POOL_MCP_TOKEN"`, so the token stays out of argv, and
    /// `default_tools_approval_mode`), as `["-c", "mcp_servers.gateway.url=\"…\"", "-c", …]`,
    /// with the environment to add. When `allow_without_asking`, the mode is `approve`: the
    /// gateway's tools are trusted as a Copilot turn trusts them; otherwise `prompt`, which
    /// `codex exec` (approval policy `never`) cannot ask, so every call fails closed.
    pub fn codex_overrides(&self, allow_without_asking: bool) -> ClaudeMcpArgs {
        let name = self.server_name();
        let url = Value::String(self.url());
        let env_var = Value::String(TOKEN_ENV.to_owned());
        let mode = if allow_without_asking {
            "approve"
        } else {
            "prompt"
        };
        ClaudeMcpArgs {
            args: vec![
                "-c".to_owned(),
                format!("mcp_servers.{name}.url={url}"),
                "-c".to_owned(),
                format!("mcp_servers.{name}.bearer_token_env_var={env_var}"),
                "-c".to_owned(),
                format!("mcp_servers.{name}.default_tools_approval_mode=\"{mode}\""),
            ],
            env: vec![(TOKEN_ENV.to_owned(), self.token().clone())],
        }
    }
}

/// The gateway tools of a CLI conversation (Claude Code's, Codex's) and how their bridge
/// runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct McpGatewayTools {
    /// The tools; their handlers answer the CLI's calls as they answer a Copilot turn's.
    pub tools: Vec<crate::turn::GatewayTool>,
    /// Server name, idle TTL, default tool timeout.
    pub bridge: McpBridgeConfig,
    /// False (the default): the tools run without asking (Claude:
    /// `--allowedTools=mcp__<server>__*`; Codex: `default_tools_approval_mode = "approve"`),
    /// as a Copilot turn runs gateway tools with `skipPermission`. True: Claude puts each
    /// call to the conversation's permission policy, and the bridge runs only the calls it
    /// approved ([`McpBridgeConfig::calls_need_approval`]); `codex exec` cannot ask, so each
    /// call fails closed.
    pub ask_permission: bool,
}

impl McpGatewayTools {
    /// `tools` on a bridge with the default settings, run without asking.
    pub fn new(tools: Vec<crate::turn::GatewayTool>) -> Self {
        Self {
            tools,
            bridge: McpBridgeConfig::default(),
            ask_permission: false,
        }
    }
}

/// Checks tools as a bridge takes them: each `parameters` a JSON object, no name twice.
pub fn check_tools(tools: &[GatewayTool]) -> Result<(), McpBridgeError> {
    let mut seen = std::collections::HashSet::new();
    for tool in tools {
        if !tool.parameters.is_object() {
            return Err(McpBridgeError::Schema(tool.name.clone()));
        }
        if !seen.insert(tool.name.as_str()) {
            return Err(McpBridgeError::DuplicateTool(tool.name.clone()));
        }
    }
    Ok(())
}

/// The gateway tool's name in a CLI's own report of a call of it through the bridge named
/// [`DEFAULT_SERVER_NAME`]: Claude Code's `mcp__gateway__<tool>`, Codex's `gateway/<tool>`.
/// `None` for any other tool.
pub fn gateway_tool_name(cli_name: &str) -> Option<&str> {
    cli_name
        .strip_prefix("mcp__")
        .and_then(|rest| rest.strip_prefix(DEFAULT_SERVER_NAME))
        .and_then(|rest| rest.strip_prefix("__"))
        .or_else(|| {
            cli_name
                .strip_prefix(DEFAULT_SERVER_NAME)
                .and_then(|rest| rest.strip_prefix('/'))
        })
        .filter(|name| !name.is_empty())
}

/// What a CLI is told of a tool: its name, description and schema.
type ToolSignature = (String, String, Value);

/// The tools as the CLI sees them, in name order.
fn signature(tools: &[GatewayTool]) -> Vec<ToolSignature> {
    let mut listed: Vec<ToolSignature> = tools
        .iter()
        .map(|t| (t.name.clone(), t.description.clone(), t.parameters.clone()))
        .collect();
    listed.sort_by(|a, b| a.0.cmp(&b.0));
    listed
}

fn table(tools: Vec<GatewayTool>) -> HashMap<String, GatewayTool> {
    tools.into_iter().map(|t| (t.name.clone(), t)).collect()
}

/// A lease's `tools` offered to a runner (Claude's live process, a one-shot conversation):
/// installed into its bridge when that runs and lists the same tools (`Some(true)`), refused
/// when it runs with another list (`Some(false)`), `None` when no bridge runs. The runner's
/// `config` keeps `tools` either way, for the bridge it starts next.
pub(crate) fn offer_tools(
    bridge: Option<&McpBridge>,
    config: &mut Option<McpGatewayTools>,
    tools: Vec<GatewayTool>,
) -> Option<bool> {
    let installed = bridge
        .filter(|b| b.is_running())
        .map(|b| b.install(tools.clone()).is_ok());
    match config {
        Some(gateway) => gateway.tools = tools,
        None => *config = Some(McpGatewayTools::new(tools)),
    }
    installed
}

/// A lease's handlers taken out of a runner (the lease ended): a call that arrives before the
/// next [`offer_tools`] is an `isError` result at once. The bridge and its list stay.
pub(crate) fn take_out_handlers(bridge: Option<&McpBridge>, config: &mut Option<McpGatewayTools>) {
    if let Some(bridge) = bridge {
        bridge.uninstall();
    }
    if let Some(gateway) = config {
        gateway.tools.clear();
    }
}

/// Rejects requests without the run's bearer token (401); counts the others as activity.
async fn authenticate(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !constant_time_eq(presented.as_bytes(), shared.token.expose().as_bytes()) {
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            Body::from(
                "the MCP bridge needs `Authorization: Bearer <token>` with this run's token",
            ),
        )
            .into_response();
    }
    // Given back however the request ends: answered, or dropped with its connection.
    let _hold = BridgeHold::new(shared);
    next.run(request).await
}

/// Keeps a bridge from idling out while it lives: the idle TTL counts from its drop
/// ([`McpBridge::hold`]; each request being served holds one too).
#[must_use = "the bridge may idle out as soon as its hold is dropped"]
pub struct BridgeHold {
    shared: Arc<Shared>,
}

impl BridgeHold {
    fn new(shared: Arc<Shared>) -> Self {
        // Under the lock the idle watch decides under: a hold taken before its look keeps
        // the bridge running, one taken after its stop finds the bridge stopped.
        match shared.last_activity.lock() {
            Ok(mut last) => {
                shared.in_flight.fetch_add(1, Ordering::SeqCst);
                *last = Instant::now();
            }
            Err(_) => {
                shared.in_flight.fetch_add(1, Ordering::SeqCst);
            }
        }
        Self { shared }
    }
}

impl Drop for BridgeHold {
    fn drop(&mut self) {
        touch(&self.shared);
        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for BridgeHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BridgeHold").finish_non_exhaustive()
    }
}

fn touch(shared: &Shared) {
    if let Ok(mut last) = shared.last_activity.lock() {
        *last = Instant::now();
    }
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Stops the server once `idle_ttl` has passed since the last authenticated request with
/// none in flight. The timer is the TTL itself (re-armed at each look), not a poll.
async fn idle_watch(shared: Arc<Shared>, cancel: CancellationToken) {
    let ttl = shared.config.idle_ttl;
    loop {
        let expires = {
            // The look and the stop under the lock a hold is taken under (`BridgeHold::new`).
            let last = shared.last_activity.lock();
            let expires = last.as_deref().copied().unwrap_or_else(|_| Instant::now()) + ttl;
            if Instant::now() >= expires && shared.in_flight.load(Ordering::SeqCst) == 0 {
                tracing::debug!(?ttl, "MCP bridge idle; stopping");
                cancel.cancel();
                return;
            }
            expires
        };
        // A request in flight past the TTL: look again one TTL later.
        let wake = if Instant::now() >= expires {
            Instant::now() + ttl
        } else {
            expires
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// The MCP handler of one request (the service builds one per request; all share `Shared`).
struct Bridge {
    shared: Arc<Shared>,
}

impl ServerHandler for Bridge {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build()).with_server_info(
            Implementation::new(
                format!("copilot-pool-{}", self.shared.config.server_name),
                env!("CARGO_PKG_VERSION"),
            ),
        )
    }

    /// Quiet: rmcp's default logs every client's `initialized` at info level.
    async fn on_initialized(&self, _context: NotificationContext<RoleServer>) {
        tracing::trace!("MCP bridge client initialized");
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.shared.listed.clone()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let id = tool_use_id(Some(&(context.meta.0).0))
            .or_else(|| tool_use_id(request.meta.as_ref().map(|m| &(m.0).0)));
        tokio::select! {
            result = run_call(&self.shared, request, id) => Ok(result.into()),
            // The client cancelled the call (`notifications/cancelled`): the handler is
            // dropped, and nobody reads an answer.
            () = context.ct.cancelled() => Err(ErrorData::internal_error(
                "the client cancelled this tool call",
                None,
            )),
        }
    }
}

impl Shared {
    /// Takes one approval of `tool` with `arguments`, if there is one.
    fn take_approval(&self, tool: &str, arguments: &Value) -> bool {
        let Ok(mut approvals) = self.approvals.lock() else {
            return false;
        };
        let found = approvals
            .iter()
            .position(|(name, args)| name == tool && args == arguments);
        found.and_then(|at| approvals.remove(at)).is_some()
    }
}

/// Runs one `tools/call` through the tool's handler; every failure is an `isError` result.
async fn run_call(
    shared: &Shared,
    request: CallToolRequestParams,
    tool_call_id: Option<String>,
) -> CallToolResult {
    let name = request.name.as_ref();
    let installed = shared.installed.lock().ok().and_then(|i| i.clone());
    let Some(installed) = installed else {
        metrics::tool_call(ToolOutcome::Error);
        return CallToolResult::error(vec![ContentBlock::text(format!(
            "the tool {name:?} cannot run now: no lease holds this conversation to answer it"
        ))]);
    };
    let Some(tool) = installed.get(name) else {
        metrics::tool_call(ToolOutcome::Error);
        let mut offered: Vec<&String> = installed.keys().collect();
        offered.sort();
        return CallToolResult::error(vec![ContentBlock::text(format!(
            "unknown tool {name:?}: this MCP server offers {offered:?}"
        ))]);
    };
    let arguments = Value::Object(request.arguments.unwrap_or_default());
    if shared.config.calls_need_approval && !shared.take_approval(&tool.name, &arguments) {
        metrics::tool_call(ToolOutcome::Error);
        return CallToolResult::error(vec![ContentBlock::text(format!(
            "the tool {name:?} was not approved for these arguments by the conversation's \
             permission policy: each call of this bridge's tools is asked about first, and \
             runs once approved"
        ))]);
    }
    let call = ToolCall {
        tool_name: tool.name.clone(),
        tool_call_id: tool_call_id
            .unwrap_or_else(|| format!("mcp-{}", uuid::Uuid::new_v4().simple())),
        arguments,
        session_id: shared
            .session_id
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default(),
        working_directory: shared.config.working_directory.clone(),
    };
    let limit = tool.timeout.unwrap_or(shared.config.tool_timeout);
    let handler = tool.handler();
    let run = async {
        // Sequential tools take the lock exclusively, concurrent ones shared (as in a turn).
        let _guard = match tool.concurrency {
            ToolConcurrency::Sequential => {
                Guard::Write(shared.sequential.clone().write_owned().await)
            }
            ToolConcurrency::Concurrent => {
                Guard::Read(shared.sequential.clone().read_owned().await)
            }
        };
        call_guarded(|| handler.call(call)).await
    };
    let (outcome, result) = match tokio::time::timeout(limit, run).await {
        Ok(Ok(Ok(text))) => (
            ToolOutcome::Ok,
            CallToolResult::success(vec![ContentBlock::text(text)]),
        ),
        Ok(Ok(Err(message))) => (
            ToolOutcome::Error,
            CallToolResult::error(vec![ContentBlock::text(message)]),
        ),
        Ok(Err(panic)) => (
            ToolOutcome::Error,
            CallToolResult::error(vec![ContentBlock::text(format!(
                "the tool handler panicked: {panic}"
            ))]),
        ),
        Err(_) => (
            ToolOutcome::Timeout,
            CallToolResult::error(vec![ContentBlock::text(format!(
                "the tool {name:?} did not answer within {limit:?} (GatewayTool::with_timeout \
                 sets its limit)"
            ))]),
        ),
    };
    metrics::tool_call(outcome);
    result
}

enum Guard {
    Read(#[expect(dead_code, reason = "held for its drop")] tokio::sync::OwnedRwLockReadGuard<()>),
    Write(
        #[expect(dead_code, reason = "held for its drop")] tokio::sync::OwnedRwLockWriteGuard<()>,
    ),
}

/// The model's id of the call, when the CLI says it in `_meta` (Claude Code sends
/// `claudecode/toolUseId`).
fn tool_use_id(meta: Option<&JsonObject>) -> Option<String> {
    meta?
        .iter()
        .find(|(key, _)| key.ends_with("toolUseId"))
        .and_then(|(_, value)| value.as_str())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo() -> GatewayTool {
        GatewayTool::new(
            "echo",
            "Echoes",
            json!({"type": "object"}),
            |c: ToolCall| async move { Ok(c.arguments.to_string()) },
        )
    }

    #[tokio::test]
    async fn a_bridge_refuses_duplicate_names_bad_schemas_and_bad_server_names() {
        let err = McpBridge::start(vec![echo(), echo()], McpBridgeConfig::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, McpBridgeError::DuplicateTool(ref n) if n == "echo"),
            "{err}"
        );
        let bad = GatewayTool::new("bad", "d", json!(true), |_c: ToolCall| async {
            Ok(String::new())
        });
        let err = McpBridge::start(vec![bad], McpBridgeConfig::default())
            .await
            .unwrap_err();
        assert!(matches!(err, McpBridgeError::Schema(_)), "{err}");
        let config = McpBridgeConfig {
            server_name: "has space".to_owned(),
            ..McpBridgeConfig::default()
        };
        let err = McpBridge::start(vec![echo()], config).await.unwrap_err();
        assert!(
            err.to_string().contains("the default is `gateway`"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_bridge_refuses_connections_over_its_cap_and_closes_one_that_sends_no_request() {
        use tokio::io::AsyncReadExt;
        let config = McpBridgeConfig {
            connections: crate::listener::ConnectionLimits {
                header_read_timeout: Duration::from_millis(300),
                idle_timeout: Duration::from_secs(60),
                max_connections: 2,
                setting: "the test's cap",
            },
            ..McpBridgeConfig::default()
        };
        let bridge = McpBridge::start(vec![echo()], config)
            .await
            .expect("bridge");
        // Two connections that send nothing (an agent's tool holding the port open).
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(
                tokio::net::TcpStream::connect(bridge.addr())
                    .await
                    .expect("connect"),
            );
        }
        // The third is answered at once, unread.
        let mut third = tokio::net::TcpStream::connect(bridge.addr())
            .await
            .expect("connect");
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(10), third.read_to_string(&mut answer))
            .await
            .expect("answered, not left waiting")
            .expect("read");
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("too_many_connections"), "{answer}");
        assert!(answer.contains("raise the test's cap"), "{answer}");
        // The silent ones are closed once their request head is overdue.
        for mut silent in held {
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(10), silent.read_to_end(&mut rest))
                .await
                .expect("closed by the bridge, not held open");
            assert!(
                read.is_ok_and(|n| n < 200),
                "closed without a request: {rest:?}"
            );
        }
    }

    #[tokio::test]
    async fn the_cli_settings_carry_the_url_but_never_the_token() {
        let bridge = McpBridge::start(vec![echo()], McpBridgeConfig::default())
            .await
            .expect("bridge");
        let token = bridge.token().expose().to_owned();
        let claude = bridge.claude_args(true);
        let joined = claude.args.join(" ");
        assert!(!joined.contains(&token), "{joined}");
        assert!(joined.contains(&bridge.url()), "{joined}");
        assert!(
            joined.contains("Bearer ${COPILOT_POOL_MCP_TOKEN}"),
            "{joined}"
        );
        assert!(
            claude
                .args
                .contains(&"--allowedTools=mcp__gateway__*".to_owned())
        );
        assert!(
            !bridge
                .claude_args(false)
                .args
                .iter()
                .any(|a| a.starts_with("--allowedTools"))
        );
        assert_eq!(claude.env[0].0, TOKEN_ENV);
        assert_eq!(claude.env[0].1.expose(), token);
        let codex = bridge.codex_overrides(true);
        assert_eq!(
            codex.args[1],
            format!("mcp_servers.gateway.url=\"{}\"", bridge.url())
        );
        assert_eq!(
            codex.args[3],
            "mcp_servers.gateway.bearer_token_env_var=\"COPILOT_POOL_MCP_TOKEN\""
        );
        assert_eq!(
            codex.args[5],
            "mcp_servers.gateway.default_tools_approval_mode=\"approve\""
        );
        assert_eq!(
            bridge.codex_overrides(false).args[5],
            "mcp_servers.gateway.default_tools_approval_mode=\"prompt\""
        );
        assert!(!codex.args.iter().any(|a| a.contains(&token)));
        assert!(!format!("{bridge:?}").contains(&token));
    }

    #[test]
    fn a_gateway_tool_is_recognized_in_either_clis_report_of_its_call() {
        assert_eq!(gateway_tool_name("mcp__gateway__lookup"), Some("lookup"));
        assert_eq!(gateway_tool_name("gateway/lookup"), Some("lookup"));
        assert_eq!(gateway_tool_name("mcp__other__lookup"), None);
        assert_eq!(gateway_tool_name("other/lookup"), None);
        assert_eq!(gateway_tool_name("mcp__gateway__"), None);
        assert_eq!(gateway_tool_name("Bash"), None);
        assert_eq!(gateway_tool_name("gatewaylookup"), None);
    }

    #[tokio::test]
    async fn a_bridge_lists_the_same_tools_whatever_their_order_handlers_or_timeouts() {
        let other = GatewayTool::new(
            "other",
            "Other",
            json!({"type": "object"}),
            |_c: ToolCall| async { Ok(String::new()) },
        );
        let bridge = McpBridge::start(vec![echo(), other.clone()], McpBridgeConfig::default())
            .await
            .expect("bridge");
        let swapped = GatewayTool::new(
            "echo",
            "Echoes",
            json!({"type": "object"}),
            |_c: ToolCall| async { Ok("another handler".to_owned()) },
        )
        .with_timeout(Duration::from_secs(1))
        .sequential();
        assert!(bridge.lists(&[other.clone(), swapped.clone()]));
        assert!(!bridge.lists(std::slice::from_ref(&swapped)), "one missing");
        let mut described = echo();
        described.description = "Echoes twice".to_owned();
        assert!(!bridge.lists(&[other.clone(), described]), "a description");
        assert!(!bridge.lists(&[]), "none");
        assert!(bridge.install(vec![swapped, other]).is_ok());
    }

    #[test]
    fn the_tool_use_id_comes_from_any_meta_key_naming_it() {
        let meta: JsonObject =
            serde_json::from_value(json!({"claudecode/toolUseId": "toolu_1"})).expect("object");
        assert_eq!(tool_use_id(Some(&meta)).as_deref(), Some("toolu_1"));
        assert_eq!(tool_use_id(None), None);
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
