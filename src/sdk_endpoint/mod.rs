//! The SDK endpoint (feature `sdk-endpoint`): the runtime's own JSON-RPC protocol
//! (`Content-Length` frames over TCP or a Unix socket), so a gateway built on an official
//! Copilot SDK attaches to the pool by URL (`RuntimeConnection.forUri(url,
//! {connectionToken})`) and gets supervision with no other change.
//!
//! * A client authenticates in `connect` with its connection token; [`AgentTokens`] (SHA-256
//!   hashes only) names the agent the connection is for: its home, its processes, its
//!   sessions. Any other call first is refused with `-32001`, a wrong token with `-32002`
//!   (the runtime's codes), and the connection closed after that answer; an agent already holding `max_connections_per_agent`
//!   connections is refused with `-32003` (the pool's). `connect`, `ping` and `status.get`
//!   answer with protocol version 3 and the pool's version. A session its agent may not
//!   start (`max_conversations_per_agent`) is refused with `-32004` (the pool's).
//! * Each SDK session is the pool conversation `(agent, "sdk:<session id>")`, run under the
//!   SDK's own session id. It is leased for each turn (`session.send` until `session.idle`)
//!   and for each call between turns, so the pool's caps, waiters, recycling and rotation
//!   apply between turns as for any conversation.
//! * A session's events and the runtime's questions for it (`userInput.request`,
//!   `hooks.invoke`) reach the connection that opened it and no other; tool and permission
//!   answers are checked against the process's ledger.
//! * A process that dies mid-turn ends the turn with `session.error` (`errorType:
//!   "process_crashed"`) and `session.idle`; the next call resumes the session on a fresh
//!   process. A client that goes away has its turns aborted and its sessions parked.
//!
//! Modules: `tokens` (token → agent), `listener` (accept loops: the connection cap, the
//! stop), `admission` (room for connections: those not authenticated yet, where a new one
//! past the cap closes the oldest, and each agent's), `connection` (one client: the handshake and where each
//! method goes), `session` (one SDK session: leases, the turn pump, crashes), `fields` (which session
//! fields a client may set).

mod admission;
mod connection;
mod fields;
mod listener;
mod session;
mod tokens;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use crate::pool::Pool;

pub use connection::{CONVERSATION_LIMIT, TOO_MANY_CONNECTIONS};
pub use listener::{serve_tcp, serve_unix};
pub use session::{PROCESS_CRASHED, SHUTDOWN, TURN_LIMIT};
pub use tokens::{AgentTokens, TokenError, sha256_hex};

/// The protocol version the endpoint speaks (the runtime's; SDK 1.0.14 accepts only 3).
pub const PROTOCOL_VERSION: u32 = crate::rpc::messages::PROTOCOL_VERSION;

/// The endpoint's settings. Every limit has a finite default.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SdkConfig {
    /// Connection tokens and the agent each names.
    pub tokens: AgentTokens,
    /// Open client connections at most (default 1024); one more is closed at once.
    pub max_connections: usize,
    /// Of those, connections that have not authenticated yet (`connect`) at most (default
    /// 64; 0 counts as 1): a new one past it closes the oldest waiting one, so clients that
    /// connect and never authenticate (each may wait `connect_timeout`) cannot keep the
    /// agents' clients out.
    pub max_unauthenticated_connections: usize,
    /// Authenticated connections of one agent at most (default 64; 0 counts as 1): past it
    /// the agent's `connect` is refused ([`TOO_MANY_CONNECTIONS`]), so one agent's clients
    /// cannot take every connection from the others. One client runs all of an agent's
    /// sessions.
    pub max_connections_per_agent: usize,
    /// A client must have authenticated (`connect`) this long after its connection was
    /// accepted (default 10 s), else the connection is closed.
    pub connect_timeout: Duration,
    /// Calls passed on to a process wait this long for its answer (default 60 s).
    pub request_timeout: Duration,
    /// The runtime's questions passed to a client (`userInput.request`, `hooks.invoke`)
    /// wait this long for its answer (default 10 min: a person may be answering).
    pub client_request_timeout: Duration,
    /// A turn running longer than this is aborted, and its client told so with a
    /// `session.error` of type [`TURN_LIMIT`] (default 30 min; `copilot-pool serve` sets its
    /// `[turns] absolute_secs`).
    pub max_turn_duration: Duration,
    /// Requests of one connection handled at once (default 64); more wait, and past the
    /// queue they are refused.
    pub max_requests_per_connection: usize,
    /// Sessions one connection holds at once (default 1024: each keeps its config, up to a
    /// frame, for the connection's life); one more is refused until it lets one go
    /// (`session.detach`, the SDKs' `disconnect`).
    pub max_sessions_per_connection: usize,
    /// Largest frame a client may send (default 16 MiB). A frame also holds at most one JSON
    /// value per 32 bytes of it (at least 65,536): past that it is refused unread, `-32600`.
    pub max_frame_bytes: usize,
    /// Overrides the pool's wait for capacity and for a busy session.
    pub wait_timeout: Option<Duration>,
    /// The version `connect`, `ping` and `status.get` report (default this crate's).
    pub version: String,
    /// Sessions without their own `gitHubToken` (and calls naming no session) may run as
    /// the account logged in to the Copilot CLI on the pool's machine (default false: they
    /// run with no GitHub identity, which only a BYOK provider serves; the daemon's `[auth]
    /// allow_logged_in_user`).
    pub allow_logged_in_user: bool,
    /// Sessions may start MCP servers that run local commands (default false; the daemon's
    /// `allow_local_mcp_servers`, as for the HTTP API).
    pub allow_local_mcp_servers: bool,
    /// Directories besides the agent's own work directory that a session's directories
    /// (`workingDirectory`, `additionalDirectories`, skill, plugin and instruction
    /// directories) may lie in (default none; the daemon's `allowed_work_roots`, as for the
    /// HTTP API). Absolute paths.
    pub allowed_work_roots: Vec<std::path::PathBuf>,
}

