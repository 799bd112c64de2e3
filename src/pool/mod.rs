//! The pool: keyed leasing of conversations across supervised CLI workers.
//!
//! * [`Pool`] — start, [`Pool::lease`], [`Pool::status`], [`Pool::shutdown`].
//! * [`Lease`] — exclusive use of one conversation with the basic turn API.
//! * [`PoolConfig`], [`LeaseRequest`] — caps, timeouts, what a lease asks for.
//! * `key` — [`PoolKey`] (which processes), its family (rotation) and the compat key (resume).
//! * `bindings` — durable `session_key` → CLI session id records, a store per namespace (the
//!   Copilot runtime's conversations, the CLI backends').
//! * `restart` — OTP-style restart intensity and backoff.
//! * `placement` — the pure core: every placement decision and the ownership of conversations.
//! * `actor` — the thin actor that feeds the core events and carries out its effects.
//! * `budget` — the one `max_processes` budget Copilot workers and CLI processes share:
//!   each side's view of the other, and whose idle process makes room.
//! * `cli` — conversations of other agent CLIs ([`Pool::lease_cli`]): their pure placement
//!   core and session rules under a thin shell.
//!
//! The pool never parses events or touches stdio: that is the worker's job.

mod actor;
pub mod bindings;
mod budget;
mod cli;
mod config;
mod error;
pub mod key;
mod lease;
mod placement;
mod prime;
pub mod restart;
mod status;
mod warm;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef};
use tokio::sync::{broadcast, watch};

use crate::auth::{AuthMode, resolve_for_lease};
use crate::home::resolve_copilot_home;
use crate::model_guard::ModelGuard;
use crate::rpc::messages::{ProviderConfig, SessionConfig};
use crate::worker::{Session, WorkerError, WorkerHandle};

pub use crate::ids::{CliSessionId, ConversationId};
pub use crate::turn::TurnOutcome;
pub use bindings::{Binding, BindingError, BindingStore, CLI_BINDINGS_DIR};
/// What a deletion's caller does with the conversation's working directory once the
/// conversation's session is gone, while the conversation is still held for it (its inline
/// attachments removed: no turn of it can write there meanwhile).
pub(crate) type WhileHeld = Box<
    dyn FnOnce(
            std::path::PathBuf,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send,
>;
pub use config::InfiniteSessions;
pub use config::{
    LeaseRequest, MAX_SESSION_KEY_BYTES, PoolConfig, spare_room, validate_provider,
    validate_session_key,
};
pub use error::PoolError;
pub use key::{PoolKey, compat_key};
pub use lease::{Lease, OpenReason};
pub use restart::{RestartDecision, RestartPolicy};
pub use status::{PoolEvent, PoolStatus, PoolTotals, ProcessBudget, WorkerState, WorkerStatus};

pub use actor::ProcessLease;
use actor::{AcquireRequest, Grant, PoolActor, PoolArgs, PoolMsg};
pub use cli::{COPILOT_BACKEND, CliLease, CliLeaseTurn};

/// Extra time an acquire call may take beyond the wait (a spawn that finishes late).
const ACQUIRE_SLACK: Duration = Duration::from_secs(5);

/// Sessions the `cli` flavour can hold per OS user before inotify runs out (the default
/// `fs.inotify.max_user_instances` is 128, shared by every process of the user).
const CLI_FLAVOUR_SESSION_WARNING: usize = 96;

/// What [`Pool::shutdown`] did.
#[derive(Debug, Clone, Default)]
pub struct ShutdownReport {
    /// Leases still held after the grace period; their running turns were aborted.
    pub aborted_leases: usize,
}

/// A pool of supervised CLI workers. Cheap to clone; the last clone dropped without
/// [`Pool::shutdown`] stops the pool actor, which stops every worker.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    actor: ActorRef<PoolMsg>,
    config: PoolConfig,
    /// The guarded model path every BYOK worker's tunnel goes through.
    guard: ModelGuard,
    bindings: Arc<BindingStore>,
    leased: watch::Receiver<usize>,
    events: broadcast::Sender<PoolEvent>,
    /// Set by `shutdown`: leases fail at once, also those waiting for their conversation.
    closed: watch::Sender<bool>,
    /// The conversations of CLI backends.
    cli: Arc<cli::CliPool>,
    /// The port of the pool's priming sink (the actor owns it), which a sandboxed worker
    /// without a tunnel may connect to.
    priming_port: Option<u16>,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        self.actor.stop(Some("pool dropped".to_owned()));
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").finish_non_exhaustive()
    }
}

impl Pool {
    /// Starts a pool. Opens (creates) the binding store under `config.state_dir`.
    pub async fn start(config: PoolConfig) -> Result<Pool, PoolError> {
        let cli_flavour = config
            .worker
            .program
            .file_name()
            .is_some_and(|n| n == "copilot");
        if cli_flavour && config.max_sessions > CLI_FLAVOUR_SESSION_WARNING {
            tracing::warn!(
                max_sessions = config.max_sessions,
                "The `copilot` (cli flavour) runtime opens one inotify instance per session; the \
                 default per-user limit is 128 for all processes together. Set max_sessions to \
                 at most 96 or raise fs.inotify.max_user_instances."
            );
        }
        let guard = config.checked()?;
        // Off the async threads: the first open after an upgrade indexes every binding, and
        // the CLI backends' store may move bindings over.
        let state_dir = config.state_dir.clone();
        let backends: Vec<String> = config.cli_backends.keys().cloned().collect();
        let counted = config.max_conversations_per_agent.is_some();
        let (copilot, cli_store) = tokio::task::spawn_blocking(move || {
            let copilot = BindingStore::open(&state_dir)?;
            let cli_store = cli::open_bindings(&state_dir, &copilot, backends.iter())?;
            // After the CLI store took its bindings over: what is left is the runtime's.
            let copilot = if counted {
                copilot.with_agent_tally()?
            } else {
                copilot
            };
            Ok::<_, PoolError>((copilot, cli_store))
        })
        .await
        .map_err(|e| PoolError::Internal(e.to_string()))??;
        let bindings = Arc::new(copilot.with_disk_faults(config.disk_faults.clone()));
        let cli_bindings = Arc::new(cli_store.with_disk_faults(config.disk_faults.clone()));
        let cli = Arc::new(cli::CliPool::new(
            config.cli_backends.clone(),
            cli::slots::Caps {
                max_processes: config.max_processes,
                max_per_key: config.max_processes_per_key,
                max_waiters: config.max_waiters,
                max_waiters_per_agent: config.max_waiters_per_agent,
            },
            config.restart.clone(),
            cli_bindings,
        ));
        spawn_cli_maintenance(&cli, config.idle_ttl, config.maintenance_interval);
        let (leased_tx, leased_rx) = watch::channel(0);
        let (events, _) = broadcast::channel(1024);
        let priming_sink = match prime::PrimingSink::bind().await {
            Ok(sink) => Some(sink),
            Err(error) => {
                tracing::warn!(%error, "No loopback listener for priming turns: a process primed without a tunnel will see its model call fail (~30 MiB more runtime memory each).");
                None
            }
        };
        let priming_port = priming_sink.as_ref().map(prime::PrimingSink::port);
        let args = PoolArgs {
            config: config.clone(),
            leased: leased_tx,
            events: events.clone(),
            cli: cli.clone(),
            bindings: bindings.clone(),
            priming_sink,
        };
        let (actor, _) = Actor::spawn(None, PoolActor, args)
            .await
            .map_err(|e| PoolError::Worker(WorkerError::Spawn(format!("pool actor: {e}"))))?;
        // The CLI side reaches the actor for the shared process budget (a closed mailbox:
        // the pool is gone, nothing to tell).
        let to_actor = actor.clone();
        cli.connect_copilot(Box::new(move |nudge| {
            let _ = to_actor.cast(PoolMsg::Cli(nudge));
        }));
        Ok(Pool {
            inner: Arc::new(PoolInner {
                actor,
                config,
                guard,
                bindings,
                leased: leased_rx,
                events,
                closed: watch::channel(false).0,
                cli,
                priming_port,
            }),
        })
    }

    /// The backend ids a lease may name: `copilot`, then the configured CLI backends.
    pub fn backend_ids(&self) -> Vec<String> {
        self.inner.cli.backend_ids()
    }

    /// Whether a lease of `backend` may carry gateway tools (`LeaseRequest::handlers.tools`):
    /// `copilot`, and the CLI backends the MCP bridge serves (`cli-live` Claude Code, and
    /// `codex-cli`); not Gemini CLI nor a generic one-shot CLI. An unknown backend is the
    /// error of [`Pool::check_backend`].
    pub fn serves_gateway_tools(&self, backend: &str) -> Result<bool, PoolError> {
        if backend == COPILOT_BACKEND {
            return Ok(true);
        }
        self.inner.cli.serves_gateway_tools(backend)
    }

    /// Checks that a lease of `req` on CLI backend `backend` would take its session options
    /// (only `systemMessage` in mode `append`, besides the lease's own fields), before
    /// anything is leased.
    pub(crate) fn check_cli_options(
        &self,
        backend: &str,
        req: &LeaseRequest,
    ) -> Result<(), PoolError> {
        let config = self.inner.cli.backend(backend)?;
        Self::refuse_cli_bearer_token(backend, req)?;
        let mut probe = req.clone();
        let options = std::mem::take(&mut probe.session_options);
        probe.apply_session_options(options)?;
        cli::options::system_prompt(backend, config, &probe.session_options).map(|_| ())
    }

    /// A CLI backend takes its key as `provider.api_key`: a request with a bearer token is
    /// refused for one (when its lease is taken, and before a chain naming it runs, so a
    /// fallback that could never be leased is refused up front, not found out in an outage).
    fn refuse_cli_bearer_token(backend: &str, req: &LeaseRequest) -> Result<(), PoolError> {
        if req
            .provider
            .as_ref()
            .is_some_and(|p| p.bearer_token.is_some())
        {
            return Err(PoolError::InvalidRequest(format!(
                "backend `{backend}` takes its key as provider.api_key; a bearer_token is not \
                 passed to CLI backends (give the key as api_key, or drop `{backend}` from the \
                 chain)"
            )));
        }
        Ok(())
    }

    /// Checks that `backend` is `copilot` or a configured CLI backend; the error lists the
    /// configured ids and how to add one.
    pub fn check_backend(&self, backend: &str) -> Result<(), PoolError> {
        if backend == COPILOT_BACKEND {
            return Ok(());
        }
        self.inner.cli.backend(backend).map(|_| ())
    }

    /// Leases a conversation of the CLI backend `req.backend` (issue 17): one process per
    /// conversation (`cli-live`), kept between its leases. The key of its processes is the
    /// agent's home for the backend (`<agent dir>/<backend id>`), the credential and the
    /// backend id; the pool's caps, waiters, wait timeout and restart intensity apply. The
    /// model endpoint and key are the request's `provider` (`base_url`, `api_key`), checked
    /// as a Copilot lease's ([`Pool::check_provider`]: its shape and the guard's rules, so a
    /// loopback or private endpoint needs `allow_private_endpoints` or `private_endpoints`,
    /// and a base URL with a credential in it is refused), and more, since the CLI calls it
    /// itself ([`crate::model_guard::ModelGuard::check_cli_provider`]: a port of
    /// `cli_provider_ports`, the host's addresses resolved and checked now); the
    /// auth profile (`auth.auth_profile_id`, else `auth.profile_id`) is the identity a key
    /// refresh keeps. The stored CLI session is resumed when the identity is unchanged and
    /// its transcript exists (else [`PoolError::TranscriptMissing`]); another identity
    /// starts a new session. The permission policy is `req.handlers.permission_policy`.
    ///
    /// The lease's gateway tools (`req.handlers.tools`) are served to the CLI by its
    /// conversation's MCP bridge, answered by this lease's handlers until it is dropped (a
    /// call between leases is an `isError` result); a tool without its own timeout gets the
    /// lease's `timeouts.tool`. A conversation whose CLI was started with other tools
    /// (names, descriptions, schemas) is started again with these, resuming its session.
    /// A backend that cannot serve them ([`Pool::serves_gateway_tools`]) refuses them.
    pub async fn lease_cli(&self, req: LeaseRequest) -> Result<CliLease, PoolError> {
        let backend = self.backend_label(&req.backend);
        let result = self.lease_cli_inner(req).await;
        if let Err(error) = &result {
            crate::metrics::lease_rejected(&backend, error.kind());
        }
        result
    }

    async fn lease_cli_inner(&self, mut req: LeaseRequest) -> Result<CliLease, PoolError> {
        let inner = &self.inner;
        if *inner.closed.borrow() {
            return Err(PoolError::Closed);
        }
        let config = inner.cli.backend(&req.backend)?;
        validate_session_key(&req.session_key)?;
        // `model` and `workingDirectory` in the options are the lease's, as on Copilot.
        let options = std::mem::take(&mut req.session_options);
        req.apply_session_options(options)?;
        let system_prompt =
            cli::options::system_prompt(&req.backend, config, &req.session_options)?;
        Self::refuse_cli_bearer_token(&req.backend, &req)?;
        // The shape and the guard's rules, as a Copilot lease's (a base URL carrying a
        // credential, userinfo or a key in its query, would reach the CLI's command line),
        // then the port and the host's addresses: the CLI calls its model itself.
        if let Some(provider) = &req.provider {
            validate_provider(provider)?;
            self.inner
                .guard
                .check_cli_provider(provider, &req.agent_id)
                .await
                .map_err(|e| match e {
                    crate::model_guard::GuardError::Unresolved { .. } => {
                        PoolError::ProviderUnchecked(e.to_string())
                    }
                    e => PoolError::InvalidRequest(e.to_string()),
                })?;
        }
        let tools = cli_gateway_tools(&inner.cli, &req)?;
        let (copilot_home, home) = self.cli_homes(&req)?;
        let names = cli::CliNames::new(&req.agent_id, &req.session_key, &req.backend);
        let profile_id = req
            .auth
            .auth_profile_id
            .clone()
            .or_else(|| req.auth.profile_id.clone());
        let creds = cli::session::CliCredentials {
            base_url: req.provider.as_ref().map(|p| p.base_url.clone()),
            api_key: req.provider.as_ref().and_then(|p| p.api_key.clone()),
            profile_id,
        };
        let sandbox = match &inner.config.worker.sandbox {
            Some(template) => {
                let sandbox = cli_sandbox(template, &req, &copilot_home, &home, config)?;
                sandbox.check_working_directory(&req.working_directory)?;
                Some(sandbox)
            }
            None => None,
        };
        let ask = cli::CliAsk {
            backend: req.backend.clone(),
            conversation: names.slot,
            home,
            cwd: req.working_directory.clone(),
            creds,
            model: req.model.clone(),
            reasoning_effort: req.reasoning_effort,
            permission: req.handlers.permission_policy.clone(),
            fail_if_busy: req.fail_if_busy,
            wait: req.wait_timeout.unwrap_or(inner.config.wait_timeout),
            turn_timeout: Some(req.handlers.timeouts.absolute),
            tools,
            system_prompt,
            sandbox,
            group_ledger: inner.config.worker.group_ledger.clone(),
        };
        inner.cli.lease(ask, names.binding).await
    }

    /// The agent's `COPILOT_HOME` for a CLI lease and, beside it, the backend's own home.
    fn cli_homes(
        &self,
        req: &LeaseRequest,
    ) -> Result<(std::path::PathBuf, std::path::PathBuf), PoolError> {
        let copilot_home = resolve_copilot_home(
            req.copilot_home.as_deref(),
            req.agent_dir.as_deref(),
            &self.inner.config.agents_base_dir,
            &req.agent_id,
        )?;
        let home =
            crate::home::backend_home(&copilot_home, &req.backend, req.copilot_home.is_none())?;
        Ok((copilot_home, home))
    }