impl SdkConfig {
    /// The defaults above, with these tokens.
    pub fn new(tokens: AgentTokens) -> Self {
        Self {
            tokens,
            max_connections: 1024,
            max_unauthenticated_connections: 64,
            max_connections_per_agent: 64,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            client_request_timeout: Duration::from_secs(600),
            max_turn_duration: Duration::from_secs(1800),
            max_requests_per_connection: 64,
            max_sessions_per_connection: 1024,
            max_frame_bytes: 16 << 20,
            wait_timeout: None,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            allow_logged_in_user: false,
            allow_local_mcp_servers: false,
            allowed_work_roots: Vec::new(),
        }
    }
}

/// The SDK endpoint over one pool: serve it with [`serve_tcp`] or [`serve_unix`] (as many
/// listeners as wanted share it), drain it with [`SdkEndpoint::set_draining`]. Cheap to
/// clone.
#[derive(Clone, Debug)]
pub struct SdkEndpoint {
    shared: std::sync::Arc<Shared>,
}

/// What every connection of an endpoint shares.
struct Shared {
    pool: Pool,
    config: SdkConfig,
    /// Which connection holds each SDK session (by conversation key): one at a time.
    owners: Mutex<HashMap<String, u64>>,
    next_connection: AtomicU64,
    draining: watch::Sender<bool>,
    running_turns: watch::Sender<usize>,
    /// Each agent's authenticated connections, endpoint-wide (over every listener).
    seats: std::sync::Arc<admission::AgentSeats>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    fn turn_started(&self) {
        self.running_turns.send_modify(|n| *n += 1);
    }

    fn turn_ended(&self) {
        self.running_turns.send_modify(|n| *n = n.saturating_sub(1));
    }

    /// Records `connection` as the holder of `conversation`; false when another one holds it.
    fn claim(&self, conversation: &str, connection: u64) -> bool {
        let Ok(mut owners) = self.owners.lock() else {
            return false;
        };
        match owners.get(conversation) {
            Some(holder) if *holder != connection => false,
            _ => {
                owners.insert(conversation.to_owned(), connection);
                true
            }
        }
    }

    /// Lets go of `conversation` if `connection` holds it.
    fn release(&self, conversation: &str, connection: u64) {
        if let Ok(mut owners) = self.owners.lock()
            && owners.get(conversation) == Some(&connection)
        {
            owners.remove(conversation);
        }
    }

    fn next_connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }
}

impl SdkEndpoint {
    /// An endpoint that runs its clients' sessions on `pool`.
    pub fn new(pool: Pool, config: SdkConfig) -> Self {
        Self {
            shared: std::sync::Arc::new(Shared {
                pool,
                owners: Mutex::new(HashMap::new()),
                next_connection: AtomicU64::new(1),
                draining: watch::channel(false).0,
                running_turns: watch::channel(0).0,
                seats: admission::AgentSeats::new(config.max_connections_per_agent),
                config,
            }),
        }
    }

    /// Stops starting turns: `session.send`, `session.create` and `session.resume` are
    /// refused with an error saying the daemon is draining; running turns go on, and their
    /// tool answers are still taken.
    pub fn set_draining(&self) {
        self.shared.draining.send_replace(true);
    }

    /// Turns running now.
    pub fn running_turns(&self) -> usize {
        *self.shared.running_turns.borrow()
    }

    /// Resolves once no turn runs.
    pub async fn turns_finished(&self) {
        let mut rx = self.shared.running_turns.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }
}