    /// Whether a backend other than `except` (`copilot` or a CLI backend id) has conversation
    /// `conversation` stored, or (a CLI backend) holds it now: a gateway conversation whose
    /// turns fell back from one backend to another is stored on each, and what they share
    /// (its inline attachments) stays until the last is deleted. Blocking (file lookups):
    /// call it off the async threads.
    pub fn stored_on_another_backend(
        &self,
        conversation: &ConversationId,
        except: &str,
    ) -> Result<bool, PoolError> {
        let inner = &self.inner;
        if except != COPILOT_BACKEND
            && inner
                .bindings
                .is_present(&conversation.key())
                .map_err(|e| PoolError::Bindings(e.to_string()))?
        {
            return Ok(true);
        }
        let clis = self.backend_ids();
        for backend in clis
            .iter()
            .filter(|b| *b != except && *b != COPILOT_BACKEND)
        {
            let names =
                cli::CliNames::new(&conversation.agent_id, &conversation.session_key, backend);
            // Held too: a first turn (or a chain's fallback) runs there before its binding
            // is written, at its end.
            if inner.cli.holds(&names.slot) || inner.cli.is_stored(&names)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Deletes a conversation of the CLI backend `req.backend` (its agent, session key and
    /// home as its leases name them, and the working directory its turns ran in when its
    /// binding did not record it; the rest of `req` is not used): refused
    /// with [`PoolError::ConversationBusy`] while it runs a turn or a lease waits for it;
    /// else its kept process is ended, the files its CLI keeps of the stored session (the
    /// transcript where the backend's dialect says, for Claude Code the folder beside it
    /// too; a `generic` CLI's are unknown and left) are removed, and then the stored session,
    /// so the next lease of the session key starts a new one. The way out of
    /// [`PoolError::TranscriptMissing`], and how a gateway frees the disk a CLI conversation
    /// took (the pool prunes nothing itself). `Ok(Some(dir))`: deleted; its turns ran in
    /// `dir` (where a gateway's inline attachments of it are: the directory its binding
    /// recorded, else its kept process's, else `req`'s). `Ok(None)`: nothing was stored or
    /// kept.
    pub async fn delete_cli_conversation(
        &self,
        req: LeaseRequest,
    ) -> Result<Option<std::path::PathBuf>, PoolError> {
        self.delete_cli_conversation_then(req, None).await
    }

    /// [`Pool::delete_cli_conversation`], running `while_held` on the conversation's
    /// working directory before the conversation is let go (the HTTP layer removes its
    /// inline attachments there, where a turn let in after would write its own).
    pub(crate) async fn delete_cli_conversation_then(
        &self,
        mut req: LeaseRequest,
        while_held: Option<WhileHeld>,
    ) -> Result<Option<std::path::PathBuf>, PoolError> {
        let inner = &self.inner;
        if *inner.closed.borrow() {
            return Err(PoolError::Closed);
        }
        inner.cli.backend(&req.backend)?;
        validate_session_key(&req.session_key)?;
        let options = std::mem::take(&mut req.session_options);
        req.apply_session_options(options)?;
        let names = cli::CliNames::new(&req.agent_id, &req.session_key, &req.backend);
        // Nothing stored or kept: nothing to find a home for (and none is made).
        if !inner.cli.is_stored(&names)? && !inner.cli.holds(&names.slot) {
            return Ok(None);
        }
        // Found, not made: a deletion leaves nothing behind.
        let home = crate::home::find_backend_home(
            req.copilot_home.as_deref(),
            req.agent_dir.as_deref(),
            &inner.config.agents_base_dir,
            &req.agent_id,
            &req.backend,
        )?;
        inner
            .cli
            .delete(
                &req.backend,
                &names,
                home,
                &req.working_directory,
                while_held,
            )
            .await
    }

    /// Events as they happen (workers started, crashed, evicted; conversations opened).
    /// A receiver that falls more than 1,024 events behind loses the oldest.
    pub fn subscribe(&self) -> broadcast::Receiver<PoolEvent> {
        self.inner.events.subscribe()
    }

    /// The pool's configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// Checks a BYOK provider as a lease would, before anything runs with it: its base URL
    /// (`validate_provider`) and the model guard's rules (scheme, userinfo, credential-looking
    /// query parameters, an IP address host's range; `allow_private_endpoints` comes from
    /// the pool's config, never from the request). The HTTP API calls it for a request's
    /// provider before it creates anything.
    pub fn check_provider(&self, provider: &ProviderConfig) -> Result<(), PoolError> {
        validate_provider(provider)?;
        self.inner
            .guard
            .check_provider(provider)
            .map_err(|e| PoolError::InvalidRequest(e.to_string()))
    }

    /// The durable bindings of the Copilot runtime's conversations (read-only use: the pool
    /// writes them; the CLI backends' are a store of their own, `<state_dir>/cli-bindings`).
    pub fn bindings(&self) -> &BindingStore {
        &self.inner.bindings
    }

    /// The durable bindings of the CLI backends' conversations, under
    /// `<agent_id>/<session_key>#backend=<backend id>` (read-only use: the pool writes them).
    pub fn cli_bindings(&self) -> &BindingStore {
        self.inner.cli.bindings()
    }

    /// The `backend` label of a lease naming `id`: `id` when it is `copilot` or a configured
    /// CLI backend, else `unknown` (a caller never grows the label set).
    fn backend_label(&self, id: &str) -> String {
        if id == COPILOT_BACKEND || self.inner.cli.backend(id).is_ok() {
            id.to_owned()
        } else {
            crate::metrics::UNKNOWN_BACKEND.to_owned()
        }
    }

    /// Leases a conversation: resolves credentials and home, waits for the conversation
    /// (one turn at a time) and for capacity, then attaches the CLI session — reusing the
    /// attached one, resuming the bound one, or creating a new one.
    pub async fn lease(&self, req: LeaseRequest) -> Result<Lease, PoolError> {
        self.lease_for(req, LeasePurpose::Turns).await
    }

    /// A lease of a stored conversation only for deleting it ([`Lease::reset`]): it needs no
    /// credentials of the conversation's own (none of its turns' token or BYOK provider), and
    /// its settings are not compared with the conversation's. The conversation is the one
    /// stored under the CLI session id the caller chose (`req.cli_session_id`: the SDK
    /// endpoint's `session.delete` of a session its connection has not opened, which names the
    /// session id alone), else the one its binding names (an HTTP reset by the conversation's
    /// name alone), in the working directory the binding recorded when it did. Deleting a
    /// session is the runtime's file work, which a process of the agent's home with no
    /// identity does (measured, runtime 1.0.14), so the lease goes to a process of the key
    /// `req.auth` gives, a process with no GitHub identity when it carries none; a session
    /// parked on a process of its own key is detached there first, as after a rotation. The
    /// lease is no traffic of its key: no warm spare is kept for it.
    #[cfg(any(feature = "http", feature = "sdk-endpoint"))]
    pub(crate) async fn lease_to_delete(&self, mut req: LeaseRequest) -> Result<Lease, PoolError> {
        req.existing_only = true;
        req.runs_no_turn = true;
        // No identity is needed: never the logged-in user unless the request asks for it.
        if !req.auth.use_logged_in_user {
            req.auth.forbid_logged_in_user = true;
        }
        self.lease_for(req, LeasePurpose::Deletion).await
    }

    async fn lease_for(
        &self,
        req: LeaseRequest,
        purpose: LeasePurpose,
    ) -> Result<Lease, PoolError> {
        // A span per lease; the key's short hash is recorded once it is known.
        let span = tracing::info_span!("lease", agent = %req.agent_id, key = tracing::field::Empty);
        let backend = self.backend_label(&req.backend);
        let result = tracing::Instrument::instrument(self.lease_inner(req, purpose), span).await;
        if let Err(error) = &result {
            crate::metrics::lease_rejected(&backend, error.kind());
        }
        result
    }

    async fn lease_inner(
        &self,
        mut req: LeaseRequest,
        purpose: LeasePurpose,
    ) -> Result<Lease, PoolError> {
        let started = std::time::Instant::now();
        let inner = &self.inner;
        if *inner.closed.borrow() {
            return Err(PoolError::Closed);
        }
        if req.backend != COPILOT_BACKEND {
            self.check_backend(&req.backend)?;
            return Err(PoolError::InvalidRequest(format!(
                "backend `{}` is a CLI backend: lease it with Pool::lease_cli",
                req.backend
            )));
        }
        // The session options are checked, and the fields the request has its own field
        // for are moved onto it, before anything is keyed on them.
        let options = std::mem::take(&mut req.session_options);
        req.apply_session_options(options)?;
        let auth = match purpose {
            LeasePurpose::Turns => resolve_for_lease(&req.auth, req.provider.is_some())?,
            // No model is called: a process with no identity will do.
            LeasePurpose::Deletion => crate::auth::resolve(&req.auth)?,
        };
        validate_session_key(&req.session_key)?;
        if let Some(provider) = &req.provider {
            self.check_provider(provider)?;
        }
        // A call on an existing conversation only (a compact, a reset) of one that was never
        // recorded is refused before anything is made for it: no home, no process.
        let bound = if req.existing_only && req.cli_session_id.is_none() {
            let conversation = ConversationId::new(&req.agent_id, &req.session_key).key();
            let store = inner.bindings.clone();
            match tokio::task::spawn_blocking(move || store.get(&conversation)).await {
                Ok(Ok(Some(binding))) => Some(binding),
                // Its first lease holds it or waits for its process: busy, not unknown.
                Ok(Ok(None)) if req.fail_if_busy && self.is_busy(&req).await => {
                    return Err(PoolError::ConversationBusy {
                        session_key: req.session_key,
                    });
                }
                Ok(Ok(None)) => {
                    return Err(PoolError::NoSuchConversation {
                        session_key: req.session_key,
                        why: "it was never started",
                    });
                }
                Ok(Err(e)) => return Err(state_unwritable(&inner.bindings, e.os_error())),
                Err(e) => return Err(PoolError::Internal(e.to_string())),
            }
        } else {
            None
        };
        // A deletion goes to the session its binding names, in the directory the binding
        // recorded, whatever settings the lease carries.
        let mut deleting_by = None;
        let bound = match bound {
            Some(binding) if purpose == LeasePurpose::Deletion => {
                req.cli_session_id = Some(binding.cli_session_id.clone());
                if let Some(dir) = &binding.working_directory {
                    req.working_directory = dir.clone();
                }
                deleting_by = Some(binding);
                None
            }
            other => other,
        };
        let home = resolve_copilot_home(
            req.copilot_home.as_deref(),
            req.agent_dir.as_deref(),
            &inner.config.agents_base_dir,
            &req.agent_id,
        )?;
        let key = PoolKey::new(&home, &auth, req.provider.as_ref(), req.model.as_deref());
        tracing::Span::current().record("key", tracing::field::display(key.short_hash()));
        let compat = compat_key(
            &key,
            req.model.as_deref(),
            &req.working_directory,
            &req.session_options,
        );
        // Nor one recorded with other settings: it would be detached from its process only
        // to be refused at the open.
        if bound.is_some_and(|binding| binding.compat_key != compat) {
            return Err(PoolError::NoSuchConversation {
                session_key: req.session_key,
                why: "its model, provider, directory or account differ",
            });
        }
        let wait = req.wait_timeout.unwrap_or(inner.config.wait_timeout);
        // A conversation is (agent, session key): two agents may use the same key. One turn
        // at a time per conversation: the pool actor queues a lease behind the conversation's
        // running one (or refuses it at once with `fail_if_busy`), within the same wait as
        // for capacity.
        let conversation = ConversationId::new(&req.agent_id, &req.session_key).key();
        // A conversation the agent does not keep yet (a new one, or a stored session the
        // caller names that no binding of it holds) takes a place in its count before
        // anything is made for it (one in memory: a kept one needs none and reads nothing).
        // A deletion, a compact or a reset of a kept conversation adds none: not counted.
        let max_conversations = inner.config.max_conversations_per_agent.filter(|_| {
            purpose == LeasePurpose::Turns
                && !req.runs_no_turn
                && (!req.existing_only || req.cli_session_id.is_some())
        });
        let reservation = match max_conversations {
            Some(max) => inner
                .bindings
                .reserve_new(&conversation, max)
                .map_err(|kept| conversations_full(max, kept))?,
            None => None,
        };

        let spec = self.worker_spec(&req, &home, &auth)?;
        let allowed = match &spec.sandbox {
            Some(sandbox) => sandbox.check_working_directory(&req.working_directory),
            None => Ok(()),
        };
        match allowed {
            // A deletion resumes its session only to delete it: where its directory is gone
            // (a project removed, or the agent's own never made) or no longer allowed (the
            // roots changed since its binding recorded it), the agent's home stands in, since
            // the runtime refuses to resume a session in a directory that does not exist.
            // (The lease's compat, computed above with the recorded directory, only matches
            // it to a session parked on a process of its own no-identity key.) Files in a
            // directory no longer allowed are not touched: its attachments stay.
            Err(error) if purpose == LeasePurpose::Deletion => {
                tracing::warn!(
                    %error,
                    "The working directory of the conversation being deleted is outside the \
                     agent's sandbox now; its session is deleted from the agent's home, and \
                     files of it in that directory (inline attachments) are left."
                );
                req.working_directory = home.clone();
            }
            Ok(()) if purpose == LeasePurpose::Deletion && !req.working_directory.is_dir() => {
                req.working_directory = home.clone();
            }
            allowed => allowed?,
        }
        let mut session_config = match &req.wire_config {
            // A client's own config (the SDK endpoint): sent as it is; the open sets the id.
            Some(wire) => {
                let mut config = SessionConfig {
                    session_id: String::new(),
                    ..wire.clone()
                };
                // Its provider is the lease's, replaced below by placeholders: the real
                // one never reaches the child.
                if req.provider.is_some() {
                    config.extra.remove("provider");
                }
                without_command_files(&mut config.extra);
                config
            }
            None => session_config(&req, &auth, inner.config.infinite_sessions.as_ref()),
        };
        if let Some(provider) = &req.provider {
            // The guarded path: the child gets placeholders, its tunnel (in the spec) the
            // real provider.
            session_config.provider = Some(ModelGuard::placeholder(provider));
        }
        let setup = setup_key(&session_config);
        let acquire = AcquireRequest {
            id: 0, // set by the actor
            key: key.clone(),
            spec: spec.clone(),
            conversation: conversation.clone(),
            compat: compat.clone(),
            setup: setup.clone(),
            gateway_key: req.session_key.clone(),
            fail_if_busy: req.fail_if_busy,
            wait,
            process_only: false,
            any_setup: req.runs_no_turn,
            traffic: purpose == LeasePurpose::Turns,
        };
        let limit = wait
            .saturating_add(spec.start_timeout)
            .saturating_add(ACQUIRE_SLACK);
        let grant: Grant = match inner
            .actor
            .call(
                |reply| PoolMsg::Acquire {
                    req: Box::new(acquire),
                    reply,
                },
                Some(limit),
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(result)) => result?,
            Ok(ractor::rpc::CallResult::Timeout) => {
                return Err(PoolError::WaitTimeout { after: limit });
            }
            _ => return Err(PoolError::Closed),
        };
        crate::metrics::lease_granted(crate::metrics::COPILOT_BACKEND, started.elapsed());

        // The open runs in a task of its own: a caller that gives up (a dropped lease
        // future) cannot cut it short between the runtime attaching the session and the
        // pool recording where. A lease finished for nobody is dropped, which returns the
        // conversation to the pool like any other.
        let opening = Opening {
            grant,
            conversation,
            session_key: req.session_key,
            compat,
            home,
            session_config,
            existing_only: req.existing_only,
            pinned: req.cli_session_id.clone(),
            handlers: req.handlers.clone(),
            working_directory: req.working_directory.clone(),
            bindings: inner.bindings.clone(),
            pool: inner.actor.clone(),
            abort_settle_timeout: inner.config.abort_settle_timeout,
            max_resume_crashes: inner.config.max_resume_crashes,
            // A compact's or reset's open is not how the conversation's turns open it (a
            // reset is about to delete it): a spare reopens it as its turns did.
            remember: (inner.config.warm_spares > 0
                && inner.config.warm_spare_conversations > 0
                && !req.runs_no_turn)
                .then(|| (key.clone(), setup)),
            purpose,
            deleting_by,
            reservation,
            max_conversations,
        };
        let span = tracing::Span::current();
        // Boxed: the open's future is ~13 KB, which a spawn would copy into its task more
        // than once (tokio boxes only futures over 16 KiB itself).
        let open = Box::pin(tracing::Instrument::instrument(opening.open(), span));
        match tokio::spawn(open).await {
            Ok(result) => result,
            Err(join) => Err(PoolError::Internal(format!(
                "the lease's open task failed: {join}"
            ))),
        }
    }

    /// How a worker of this home and these credentials is started.
    fn worker_spec(
        &self,
        req: &LeaseRequest,
        home: &Path,
        auth: &crate::auth::ResolvedAuth,
    ) -> Result<crate::worker::WorkerConfig, PoolError> {
        let mut spec = self.inner.config.worker.clone();
        spec.copilot_home = home.to_owned();
        spec.working_directory = home.to_owned();
        spec.auth_token = auth.token.clone();
        spec.auto_login = auth.mode == AuthMode::LoggedInUser;
        if let Some(provider) = &req.provider {
            // The guarded path: every model request of the child comes over its tunnel and
            // the pool makes it. The key holds the provider's fingerprint, so a worker
            // spawned from this spec serves only leases with this very provider.
            spec.model_tunnel = Some(
                self.inner
                    .guard
                    .tunnel_for(provider)
                    .map_err(|e| PoolError::InvalidRequest(e.to_string()))?,
            );
        }
        // The sandbox's walls follow the spec as set above (a BYOK key's model goes over
        // the tunnel, so its workers need no provider port).
        if let Some(template) = spec.sandbox.take() {
            spec.sandbox = Some(agent_sandbox(
                &template,
                req,
                home,
                &spec,
                self.inner.priming_port,
            )?);
        }
        Ok(spec)
    }

    /// Holds a process of the key `req` would lease on (its agent's home, credentials,
    /// provider and model; its session key and conversation fields are not used), for a call
    /// that names no conversation (`session.list`, `models.list`, `auth.getStatus`, …). The
    /// key's least busy usable process is used, even one full of conversations; with none, one
    /// is started within the pool's caps (waiting for room like a lease). No conversation is
    /// opened or counted. Credentials that name no GitHub identity (no token, the logged-in
    /// user forbidden) are accepted without a provider here: such a process answers what needs
    /// no account. Drop the lease to give the process back.
    pub async fn lease_process(&self, req: &LeaseRequest) -> Result<ProcessLease, PoolError> {
        let result = self.lease_process_inner(req).await;
        if let Err(error) = &result {
            crate::metrics::lease_rejected(COPILOT_BACKEND, error.kind());
        }
        result
    }

    async fn lease_process_inner(&self, req: &LeaseRequest) -> Result<ProcessLease, PoolError> {
        let inner = &self.inner;
        if *inner.closed.borrow() {
            return Err(PoolError::Closed);
        }
        let auth = crate::auth::resolve(&req.auth)?;
        if let Some(provider) = &req.provider {
            validate_provider(provider)?;
        }
        let home = resolve_copilot_home(
            req.copilot_home.as_deref(),
            req.agent_dir.as_deref(),
            &inner.config.agents_base_dir,
            &req.agent_id,
        )?;
        let key = PoolKey::new(&home, &auth, req.provider.as_ref(), req.model.as_deref());
        let spec = self.worker_spec(req, &home, &auth)?;
        let wait = req.wait_timeout.unwrap_or(inner.config.wait_timeout);
        let limit = wait
            .saturating_add(spec.start_timeout)
            .saturating_add(ACQUIRE_SLACK);
        let ask = AcquireRequest {
            id: 0, // set by the actor
            key,
            spec,
            conversation: String::new(),
            compat: String::new(),
            setup: String::new(),
            gateway_key: String::new(),
            fail_if_busy: false,
            wait,
            process_only: true,
            any_setup: false,
            traffic: false,
        };
        match inner
            .actor
            .call(
                |reply| PoolMsg::AcquireProcess {
                    req: Box::new(ask),
                    reply,
                },
                Some(limit),
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(result)) => result,
            Ok(ractor::rpc::CallResult::Timeout) => Err(PoolError::WaitTimeout { after: limit }),
            _ => Err(PoolError::Closed),
        }
    }

    /// Aborts the running turn of a conversation, wherever it runs (Copilot or a CLI
    /// backend); its lease sees the turn end `aborted` and the conversation continues.
    /// `Ok(false)` when the conversation has neither a Copilot lease with an open session nor
    /// a turn running on a CLI backend (nothing to abort).
    pub async fn abort(&self, conversation: &ConversationId) -> Result<bool, PoolError> {
        match self
            .inner
            .actor
            .call(
                |reply| PoolMsg::Abort {
                    conversation: conversation.key(),
                    reply,
                },
                Some(Duration::from_secs(10)),
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(aborted)) => Ok(aborted),
            Ok(ractor::rpc::CallResult::Timeout) => Err(actor_unanswered("the abort")),
            _ => Err(PoolError::Closed),
        }
    }

    /// Whether the conversation of `req` is leased or a lease of it waits (a pool that
    /// does not answer counts as not busy: the caller's own checks follow).
    async fn is_busy(&self, req: &LeaseRequest) -> bool {
        let conversation = ConversationId::new(&req.agent_id, &req.session_key).key();
        matches!(
            self.inner
                .actor
                .call(
                    |reply| PoolMsg::IsBusy {
                        conversation,
                        reply,
                    },
                    Some(Duration::from_secs(10)),
                )
                .await,
            Ok(ractor::rpc::CallResult::Success(true))
        )
    }

    /// A snapshot of workers, waiters and counters.
    pub async fn status(&self) -> Result<PoolStatus, PoolError> {
        match self
            .inner
            .actor
            .call(PoolMsg::Status, Some(Duration::from_secs(10)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(status)) => Ok(status),
            Ok(ractor::rpc::CallResult::Timeout) => Err(actor_unanswered("the status")),
            _ => Err(PoolError::Closed),
        }
    }

    /// Stops leasing, lets running turns (and CLI conversations' deletions) finish within the
    /// one grace period, aborts the rest, detaches every session and stops every worker
    /// (process groups killed).
    pub async fn shutdown(&self) -> Result<ShutdownReport, PoolError> {
        self.shutdown_unless(std::future::pending()).await
    }

    /// [`Pool::shutdown`], with the grace for running turns cut short when `cut_short`
    /// resolves first (the daemon's second signal: an operator who will not wait): the
    /// turns still running are aborted then, and everything else goes as in a shutdown.
    pub async fn shutdown_unless(
        &self,
        cut_short: impl std::future::Future<Output = ()>,
    ) -> Result<ShutdownReport, PoolError> {
        let actor = &self.inner.actor;
        self.inner.closed.send_replace(true);
        let call = Some(Duration::from_secs(30));
        let _ = actor.call(PoolMsg::Close, call).await;
        let mut leased = self.inner.leased.clone();
        let grace = self.inner.config.shutdown_grace;
        // One grace for every side: the CLI side's turns and deletions ran meanwhile.
        let deadline = tokio::time::Instant::now() + grace;
        let mut report = ShutdownReport::default();
        let settled = tokio::select! {
            settled = tokio::time::timeout(grace, leased.wait_for(|n| *n == 0)) => {
                settled.is_ok()
            }
            () = cut_short => false,
        };
        if !settled {
            if let Ok(ractor::rpc::CallResult::Success(n)) =
                actor.call(PoolMsg::AbortLeased, call).await
            {
                report.aborted_leases = n;
            }
            // Aborted turns end quickly; their leases return when dropped.
            let _ =
                tokio::time::timeout(Duration::from_secs(5), leased.wait_for(|n| *n == 0)).await;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.inner.cli.shutdown(left).await;
        let stop_limit = self.inner.config.worker.kill_grace * 2 + Duration::from_secs(10);
        let _ = actor.call(PoolMsg::StopAll, Some(stop_limit)).await;
        actor.stop(Some("shutdown".to_owned()));
        let _ = actor.wait(Some(stop_limit)).await;
        Ok(report)
    }
}

/// Closes the CLI backends' parked processes idle for `ttl`, every `every`, while the pool
/// lives.
/// The gateway tools of a CLI lease, checked as the MCP bridge takes them, each with a
/// timeout (its own, else the lease's `timeouts.tool`); refused for a backend that cannot
/// serve them (refused, not dropped: a conversation that counts on its tools must not run
/// without them).
fn cli_gateway_tools(
    cli: &cli::CliPool,
    req: &LeaseRequest,
) -> Result<Vec<crate::turn::GatewayTool>, PoolError> {
    if req.handlers.tools.is_empty() {
        return Ok(Vec::new());
    }
    if !cli.serves_gateway_tools(&req.backend)? {
        return Err(PoolError::InvalidRequest(format!(
            "backend `{}` cannot be leased with gateway tools: its CLI is not given the MCP \
             bridge that serves them (Claude Code's `cli-live` and `codex-cli` are); drop \
             `handlers.tools`, or run the conversation on one of those or on `copilot`",
            req.backend
        )));
    }
    #[cfg(feature = "mcp-bridge")]
    crate::backend::mcp_bridge::check_tools(&req.handlers.tools)
        .map_err(|e| PoolError::InvalidRequest(format!("backend `{}`: {e}", req.backend)))?;
    let limit = req.handlers.timeouts.tool;
    Ok(req
        .handlers
        .tools
        .iter()
        .cloned()
        .map(|mut tool| {
            tool.timeout.get_or_insert(limit);
            tool
        })
        .collect())
}

fn spawn_cli_maintenance(cli: &Arc<cli::CliPool>, ttl: Duration, every: Duration) {
    let weak = Arc::downgrade(cli);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(cli) = weak.upgrade() else { return };
            cli.close_idle(ttl);
        }
    });
}

/// The `session.create`/`session.resume` params of a lease. Token mode also gives the
/// session its own identity (`gitHubToken`) — except with a BYOK provider, which the runtime
/// refuses to combine with a session token ("Cannot specify both gitHubToken and provider").
/// Logged-in mode sets no session-level credential.
/// The key's sandbox: the template with the agent's own directory (its `COPILOT_HOME`'s
/// parent, where the work directory lies too, or the explicit home itself) and the ports of
/// [`worker_model_ports`]. A working directory the runtime could not write is refused here,
/// before anything starts.
fn agent_sandbox(
    template: &crate::sandbox::Sandbox,
    req: &LeaseRequest,
    home: &std::path::Path,
    spec: &crate::worker::WorkerConfig,
    priming_port: Option<u16>,
) -> Result<crate::sandbox::Sandbox, PoolError> {
    let agent_root = match (&req.copilot_home, home.parent()) {
        (None, Some(parent)) => parent,
        _ => home,
    };
    let ports = worker_model_ports(
        req.provider.as_ref(),
        spec.model_tunnel.is_some(),
        priming_port,
    );
    Ok(template.for_agent(agent_root, &ports)?)
}

/// The TCP ports a sandboxed worker connects to beyond its template's: none for a worker
/// whose model calls go over its tunnel; otherwise a BYOK provider's port (reached
/// directly), and the pool's priming sink, so a priming turn's call reaches it instead of
/// failing (which costs the runtime ~30 MiB). The sink's port adds no reach worth having:
/// it is one more port on any address, beside the template's 443 on any address.
fn worker_model_ports(
    provider: Option<&ProviderConfig>,
    tunnelled: bool,
    priming_port: Option<u16>,
) -> Vec<u16> {
    if tunnelled {
        return Vec::new();
    }
    provider
        .and_then(|p| crate::sandbox::url_port(&p.base_url))
        .into_iter()
        .chain(priming_port)
        .collect()
}

/// The sandbox of an agent's CLI backend processes: the workers' template with the agent's
/// own directory read and write (the parent of its `COPILOT_HOME`, which holds each
/// backend's home and the work directory; with an explicit home, the backend's home alone)
/// and TCP connect only to the model endpoint's port: the lease's provider `base_url`, else
/// a `*_BASE_URL` the backend's `env` sets (`ANTHROPIC_BASE_URL`, `GOOGLE_GEMINI_BASE_URL`,
/// its `baseUrlEnv`), else 443 (the CLI's own vendor API).
fn cli_sandbox(
    template: &crate::sandbox::Sandbox,
    req: &LeaseRequest,
    copilot_home: &std::path::Path,
    backend_home: &std::path::Path,
    config: &crate::backend::CliBackendConfig,
) -> Result<crate::sandbox::Sandbox, PoolError> {
    let agent_root = match (&req.copilot_home, copilot_home.parent()) {
        (None, Some(parent)) => parent,
        _ => backend_home,
    };
    Ok(template.for_cli_agent(agent_root, &cli_model_ports(req, config))?)
}

/// The TCP ports of a CLI backend's model endpoint (see [`cli_sandbox`]).
fn cli_model_ports(req: &LeaseRequest, config: &crate::backend::CliBackendConfig) -> Vec<u16> {
    let from_env = config.env.iter().filter_map(|(name, value)| {
        let named = name.ends_with("_BASE_URL") || config.base_url_env.as_ref() == Some(name);
        named.then_some(value.as_str())
    });
    let mut ports: Vec<u16> = match &req.provider {
        Some(provider) => crate::sandbox::url_port(&provider.base_url)
            .into_iter()
            .collect(),
        None => from_env.filter_map(crate::sandbox::url_port).collect(),
    };
    if ports.is_empty() {
        ports.push(crate::sandbox::HTTPS_PORT);
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

fn session_config(
    req: &LeaseRequest,
    auth: &crate::auth::ResolvedAuth,
    infinite_sessions: Option<&InfiniteSessions>,
) -> SessionConfig {
    let session_token = match (auth.mode, &req.provider) {
        (AuthMode::Token, None) => auth.token.clone(),
        _ => None,
    };
    let handlers = &req.handlers;
    let mut extra = serde_json::Map::new();
    // The session options cannot turn them on (not a field of theirs).
    without_command_files(&mut extra);
    if let Some(infinite) = infinite_sessions
        && let Ok(value) = serde_json::to_value(infinite)
    {
        extra.insert("infiniteSessions".to_owned(), value);
    }
    // The caller's options: the pool's defaults (infiniteSessions) give way to them, the
    // pool's own fields do not (the lease moved or refused those already; this is the
    // last guard against sending a field twice).
    let mut system_message = None;
    let mut excluded_tools = None;
    for (field, value) in req.session_options.fields() {
        match field.as_str() {
            "systemMessage" => system_message = Some(value.clone()),
            "excludedTools" => match serde_json::from_value(value.clone()) {
                Ok(tools) => excluded_tools = Some(tools),
                Err(_) => {
                    extra.insert(field.clone(), value.clone());
                }
            },
            f if SESSION_CONFIG_FIELDS.contains(&f) => {}
            _ => {
                extra.insert(field.clone(), value.clone());
            }
        }
    }
    SessionConfig {
        system_message,
        excluded_tools,
        model: req.model.clone(),
        reasoning_effort: req.reasoning_effort,
        provider: req.provider.clone(),
        git_hub_token: session_token,
        tools: handlers.tools.iter().map(|t| t.definition()).collect(),
        working_directory: Some(req.working_directory.display().to_string()),
        streaming: req.streaming,
        available_tools: req.available_tools.clone(),
        // Every permission prompt reaches the conversation's policy (reject-all by default).
        request_permission: true,
        request_user_input: handlers.user_input.is_some(),
        hooks: handlers.hooks.is_some(),
        env_value_mode: Some("direct".to_owned()),
        tool_filter_precedence: Some("excluded".to_owned()),
        extra,
        ..Default::default()
    }
}

/// The `session.create` fields that have the runtime take commands from files in the
/// session's directories: hooks (`.github/hooks/*.json`, `.github/copilot/settings.json`,
/// a `.claude/settings.json`; on when absent in runtime 1.0.14), and configuration it
/// discovers there, which may start local MCP servers (`.mcp.json`, `.vscode/mcp.json`;
/// off when absent, set all the same so that a runtime whose default changes stays shut).
pub const COMMAND_FILE_FIELDS: [&str; 2] = ["enableFileHooks", "enableConfigDiscovery"];

/// Sets each of [`COMMAND_FILE_FIELDS`] `false` in a session's config where it is unset
/// (absent or `null`), for every session the pool opens, resumes or deletes: hooks from
/// files are commands the runtime runs on its own at every session start and prompt, past
/// the permission policy, and a conversation's working directory holds whatever its tenant
/// put there. An explicit `true` stays (a client's own config, which the SDK endpoint passes
/// only where the daemon allows local commands).
pub fn without_command_files(extra: &mut serde_json::Map<String, serde_json::Value>) {
    for field in COMMAND_FILE_FIELDS {
        let value = extra.entry(field).or_insert(serde_json::Value::Null);
        if value.is_null() {
            *value = serde_json::Value::Bool(false);
        }
    }
}

/// The wire fields `SessionConfig` has typed fields for (and `session_config` sets from the
/// lease request itself); a caller's options never fill them through `extra`.
const SESSION_CONFIG_FIELDS: &[&str] = &[
    "sessionId",
    "model",
    "reasoningEffort",
    "clientName",
    "provider",
    "gitHubToken",
    "tools",
    "availableTools",
    "excludedTools",
    "toolFilterPrecedence",
    "requestPermission",
    "requestUserInput",
    "hooks",
    "streaming",
    "workingDirectory",
    "systemMessage",
    "envValueMode",
    "continuePendingWork",
];

/// What a lease is for: the credentials it needs and whether it is traffic of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeasePurpose {
    /// Turns, a compaction, a reset with the conversation's own credentials.
    Turns,
    /// Deleting a stored conversation ([`Pool::lease_to_delete`]).
    Deletion,
}

/// Whether a resume that failed with `error` counts as one that crashed the runtime: the
/// worker was `alive` when the resume was sent, and its runtime died as a runtime dies
/// (exited, closed its output, broke the protocol, hung), not stopped by the pool and not
/// killed from outside (SIGKILL: the OOM killer or an operator, which takes every resume in
/// flight on the process with it; the key's restart policy answers those).
fn resume_crashed(error: &WorkerError, alive: bool) -> bool {
    use crate::process::ExitInfo;
    use crate::worker::ExitReason;
    let on_its_own = |reason: &ExitReason| {
        !matches!(
            reason,
            ExitReason::Shutdown
                | ExitReason::Killed
                | ExitReason::ChildExited(ExitInfo::Signal(9))
                | ExitReason::TransportClosed(Some(ExitInfo::Signal(9)))
        )
    };
    alive && matches!(error, WorkerError::Died(exit) if on_its_own(&exit.reason))
}

/// A fingerprint of what a session was opened with beyond its compat key (tools, handler
/// flags, reasoning effort, the session options): an attached session opened differently is
/// resumed anew.
fn setup_key(config: &SessionConfig) -> String {
    let text = serde_json::json!({
        "systemMessage": config.system_message,
        "excludedTools": config.excluded_tools,
        "tools": config.tools,
        "requestPermission": config.request_permission,
        "requestUserInput": config.request_user_input,
        "hooks": config.hooks,
        "reasoningEffort": config.reasoning_effort,
        "streaming": config.streaming,
        "availableTools": config.available_tools,
        "extra": config.extra,
    })
    .to_string();
    crate::auth::fingerprint(&text)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Everything a granted lease needs to open its conversation, owned by the open task.
struct Opening {
    grant: Grant,
    conversation: String,
    session_key: String,
    compat: String,
    home: std::path::PathBuf,
    session_config: SessionConfig,
    existing_only: bool,
    pinned: Option<CliSessionId>,
    handlers: crate::turn::TurnHandlers,
    working_directory: std::path::PathBuf,
    bindings: Arc<BindingStore>,
    pool: ActorRef<PoolMsg>,
    abort_settle_timeout: Duration,
    max_resume_crashes: u32,
    /// The conversation's key and setup key when the pool keeps warm spares'
    /// conversations: the open is remembered ([`warm::Reopen`]).
    remember: Option<(PoolKey, String)>,
    /// What the lease is for: a deletion's open records no binding (its key's compat is
    /// not the conversation's; should the deletion be refused, the binding stays as its
    /// turns wrote it).
    purpose: LeasePurpose,
    /// The binding a deletion by name was pinned by, read before its grant: checked again
    /// once the deletion holds the conversation.
    deleting_by: Option<Binding>,
    /// A new conversation's place in its agent's count (`max_conversations_per_agent`),
    /// given back once its binding is written (which counts in its place) or the open fails.
    reservation: Option<crate::pool::bindings::Reservation>,
    /// `max_conversations_per_agent` where the lease counts toward it, checked again before
    /// a binding is written without a place.
    max_conversations: Option<usize>,
}

impl Opening {
    /// Opens the CLI session on the granted worker, records the binding (unless the session
    /// was resumed by it) and the transcript mirror, and builds the `Lease`. On any failure the grant is dropped armed, with what
    /// it may have left attached, and the pool detaches that with confirmation (or stops
    /// the worker) before the conversation is granted again.
    async fn open(self) -> Result<Lease, PoolError> {
        let Opening {
            mut grant,
            conversation,
            session_key,
            compat,
            home,
            session_config,
            existing_only,
            pinned,
            handlers,
            working_directory,
            bindings,
            pool,
            abort_settle_timeout,
            max_resume_crashes,
            remember,
            purpose,
            deleting_by,
            reservation,
            max_conversations,
        } = self;
        // A turn that ran between the deletion's read of the binding and its grant may have
        // started another session (its settings changed): that session is the one to
        // delete, so the deletion is refused as busy and retried, never run on the old one.
        if let Some(read) = deleting_by {
            let store = bindings.clone();
            match tokio::task::spawn_blocking(move || store.names_the_same_session(&read)).await {
                Ok(Ok(Some(true))) => {}
                Ok(Ok(Some(false))) => return Err(PoolError::ConversationBusy { session_key }),
                Ok(Ok(None)) => {
                    return Err(PoolError::NoSuchConversation {
                        session_key,
                        why: "it was deleted meanwhile",
                    });
                }
                Ok(Err(e)) => return Err(state_unwritable(&bindings, e.os_error())),
                Err(e) => return Err(PoolError::Internal(e.to_string())),
            }
        }
        let reopen = remember.map(|(key, setup)| {
            Box::new(warm::Reopen {
                key,
                conversation: conversation.clone(),
                compat: compat.clone(),
                setup,
                home: home.clone(),
                config: session_config.clone(),
                pinned: pinned.clone(),
            })
        });
        let worker_id = grant.worker_id;
        let worker = grant.worker.clone();
        let carried = grant.carried.take();
        let target = OpenTarget {
            worker: &worker,
            existing_only,
            pinned: pinned.as_ref(),
            session_key: &conversation,
            compat: &compat,
            home: &home,
            skip_resume: grant.resume_crashes >= max_resume_crashes,
            deleting: purpose == LeasePurpose::Deletion,
        };
        let opened = match target.open(carried, &bindings, session_config).await {
            Ok(opened) => opened,
            Err(failure) => {
                grant.maybe_attached = failure.maybe_attached;
                grant.resume_crashed = failure.resume_crashed;
                return Err(failure.error);
            }
        };
        let Opened {
            session,
            reason,
            stale_binding,
        } = opened;
        let cli_session_id = session.id().clone();
        if reason != OpenReason::Attached && session.already_in_use() {
            crate::metrics::ownership_violated();
            tracing::error!(
                %cli_session_id,
                "The runtime reports this session attached to another process (alreadyInUse); \
                 the one-owner rule was broken. Please report this."
            );
        }
        // A conversation still attached since its last lease wrote its binding then; one
        // `stat` checks it is still there (a lost state directory must not go unnoticed).
        // One resumed by its binding (not pinned) was just read from that binding, which
        // names this session under this key: nothing to write (a write is two fsyncs on the
        // turn's path, ~1 ms), unless the binding predates the working directory's record.
        let binding = Binding {
            session_key: conversation.clone(),
            cli_session_id: cli_session_id.clone(),
            compat_key: compat,
            updated_at_ms: now_ms(),
            working_directory: Some(working_directory.clone()),
        };
        let store = bindings.clone();
        // Still attached: its binding is checked with one `stat` here (no hop to the
        // blocking threads on a warm turn's path); written off the async threads otherwise.
        let attached = reason == OpenReason::Attached;
        let written = if reason == OpenReason::Resumed && pinned.is_none() && !stale_binding
            || purpose == LeasePurpose::Deletion
            || attached && matches!(bindings.is_present(&binding.session_key), Ok(true))
        {
            // Its binding is on disk: one the count missed counts now.
            if reservation.is_some() {
                bindings.note_bound(&binding.session_key);
            }
            Ok(())
        } else {
            // A binding about to be written by a lease that held no place is checked again
            // (a deletion may have removed it while the lease waited, and its turn would keep
            // the conversation anew): here, where a binding is written, so a warm turn of a
            // kept conversation pays nothing.
            let reservation = match (reservation, max_conversations) {
                (None, Some(max)) => match bindings.reserve_new(&conversation, max) {
                    Ok(held) => held,
                    Err(kept) => {
                        grant.opened = Some(session);
                        return Err(conversations_full(max, kept));
                    }
                },
                (held, _) => held,
            };
            let recorded = tokio::task::spawn_blocking(move || {
                if attached && store.is_present(&binding.session_key)? {
                    if reservation.is_some() {
                        store.note_bound(&binding.session_key);
                    }
                    return Ok(());
                }
                let put = store.put(&binding);
                // Written, the binding counts in its place.
                drop(reservation);
                put
            })
            .await;
            match recorded {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e.os_error()),
                Err(e) => Err(e.to_string()),
            }
        };
        if let Err(error) = written {
            // Not recorded, so not attached: a later resume must not miss these turns.
            grant.opened = Some(session);
            return Err(state_unwritable(&bindings, error));
        }
        let mut driver =
            crate::turn::driver::TurnDriver::new(handlers, working_directory, abort_settle_timeout);
        if let Err(error) = driver.open_transcript(cli_session_id.as_str()).await {
            grant.opened = Some(session);
            return Err(error.into());
        }
        crate::metrics::session_opened(crate::metrics::COPILOT_BACKEND, reason);
        let _ = pool.cast(PoolMsg::Opened {
            conversation: conversation.clone(),
            worker_id,
            cli_session_id: cli_session_id.clone(),
            reason,
            reopen,
        });
        grant.disarm();
        Ok(Lease {
            worker_pid: worker.pid(),
            session: Some(session),
            conversation,
            session_key,
            cli_session_id,
            worker_id,
            reason,
            pool,
            driver,
            turns: 0,
            sent: 0,
            lost: false,
            unsettled: false,
            sending: false,
            bindings,
            copilot_home: home,
        })
    }
}

/// The refusal of a new conversation of an agent that keeps `kept` (its `max`).
fn conversations_full(max: usize, kept: usize) -> PoolError {
    tracing::info!(
        kept,
        max,
        "A new conversation was refused: the agent keeps max_conversations_per_agent \
         conversations; it must delete one first."
    );
    PoolError::AgentConversationsFull { max }
}

/// The error for a binding store that cannot be read or written.
fn state_unwritable(bindings: &BindingStore, error: String) -> PoolError {
    tracing::error!(dir = %bindings.dir().display(), %error, "Could not read or record a conversation's binding; the lease fails.");
    PoolError::StateUnwritable {
        dir: bindings.dir().to_owned(),
        error,
    }
}

/// Why an open failed, and what it may have left attached on the granted worker.
struct OpenFailure {
    error: PoolError,
    /// A session id the worker may hold (the open timed out after it was sent).
    maybe_attached: Option<CliSessionId>,
    /// The resume crashed the runtime.
    resume_crashed: bool,
}

impl From<PoolError> for OpenFailure {
    fn from(error: PoolError) -> Self {
        OpenFailure {
            error,
            maybe_attached: None,
            resume_crashed: false,
        }
    }
}

/// Where and how a lease's CLI session is opened.
struct OpenTarget<'a> {
    worker: &'a WorkerHandle,
    existing_only: bool,
    /// The CLI session id the caller chose for this conversation.
    pinned: Option<&'a CliSessionId>,
    session_key: &'a str,
    compat: &'a str,
    home: &'a Path,
    /// Earlier resumes of this conversation crashed the runtime too often.
    skip_resume: bool,
    /// The open is a deletion's: a conversation whose stored state is gone is opened as an
    /// empty session under its id (which the deletion removes with its binding), where
    /// `existing_only` would refuse it and leave the binding for good.
    deleting: bool,
}

/// A lease's CLI session, opened.
struct Opened {
    session: Session,
    reason: OpenReason,
    /// Resumed by a binding written before bindings recorded the working directory: the
    /// lease's open writes it again, once, with the directory.
    stale_binding: bool,
}

impl From<(Session, OpenReason)> for Opened {
    fn from((session, reason): (Session, OpenReason)) -> Self {
        Opened {
            session,
            reason,
            stale_binding: false,
        }
    }
}

impl OpenTarget<'_> {
    /// Attaches the lease's CLI session on the granted worker: reuses the attached one,
    /// resumes the bound one, or creates a new one (with its reason).
    async fn open(
        &self,
        carried: Option<actor::Carried>,
        bindings: &Arc<BindingStore>,
        config: SessionConfig,
    ) -> Result<Opened, OpenFailure> {
        if let Some(carried) = carried {
            match carried.session {
                Some(session) if carried.same_worker && session.is_alive() => {
                    return Ok((session, OpenReason::Attached).into());
                }
                // One owner per CLI session id: detach from the old worker before resuming.
                Some(session) => {
                    let old = session.worker().clone();
                    let detached = session.detach().await;
                    if let Err(error) = holds_nothing_after(detached, &old).await {
                        // The old process may still hold the session: it must not live on.
                        tracing::warn!(%error, pid = old.pid(), "Detach failed; stopping the old worker before resuming.");
                        old.shutdown().await;
                    }
                }
                None => {}
            }
        }
        let store = bindings.clone();
        let key = self.session_key.to_owned();
        let binding = match tokio::task::spawn_blocking(move || store.get(&key)).await {
            Ok(Ok(binding)) => binding,
            // A state directory that cannot be read cannot record the conversation either.
            Ok(Err(e)) => return Err(state_unwritable(bindings, e.os_error()).into()),
            Err(e) => return Err(PoolError::Internal(e.to_string()).into()),
        };
        if let Some(id) = self.pinned {
            // Bound to this very session: a binding naming another one (the caller pinned
            // the conversation to a new session) says nothing of who holds this one.
            let bound = binding.as_ref().is_some_and(|b| b.cli_session_id == *id);
            return self
                .open_pinned(id, config, bound, bindings)
                .await
                .map(Opened::from);
        }
        let Some(binding) = binding else {
            return self.create(config, OpenReason::New).await.map(Opened::from);
        };
        if binding.compat_key != self.compat {
            return self
                .create(config, OpenReason::CompatChanged)
                .await
                .map(Opened::from);
        }
        let stale_binding = binding.working_directory.is_none();
        let id = binding.cli_session_id;
        if !self.home.join("session-state").join(id.as_str()).is_dir() {
            return self
                .create(config, OpenReason::TranscriptMissing)
                .await
                .map(Opened::from);
        }
        if self.skip_resume {
            tracing::warn!(
                cli_session_id = %id,
                "Resuming this conversation crashed the runtime repeatedly; starting a new session."
            );
            return self
                .create(config, OpenReason::ResumeFailed)
                .await
                .map(Opened::from);
        }
        let resume = SessionConfig {
            session_id: id.to_string(),
            continue_pending_work: Some(false),
            ..config.clone()
        };
        let alive = self.worker.exit().is_none();
        match self.worker.open_for_pool(resume, true).await {
            Ok((session, _)) => Ok(Opened {
                session,
                reason: OpenReason::Resumed,
                stale_binding,
            }),
            Err(error) if is_not_found(&error) => self
                .create(config, OpenReason::NotFound)
                .await
                .map(Opened::from),
            Err(error @ WorkerError::Died(_)) => Err(OpenFailure {
                resume_crashed: resume_crashed(&error, alive),
                error: error.into(),
                maybe_attached: None,
            }),
            Err(error) => Err(failed_open(error, id)),
        }
    }

    /// Opens a conversation whose CLI session id the caller chose: its stored session is
    /// resumed when its state is under the home (whatever the binding says: the caller names
    /// the session), else a session is created with that id.
    async fn open_pinned(
        &self,
        id: &CliSessionId,
        config: SessionConfig,
        bound: bool,
        bindings: &Arc<BindingStore>,
    ) -> Result<(Session, OpenReason), OpenFailure> {
        let stored = self.home.join("session-state").join(id.as_str()).is_dir();
        if stored && !bound {
            // A stored session this conversation never bound: it must not be another
            // conversation's (an SDK session naming an HTTP conversation's CLI session).
            self.refuse_if_bound_elsewhere(id, bindings).await?;
        }
        if !stored {
            let reason = if bound {
                OpenReason::TranscriptMissing
            } else {
                OpenReason::New
            };
            return self.create_with(config, reason, id.clone()).await;
        }
        if self.skip_resume {
            // A new session cannot take the id of a stored one.
            return Err(PoolError::ResumeCrashedRepeatedly {
                session_key: self.session_key.to_owned(),
                window: placement::RESUME_CRASH_WINDOW,
            }
            .into());
        }
        let resume = SessionConfig {
            session_id: id.to_string(),
            continue_pending_work: config.continue_pending_work.or(Some(false)),
            ..config.clone()
        };
        let alive = self.worker.exit().is_none();
        match self.worker.open_for_pool(resume, true).await {
            Ok((session, _)) => Ok((session, OpenReason::Resumed)),
            // Created but never written to: nothing to resume.
            Err(error) if is_not_found(&error) => {
                self.create_with(config, OpenReason::NotFound, id.clone())
                    .await
            }
            Err(error @ WorkerError::Died(_)) => Err(OpenFailure {
                resume_crashed: resume_crashed(&error, alive),
                error: error.into(),
                maybe_attached: None,
            }),
            Err(error) => Err(failed_open(error, id.clone())),
        }
    }

    /// Fails when another conversation of this agent is bound to the CLI session `id`: a CLI
    /// session holds one conversation (an HTTP conversation's session is not an SDK
    /// session's, and the other way round). Reads the bindings' index entry of `id` and the
    /// binding it names: what it costs does not grow with the bindings.
    async fn refuse_if_bound_elsewhere(
        &self,
        id: &CliSessionId,
        bindings: &Arc<BindingStore>,
    ) -> Result<(), OpenFailure> {
        let store = bindings.clone();
        let (key, session) = (self.session_key.to_owned(), id.clone());
        let owner = match tokio::task::spawn_blocking(move || store.bound_elsewhere(&key, &session))
            .await
        {
            Ok(Ok(owner)) => owner,
            Ok(Err(e)) => return Err(state_unwritable(bindings, e.os_error()).into()),
            Err(e) => return Err(PoolError::Internal(e.to_string()).into()),
        };
        match owner {
            None => Ok(()),
            Some(owner) => {
                let key = ConversationId::split_key(&owner.session_key)
                    .map_or("", |(_, key)| key)
                    .to_owned();
                let kind = if key.starts_with(crate::ids::SDK_SESSION_KEY_PREFIX) {
                    "an SDK session"
                } else {
                    "an HTTP conversation"
                };
                Err(PoolError::InvalidRequest(format!(
                    "session {id} holds the conversation {key:?} of this agent ({kind}), not \
                     this one; one session holds one conversation: continue it where it \
                     belongs (an HTTP conversation through the HTTP API), or use a new \
                     session id"
                ))
                .into())
            }
        }
    }

    async fn create(
        &self,
        config: SessionConfig,
        reason: OpenReason,
    ) -> Result<(Session, OpenReason), OpenFailure> {
        // The id is ours, so a create that times out can still be detached by it.
        self.create_with(config, reason, CliSessionId::random())
            .await
    }

    async fn create_with(
        &self,
        mut config: SessionConfig,
        reason: OpenReason,
        id: CliSessionId,
    ) -> Result<(Session, OpenReason), OpenFailure> {
        if self.existing_only && !(self.deleting && reason == OpenReason::TranscriptMissing) {
            let why = match reason {
                OpenReason::CompatChanged => "its model, provider, directory or account differ",
                OpenReason::TranscriptMissing => "its stored state is gone",
                OpenReason::NotFound => "the runtime does not know it",
                OpenReason::ResumeFailed => "resuming it crashed the runtime",
                _ => "it was never started",
            };
            return Err(PoolError::NoSuchConversation {
                session_key: self.session_key.to_owned(),
                why,
            }
            .into());
        }
        config.session_id = id.as_str().to_owned();
        match self.worker.open_for_pool(config, false).await {
            Ok((session, _)) => Ok((session, reason)),
            Err(error) => Err(failed_open(error, id)),
        }
    }
}

/// An open of session `id` failed: after a timeout the runtime may hold it anyway.
fn failed_open(error: WorkerError, id: CliSessionId) -> OpenFailure {
    let maybe_attached = matches!(
        error,
        WorkerError::Rpc(crate::rpc::RpcError::Timeout { .. })
    )
    .then_some(id);
    OpenFailure {
        error: error.into(),
        maybe_attached,
        resume_crashed: false,
    }
}

/// The runtime's answer to a resume (or detach) of a session it does not know (reference
/// §10.4: "Session not found for sessionId: <id>").
fn is_not_found(error: &WorkerError) -> bool {
    match error {
        WorkerError::Rpc(e) => {
            let text = e.to_string().to_ascii_lowercase();
            text.contains("session not found") || text.contains("no such session")
        }
        _ => false,
    }
}

/// What a call that lets a session go (`session.detach`, `session.delete`) on `worker`
/// leaves: `Ok` once the process holds the session no more: it answered, it is gone
/// (`Died` is published once the process is reaped), or it was stopping in an orderly way
/// (waited for until it is gone: `shutdown` returns then). Any other error: the process may
/// still hold the session.
pub(crate) async fn holds_nothing_after(
    result: Result<(), WorkerError>,
    worker: &WorkerHandle,
) -> Result<(), WorkerError> {
    match result {
        Ok(()) | Err(WorkerError::Died(_)) => Ok(()),
        Err(WorkerError::Stopped) => {
            worker.shutdown().await;
            Ok(())
        }
        Err(error) => Err(error),
    }
}

/// A call of the pool's actor that got no answer in its time (not a shut down pool, which
/// drops the call: `PoolError::Closed`).
fn actor_unanswered(what: &str) -> PoolError {
    PoolError::Internal(format!(
        "the pool did not answer {what} within 10 s (its actor is overloaded or stuck); \
         retry, and if it keeps happening look at the log for what holds it up"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{LeaseAuth, resolve};
    use crate::rpc::messages::ProviderConfig;
    use crate::secret::Secret;

    #[test]
    fn a_resume_counts_as_crashing_its_runtime_only_when_the_runtime_died_on_its_own() {
        use crate::process::ExitInfo;
        use crate::worker::{ExitReason, WorkerExit};
        let died = |reason| {
            WorkerError::Died(WorkerExit {
                reason,
                pid: 1,
                stderr_tail: String::new(),
            })
        };
        let crashed = died(ExitReason::ChildExited(ExitInfo::Code(7)));
        assert!(resume_crashed(&crashed, true));
        assert!(resume_crashed(
            &died(ExitReason::TransportClosed(None)),
            true
        ));
        // The worker was dead before the resume went out: nothing to blame it on.
        assert!(!resume_crashed(&crashed, false));
        // Stopped by the pool.
        assert!(!resume_crashed(&died(ExitReason::Shutdown), true));
        assert!(!resume_crashed(&died(ExitReason::Killed), true));
        // Killed from outside (the OOM killer, an operator).
        let sigkill = ExitReason::ChildExited(ExitInfo::Signal(9));
        assert!(!resume_crashed(&died(sigkill), true));
        let sigsegv = ExitReason::ChildExited(ExitInfo::Signal(11));
        assert!(resume_crashed(&died(sigsegv), true));
        assert!(!resume_crashed(&WorkerError::Stopped, true));
    }

    #[test]
    fn command_files_left_unset_are_turned_off_and_an_answer_given_is_kept() {
        use serde_json::{Value, json};
        let off = json!({"enableFileHooks": false, "enableConfigDiscovery": false});
        for unset in [json!({}), json!({"enableFileHooks": null})] {
            let Value::Object(mut extra) = unset else {
                unreachable!()
            };
            without_command_files(&mut extra);
            assert_eq!(Value::Object(extra), off);
        }
        let Value::Object(mut on) = json!({"enableFileHooks": true, "model": "m"}) else {
            unreachable!()
        };
        without_command_files(&mut on);
        assert_eq!(
            Value::Object(on),
            json!({"enableFileHooks": true, "enableConfigDiscovery": false, "model": "m"})
        );
    }

    #[test]
    fn a_sandboxed_worker_without_a_tunnel_may_reach_the_priming_sink_and_its_provider() {
        let provider = ProviderConfig::openai("http://10.0.0.7:8080/v1", None);
        // Token mode: the runtime's own API is the template's 443; the sink is added.
        assert_eq!(worker_model_ports(None, false, Some(41234)), vec![41234]);
        // A BYOK provider reached directly: its port and the sink's.
        assert_eq!(
            worker_model_ports(Some(&provider), false, Some(41234)),
            vec![8080, 41234]
        );
        // No sink (it could not be bound): the provider's port alone.
        assert_eq!(worker_model_ports(Some(&provider), false, None), vec![8080]);
        // Every model call over the tunnel (the guard answers the priming): nothing more.
        assert!(worker_model_ports(Some(&provider), true, Some(41234)).is_empty());
    }

    fn request(auth: LeaseAuth, provider: Option<ProviderConfig>) -> LeaseRequest {
        let mut req = LeaseRequest::new("a", "s", "/w".into());
        req.auth = auth;
        req.provider = provider;
        req
    }

    #[test]
    fn a_cli_backend_may_connect_to_its_providers_port_else_its_envs_base_url_else_https() {
        let claude = crate::backend::CliBackendConfig::claude_cli();
        let with = |url: &str| {
            request(
                LeaseAuth::default(),
                Some(ProviderConfig::openai(url, None)),
            )
        };
        assert_eq!(
            cli_model_ports(&with("http://127.0.0.1:41234"), &claude),
            [41234]
        );
        let bare = request(LeaseAuth::default(), None);
        assert_eq!(cli_model_ports(&bare, &claude), [443]);
        let mut gemini = crate::backend::CliBackendConfig::google_gemini_cli();
        gemini
            .env
            .insert("GOOGLE_GEMINI_BASE_URL".into(), "http://[::1]:9000".into());
        gemini.env.insert("OTHER".into(), "http://h:1".into());
        assert_eq!(cli_model_ports(&bare, &gemini), [9000]);
        // The provider's endpoint is the one the lease uses.
        assert_eq!(
            cli_model_ports(&with("https://m.example/v1"), &gemini),
            [443]
        );

        let dir = tempfile::tempdir().unwrap();
        let copilot_home = dir.path().join("agents/a/copilot");
        let backend_home = dir.path().join("agents/a/claude-cli");
        let template =
            crate::sandbox::Sandbox::new("/bin/wrapper".into(), vec!["sandbox-exec".into()]);
        let s = cli_sandbox(&template, &bare, &copilot_home, &backend_home, &claude).unwrap();
        assert_eq!(s.read_write, [dir.path().join("agents/a")]);
        assert_eq!(s.allowed_ports(), Some(vec![443]));
        // An explicit COPILOT_HOME names no agent directory: the backend's home alone.
        let mut explicit = with("http://127.0.0.1:8080");
        explicit.copilot_home = Some(copilot_home.clone());
        let s = cli_sandbox(&template, &explicit, &copilot_home, &backend_home, &claude).unwrap();
        assert_eq!(s.read_write, [backend_home]);
        assert_eq!(s.allowed_ports(), Some(vec![8080]));
    }

    #[test]
    fn every_typed_session_config_field_is_listed_so_options_never_send_one_twice() {
        let config = SessionConfig {
            session_id: "s".into(),
            model: Some("m".into()),
            reasoning_effort: Some(crate::kinds::ReasoningEffort::Low),
            client_name: Some("c".into()),
            provider: Some(ProviderConfig::openai("http://m/v1", None)),
            git_hub_token: Some(Secret::new("t")),
            tools: vec![crate::rpc::messages::ToolDefinition {
                name: "t".into(),
                description: String::new(),
                parameters: serde_json::json!({}),
                skip_permission: None,
                overrides_built_in_tool: None,
            }],
            available_tools: Some(vec![]),
            excluded_tools: Some(vec![]),
            tool_filter_precedence: Some("excluded".into()),
            working_directory: Some("/w".into()),
            system_message: Some(serde_json::json!({})),
            env_value_mode: Some("direct".into()),
            continue_pending_work: Some(false),
            ..Default::default()
        };
        let wire = serde_json::to_value(&config).unwrap();
        let wire = wire.as_object().unwrap();
        let mut typed: Vec<&str> = wire.keys().map(String::as_str).collect();
        typed.sort_unstable();
        let mut listed = SESSION_CONFIG_FIELDS.to_vec();
        listed.sort_unstable();
        assert_eq!(typed, listed);
    }

    #[test]
    fn session_options_reach_the_params_and_the_pools_own_fields_win() {
        let mut req = request(LeaseAuth::default(), None);
        req.model = Some("pool-model".into());
        req.apply_session_options(
            crate::session_options::SessionOptions::from_value(serde_json::json!({
                "systemMessage": {"mode": "replace", "content": "Be terse."},
                "excludedTools": ["builtin:bash"],
                "infiniteSessions": {"enabled": false},
                "enableCitations": true,
                "workingDirectory": "/elsewhere",
                "streaming": false,
            }))
            .unwrap(),
        )
        .unwrap();
        let infinite = InfiniteSessions {
            enabled: true,
            background_compaction_threshold: None,
            buffer_exhaustion_threshold: None,
        };
        let auth = resolve(&req.auth).unwrap();
        let wire = serde_json::to_value(session_config(&req, &auth, Some(&infinite))).unwrap();
        assert_eq!(wire["systemMessage"]["content"], "Be terse.");
        assert_eq!(wire["excludedTools"], serde_json::json!(["builtin:bash"]));
        // The caller's options replace the pool's default.
        assert_eq!(wire["infiniteSessions"]["enabled"], false);
        assert_eq!(wire["enableCitations"], true);
        assert_eq!(wire["workingDirectory"], "/elsewhere");
        assert_eq!(wire["streaming"], false);
        assert_eq!(wire["model"], "pool-model");
        assert_eq!(wire["requestPermission"], true);
        // The model differs from the request's own: refused, naming both places.
        let mut conflict = request(LeaseAuth::default(), None);
        conflict.model = Some("a".into());
        let e = conflict
            .apply_session_options(
                crate::session_options::SessionOptions::from_value(
                    serde_json::json!({"model": "b"}),
                )
                .unwrap(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("session.model"), "{e}");
    }

    #[test]
    fn token_mode_sets_the_session_token_unless_byok_and_logged_in_mode_never() {
        let token = LeaseAuth {
            github_token: Some(Secret::new("ghu_x")),
            profile_id: Some("p".into()),
            profile_version: Some("v".into()),
            ..Default::default()
        };
        let req = request(token.clone(), None);
        let auth = resolve(&req.auth).unwrap();
        assert_eq!(
            session_config(&req, &auth, None)
                .git_hub_token
                .as_ref()
                .map(Secret::expose),
            Some("ghu_x")
        );
        let byok = request(token, Some(ProviderConfig::openai("http://m/v1", None)));
        let auth = resolve(&byok.auth).unwrap();
        assert!(session_config(&byok, &auth, None).git_hub_token.is_none());
        let logged_in = request(
            LeaseAuth {
                use_logged_in_user: true,
                github_token: Some(Secret::new("ghu_ignored")),
                ..Default::default()
            },
            None,
        );
        let auth = resolve(&logged_in.auth).unwrap();
        assert!(
            session_config(&logged_in, &auth, None)
                .git_hub_token
                .is_none()
        );
        assert!(auth.token.is_none());
    }
}
