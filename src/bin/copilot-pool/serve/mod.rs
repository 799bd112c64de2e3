//! `copilot-pool serve`: the pool as a sidecar for gateways in any language. Owns the
//! daemon's lifecycle: configuration, the Prometheus recorder, listeners, signals and the
//! drain. The HTTP API itself is the library's (`copilot_pool::http`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use copilot_pool::group_ledger::{GroupLedger, LEDGER_FILE};
use copilot_pool::http::{self, ApiConfig, ConnectionLimits};
use copilot_pool::kinds::SandboxMode;
use copilot_pool::pool::Pool;
use copilot_pool::runtime;
use copilot_pool::sandbox::{Sandbox, SandboxStatus};
use copilot_pool::sdk_endpoint::{self, SdkConfig, SdkEndpoint};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::sync::watch;

use crate::config::{API_TOKEN_ENV, ConfigRefused, ListenAddress, LogFormat, ServeConfig};

#[derive(Args)]
pub struct ServeArgs {
    /// TOML config file (every field is optional; see README).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// HTTP API address: HOST:PORT (default 127.0.0.1:7878; port 0 picks a free one), or
    /// unix:PATH for a Unix socket (created owner-only; needs an API token).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<ListenAddress>,
    /// Where bindings are stored.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// A file holding the bearer token for `/v1`, readable by its owner only (over the
    /// config file's `api_token`, which is over COPILOT_POOL_API_TOKEN).
    #[arg(long, value_name = "PATH")]
    pub api_token_file: Option<PathBuf>,
    /// Refused: a token on the command line is visible to every local user in `ps`.
    #[arg(long, hide = true, value_name = "TOKEN")]
    pub api_token: Option<String>,
    /// A separate address for `/metrics`.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// `human` or `json` log lines.
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// The daemon's async threads (default one per eight CPUs, at least one).
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,
    /// The runtime executable.
    #[arg(long)]
    pub cli: Option<PathBuf>,
    /// Also serve the SDK endpoint (the runtime's own JSON-RPC, for an official Copilot SDK
    /// attached by URL) on HOST:PORT or unix:PATH; tokens come from `[[sdk.tokens]]`.
    #[arg(long, value_name = "ADDR")]
    pub sdk_listen: Option<String>,
}

impl ServeArgs {
    /// The configuration: file, then flags.
    pub fn config(&self) -> Result<ServeConfig> {
        let mut config = ServeConfig::load(self.config.as_deref())?;
        if let Some(listen) = &self.listen {
            config.listen = listen.clone();
        }
        if let Some(dir) = &self.state_dir {
            config.state_dir = Some(dir.clone());
        }
        if self.api_token.is_some() {
            bail!("{}", crate::config::TOKEN_ON_ARGV);
        }
        if let Some(path) = &self.api_token_file {
            config.api_token = Some(crate::config::read_token_file(path)?);
        }
        if let Some(addr) = self.metrics_listen {
            config.metrics_listen = Some(addr);
        }
        if let Some(format) = self.log_format {
            config.log_format = format;
        }
        if let Some(threads) = self.worker_threads {
            config.worker_threads = Some(threads);
        }
        if let Some(cli) = &self.cli {
            config.cli_path = Some(cli.clone());
        }
        if let Some(addr) = &self.sdk_listen {
            config.sdk.listen = Some(addr.clone());
        }
        config.validate()?;
        Ok(config)
    }
}

/// The exposition, with the daemon's own gauges set first.
fn render(handle: &PrometheusHandle) -> String {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        ::metrics::gauge!(copilot_pool::metrics::DAEMON_TASKS)
            .set(runtime.metrics().num_alive_tasks() as f64);
    }
    if let Some(heap) = crate::heap::figures() {
        ::metrics::gauge!(copilot_pool::metrics::DAEMON_HEAP_BYTES).set(heap.live_bytes as f64);
    }
    handle.render()
}

fn install_metrics() -> Result<PrometheusHandle> {
    let mut builder = PrometheusBuilder::new();
    for name in copilot_pool::metrics::HISTOGRAMS {
        builder = builder
            .set_buckets_for_metric(
                Matcher::Full((*name).to_owned()),
                copilot_pool::metrics::SECONDS_BUCKETS,
            )
            .context("histogram buckets")?;
    }
    let handle = builder
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    copilot_pool::metrics::describe();
    copilot_pool::metrics::register_zeroes();
    Ok(handle)
}

pub async fn serve(args: ServeArgs) -> Result<()> {
    // Not dumpable: a process of this user without CAP_SYS_PTRACE (every worker and tool)
    // cannot read this one's environment (`/proc/<pid>/environ`: the API token in container
    // deployments) or memory.
    nix::sys::prctl::set_dumpable(false)
        .context("marking the daemon non-dumpable (prctl PR_SET_DUMPABLE)")?;
    // Signal handlers first: a SIGTERM at any point after this drains cleanly.
    let mut signals = Signals::new()?;
    let config = args.config().map_err(ConfigRefused)?;
    // A runtime not there yet is no configuration refused (1: it may be installed before
    // the next start, by an init container say).
    let located = runtime::locate(config.cli_path.as_deref(), runtime::process_env)?;
    // Off the first lease's path: compiling the session options schema took ~16 ms there.
    copilot_pool::session_options::compile_schema()
        .context("compiling the embedded session options schema")?;
    let metrics = install_metrics()?;
    let upkeep = {
        let handle = metrics.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                handle.run_upkeep();
            }
        })
    };

    let mut api_config = api_config(&config, &metrics);
    if config.auth.env_fallback {
        // Read once, here: the library never reads the process environment.
        api_config.env_tokens = crate::config::env_tokens(|name| std::env::var_os(name))?;
        if api_config.env_tokens.is_empty() {
            tracing::warn!(
                "[auth] env_fallback is on but none of OPENCLAW_GITHUB_TOKEN, \
                 COPILOT_GITHUB_TOKEN, GH_TOKEN, GITHUB_TOKEN is set: requests without a token \
                 get no fallback."
            );
        }
    }
    // The listeners are bound first: their ports are walls of the workers' sandbox.
    let listener = bind(&config.listen, "the API", "listen").await?;
    let metrics_listener = match config.metrics_listen {
        Some(metrics_addr) => Some(
            tokio::net::TcpListener::bind(metrics_addr)
                .await
                .with_context(|| format!("binding {metrics_addr}"))?,
        ),
        None => None,
    };
    let sdk_listener = match config.sdk.listen()? {
        Some(listen) => Some(bind(&listen, "the SDK endpoint", "[sdk] listen").await?),
        None => None,
    };
    let mut own_ports = Vec::new();
    for bound in std::iter::once(&listener).chain(&sdk_listener) {
        if let Bound::Tcp(l) = bound {
            own_ports.push(l.local_addr().context("local address")?.port());
        }
    }
    if let Some(l) = &metrics_listener {
        own_ports.push(l.local_addr().context("local address")?.port());
    }
    let (sandbox, sandbox_status) = sandbox_setup(&config, &own_ports).await?;
    if !sandbox_status.tcp_connect && config.api_token.is_none() {
        return Err(ConfigRefused(anyhow::anyhow!(
            "{}",
            api_unguarded_message(config.sandbox, Some(&sandbox_status))
        ))
        .into());
    }
    api_config.sandbox = Some(sandbox_status);
    let mut pool_config = config
        .pool_config(located.path.clone())
        .map_err(ConfigRefused)?;
    if let Some(template) = &sandbox {
        crate::sandbox::refuse_shared_daemon_places(
            template,
            Some(&located.path),
            &config,
            args.config.as_deref(),
            args.api_token_file.as_deref(),
        )
        .map_err(ConfigRefused)?;
    }
    pool_config.worker.sandbox = sandbox;
    pool_config.worker.group_ledger = Some(take_over(&pool_config.state_dir).await?);
    let pool = Pool::start(pool_config).await?;
    let backends = pool.backend_ids();
    for backend in &backends {
        // The `backend` label's values: `copilot` and the configured CLI ids.
        copilot_pool::metrics::register_backend_zeroes(backend);
    }
    copilot_pool::metrics::register_fallback_zeroes(
        &backends,
        &copilot_pool::fallback::FallbackClass::ALL.map(|c| c.label()),
    );
    let (app, api) = http::router_with_handle(pool.clone(), api_config);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut stop: watch::Receiver<bool>| async move {
        // The sender outlives every server (it is dropped at the end of `serve`).
        let _ = stop.wait_for(|s| *s).await;
    };
    // Each server's task, with what it serves (for the log if one ends on its own).
    let mut servers: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    let mut served: Vec<&'static str> = Vec::new();
    // The SDK endpoint serves before the API's address is announced, so a client that waits
    // for that line finds both.
    let sdk = match sdk_listener {
        Some(listener) => {
            let mut sdk_config = SdkConfig::new(config.sdk.tokens()?);
            sdk_config.max_connections = config.sdk.max_connections;
            sdk_config.max_unauthenticated_connections = config.sdk.max_unauthenticated_connections;
            sdk_config.max_connections_per_agent = config.sdk.max_connections_per_agent;
            sdk_config.max_sessions_per_connection = config.sdk.max_sessions_per_connection;
            sdk_config.allow_logged_in_user = config.auth.allow_logged_in_user;
            sdk_config.allow_local_mcp_servers = config.allow_local_mcp_servers;
            sdk_config.allowed_work_roots = config.allowed_work_roots.clone();
            // One limit on a turn's length, over HTTP and through the SDK endpoint.
            sdk_config.max_turn_duration = config.timeouts().absolute;
            let endpoint = SdkEndpoint::new(pool.clone(), sdk_config);
            servers.push(serve_sdk(&endpoint, listener, stopped(stop_rx.clone())));
            served.push("the SDK endpoint");
            Some(endpoint)
        }
        None => None,
    };
    let at = match &listener {
        Bound::Tcp(l) => format!("http://{}", l.local_addr().context("local address")?),
        Bound::Unix(_, file) => format!("unix:{}", file.path.display()),
    };
    say(Out::Stdout, format_args!("listening on {at}"));
    let threads = tokio::runtime::Handle::current().metrics().num_workers();
    tracing::info!(%at, runtime = %located.path.display(), worker_threads = threads, "copilot-pool serve is up.");

    let mut limits = ConnectionLimits::default();
    limits.header_read_timeout = config.header_read_timeout();
    limits.idle_timeout = config.idle_timeout();
    limits.max_connections = connection_cap(config.max_connections, config.pool.max_processes);
    if let Some(metrics_listener) = metrics_listener {
        say(
            Out::Stdout,
            format_args!(
                "metrics on http://{}",
                metrics_listener.local_addr().context("local address")?
            ),
        );
        let handle = metrics.clone();
        let metrics_app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let handle = handle.clone();
                async move { render(&handle) }
            }),
        );
        let mut metrics_limits = limits;
        metrics_limits.max_connections = METRICS_MAX_CONNECTIONS;
        metrics_limits.setting = "nothing: the metrics listener's cap is fixed; scrape less often";
        servers.push(tokio::spawn(http::serve(
            metrics_listener,
            metrics_app,
            metrics_limits,
            stopped(stop_rx.clone()),
        )));
        served.push("the metrics listener");
    }
    let api_stopped = stopped(stop_rx.clone());
    servers.push(match listener {
        Bound::Tcp(l) => tokio::spawn(http::serve(l, app, limits, api_stopped)),
        Bound::Unix(l, file) => tokio::spawn(async move {
            http::serve(l, app, limits, api_stopped).await;
            drop(file);
        }),
    });
    served.push("the API");

    // A server's task ends only once told to stop: one that ends before (it panicked)
    // leaves a daemon that looks alive and serves nothing there, so the daemon drains and
    // exits 1 for its supervisor to restart it.
    let (signal, server_ended) = tokio::select! {
        signal = signals.next() => (signal, None),
        (ended, at, _) = futures_util::future::select_all(servers.iter_mut()) => {
            let what = served.get(at).copied().unwrap_or("a server");
            let why = match ended {
                Ok(()) => "it stopped".to_owned(),
                Err(e) => e.to_string(),
            };
            tracing::error!(server = what, %why, "A server of the daemon ended on its own; draining.");
            ("a server's end", Some(format!("{what} ended on its own ({why})")))
        }
    };
    tracing::info!(signal, "Draining.");
    say(
        Out::Stderr,
        format_args!("copilot-pool serve: {signal}, draining"),
    );
    // Not ready, no new turns; answers to running turns are still accepted.
    api.set_draining();
    if let Some(sdk) = &sdk {
        sdk.set_draining();
    }
    // Running turns get the drain grace (the pool's shutdown grace), then are aborted;
    // sessions are detached and every process group is stopped.
    // A second signal cuts the grace short: the turns still running are aborted at once.
    let second = async {
        let again = signals.next().await;
        say(
            Out::Stderr,
            format_args!("copilot-pool serve: {again} again, aborting the running turns"),
        );
    };
    let report = pool.shutdown_unless(second).await?;
    if report.aborted_leases > 0 {
        tracing::warn!(
            aborted = report.aborted_leases,
            "Turns still running after the drain grace were aborted."
        );
    }
    // Each wait below is shared by every surface (5 s in all, not per surface), so the
    // whole stop stays within the drain grace + 30 s the deployment files allow.
    let turns_finished = async {
        tokio::join!(api.turns_finished(), async {
            if let Some(sdk) = &sdk {
                sdk.turns_finished().await;
            }
        })
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), turns_finished).await;
    stop_tx.send_replace(true);
    // A task already ended is not awaited again.
    servers.retain(|server| !server.is_finished());
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        futures_util::future::join_all(servers),
    )
    .await;
    upkeep.abort();
    say(Out::Stderr, format_args!("copilot-pool serve: stopped"));
    match server_ended {
        Some(why) => bail!("{why}; the daemon drained and stopped, restart it"),
        None => Ok(()),
    }
}

/// A bound listener of the API or the SDK endpoint.
enum Bound {
    Tcp(tokio::net::TcpListener),
    /// A Unix socket and its file.
    Unix(tokio::net::UnixListener, SocketFile),
}

/// A Unix socket's file, removed when dropped: when its listener's server ends, or when the
/// daemon fails to start after binding it. Only the file this daemon bound is removed: a
/// successor started on the same path meanwhile (it replaced the file as stale once this
/// daemon stopped answering) keeps its own.
struct SocketFile {
    path: PathBuf,
    /// The bound file's device and inode.
    identity: Option<(u64, u64)>,
}

impl SocketFile {
    /// The file just bound at `path`.
    fn bound(path: PathBuf) -> Self {
        let identity = socket_identity(&path);
        Self { path, identity }
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if self.identity.is_some() && socket_identity(&self.path) == self.identity {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The device and inode of the file at `path`, not following a link.
fn socket_identity(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|meta| (meta.dev(), meta.ino()))
}

/// Binds `what`'s listener (before the pool starts: a TCP port is one of the walls of the
/// workers' sandbox); `key` is the setting that names the address. A Unix socket is created
/// owner-only (a stale socket file from an earlier run is replaced; one another daemon
/// answers on is refused).
async fn bind(listen: &ListenAddress, what: &str, key: &str) -> Result<Bound> {
    match listen {
        ListenAddress::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {what} on {addr}"))?;
            Ok(Bound::Tcp(listener))
        }
        ListenAddress::Unix(path) => {
            use std::os::unix::fs::{FileTypeExt, PermissionsExt};
            if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                // A socket someone still answers on is another daemon's, not a stale one:
                // removing it would cut that daemon's clients off.
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    bail!(
                        "{what}'s socket {} is in use (another copilot-pool serve answers on \
                         it); stop that daemon, or give this one another {key} path",
                        path.display()
                    );
                }
                std::fs::remove_file(path)
                    .with_context(|| format!("removing the stale socket {}", path.display()))?;
            }
            // Created owner-only (the umask for this one bind, during start-up when nothing
            // else creates files), so no other user connects before the mode below is set.
            use nix::sys::stat::{Mode, umask};
            let umask_before = umask(Mode::from_bits_truncate(0o177));
            let bound = tokio::net::UnixListener::bind(path);
            umask(umask_before);
            let listener = bound
                .with_context(|| format!("binding {what} on the Unix socket {}", path.display()))?;
            let file = SocketFile::bound(path.clone());
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .with_context(|| format!("making {} owner-only", path.display()))?;
            Ok(Bound::Unix(listener, file))
        }
    }
}

/// How long the survivors of a previous run get to die after SIGKILL.
const TAKE_OVER_LIMIT: Duration = Duration::from_secs(10);

/// Opens the process-group ledger of `state_dir` and kills what survived the previous run
/// (a `kill -9` of the daemon leaves runtime groups behind only if their parent-death
/// signal could not reach them, and their tool processes): before the pool starts, so no
/// conversation is resumed while its previous process still holds it.
async fn take_over(state_dir: &std::path::Path) -> Result<std::sync::Arc<GroupLedger>> {
    let ledger = GroupLedger::open(state_dir.join(LEDGER_FILE))?;
    let report = ledger.take_over(TAKE_OVER_LIMIT).await?;
    if !report.killed.is_empty() {
        tracing::warn!(
            killed = ?report.killed,
            "Killed runtime processes that survived the previous run of the daemon."
        );
    }
    Ok(ledger)
}

/// Serves the SDK endpoint on its bound listener in a task until `stop` resolves (a Unix
/// socket file is removed after).
fn serve_sdk(
    endpoint: &SdkEndpoint,
    listener: Bound,
    stop: impl Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let endpoint = endpoint.clone();
    match listener {
        Bound::Tcp(listener) => {
            if let Ok(addr) = listener.local_addr() {
                say(Out::Stdout, format_args!("sdk on {addr}"));
                tracing::info!(%addr, "The SDK endpoint is up.");
            }
            tokio::spawn(async move {
                sdk_endpoint::serve_tcp(&endpoint, listener, stop).await;
            })
        }
        Bound::Unix(listener, file) => {
            say(
                Out::Stdout,
                format_args!("sdk on unix:{}", file.path.display()),
            );
            tracing::info!(path = %file.path.display(), "The SDK endpoint is up.");
            tokio::spawn(async move {
                sdk_endpoint::serve_unix(&endpoint, listener, stop).await;
                drop(file);
            })
        }
    }
}

/// The workers' sandbox in the configured mode (probed once: what this kernel enforces),
/// logged once; `required` refuses to start without every wall.
async fn sandbox_setup(
    config: &ServeConfig,
    own_ports: &[u16],
) -> Result<(Option<Sandbox>, SandboxStatus)> {
    let mut off = SandboxStatus::default();
    off.mode = Some(SandboxMode::Off);
    let template = crate::sandbox::template(
        config.sandbox,
        &config.allowed_work_roots,
        &config.sandbox_read_paths,
        &config.sandbox_tcp_ports,
        config.sandbox_tcp_bind.ports(),
        own_ports,
    )?;
    let Some(template) = template else {
        tracing::warn!(
            "sandbox = \"off\": workers and their tools run with the daemon's own rights (other \
             agents' homes, the daemon's state and every local port are within their reach)."
        );
        copilot_pool::metrics::sandbox_wanted(|_| false);
        copilot_pool::metrics::sandbox_enforced(|_| false);
        return Ok((None, off));
    };
    copilot_pool::metrics::sandbox_wanted(|rule| template.asks_for(rule));
    let mut status = match crate::sandbox::probe(&template).await {
        Ok(status) => status,
        Err(e) if config.sandbox == SandboxMode::Required => {
            return Err(e.context("sandbox = \"required\" but the sandbox probe failed"));
        }
        Err(e) => {
            tracing::error!(
                error = format!("{e:#}"),
                "The sandbox probe failed: workers run without a sandbox (set sandbox = \"off\" \
                 to say so, or fix the error)."
            );
            copilot_pool::metrics::sandbox_enforced(|_| false);
            return Ok((None, off));
        }
    };
    status.mode = Some(config.sandbox);
    copilot_pool::metrics::sandbox_enforced(|rule| status.enforced(rule));
    let missing = crate::sandbox::unmet_by(&template, &status);
    if missing.is_empty() {
        tracing::info!(summary = %status.summary(), "Every worker runs in its own sandbox.");
    } else if config.sandbox == SandboxMode::Required {
        bail!(
            "sandbox = \"required\" but this machine does not enforce everything ({}); run on \
             Linux 6.12+ with Landlock enabled (lsm=landlock) as a user whose capabilities can \
             be dropped, or set sandbox = \"auto\"",
            status.summary()
        );
    } else {
        tracing::warn!(
            summary = %status.summary(),
            "Workers run in a sandbox that this kernel enforces only in part (best effort)."
        );
    }
    Ok((Some(template), status))
}

/// Why the daemon refuses to start without an API token when its workers could reach it.
/// Why `serve` refuses to start without an API token when its workers' sandbox does not keep
/// them off the daemon's ports (`status`: what the sandbox probe found, if it ran); `doctor`
/// says the same.
pub(crate) fn api_unguarded_message(mode: SandboxMode, status: Option<&SandboxStatus>) -> String {
    let why = match (mode, status) {
        (SandboxMode::Off, _) => "sandbox = \"off\"".to_owned(),
        (_, Some(status)) => format!("this kernel does not confine TCP ({})", status.summary()),
        (_, None) => "no sandbox on this machine".to_owned(),
    };
    format!(
        "refusing to serve without an API token: workers run tools (bash) as this user and, \
         with {why}, can connect to the API on loopback; set {API_TOKEN_ENV} or pass \
         --api-token-file PATH (or run with sandbox = \"auto\" on Linux 6.7+, whose Landlock \
         keeps workers off the daemon's ports)"
    )
}

/// The API's settings from the daemon's: `/metrics` on the API's listener renders the
/// recorder unless metrics have a listener of their own.
fn api_config(config: &ServeConfig, metrics: &PrometheusHandle) -> ApiConfig {
    let mut api = ApiConfig::default();
    api.api_token = config.api_token.clone();
    api.timeouts = config.timeouts();
    api.max_unread_event_bytes = config.turns.max_unread_event_bytes;
    api.transcript = config.transcript();
    api.max_body_bytes = config.max_body_bytes;
    api.idempotency.ttl = Duration::from_secs(config.idempotency_ttl_secs);
    api.idempotency.max_bytes = config.idempotency_max_bytes;
    api.allowed_work_roots = config.allowed_work_roots.clone();
    api.allow_local_mcp_servers = config.allow_local_mcp_servers;
    api.attachments = config.attachment_limits();
    api.allow_logged_in_user = config.auth.allow_logged_in_user;
    api.metrics = config.metrics_listen.is_none().then(|| {
        let handle = metrics.clone();
        http::MetricsRender::new(move || render(&handle))
    });
    api
}

/// Open connections at most on the metrics listener (scrapers are few).
const METRICS_MAX_CONNECTIONS: usize = 64;

/// Descriptors kept free for everything but client connections: this many, plus
/// `FDS_PER_PROCESS` for each runtime process the pool may run (its pipes, its tunnel
/// connections), plus the metrics listener's connections.
const FDS_RESERVED: u64 = 256;
const FDS_PER_PROCESS: u64 = 8;

/// The connection cap: `configured`, lowered (with a warning) when the descriptor limit
/// would not leave room for the runtime processes next to that many connections.
fn connection_cap(configured: usize, max_processes: usize) -> usize {
    use nix::sys::resource::{Resource, getrlimit};
    let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return configured;
    };
    let cap = cap_for_descriptors(configured, max_processes, soft);
    if cap < configured {
        tracing::warn!(
            configured,
            cap,
            nofile = soft,
            "max_connections lowered to fit the descriptor limit (raise the hard limit, e.g. \
             `ulimit -Hn` or LimitNOFILE=, or lower pool.max_processes)."
        );
    }
    cap
}

/// The connection cap that fits `nofile` descriptors beside the runtime processes' pipes and
/// the metrics listener: `configured`, or less (at least 16).
fn cap_for_descriptors(configured: usize, max_processes: usize, nofile: u64) -> usize {
    let reserved = FDS_RESERVED
        + FDS_PER_PROCESS.saturating_mul(max_processes as u64)
        + METRICS_MAX_CONNECTIONS as u64;
    let room = usize::try_from(nofile.saturating_sub(reserved)).unwrap_or(usize::MAX);
    configured.min(room.max(16))
}

/// SIGINT and SIGTERM, registered before anything else starts.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            // The terminal that started the daemon closed: drained like a SIGTERM, not
            // killed outright with its tools' processes left to the next start's takeover.
            hup: signal(SignalKind::hangup()).context("installing the SIGHUP handler")?,
        })
    }

    /// Resolves on the next SIGINT, SIGTERM or SIGHUP, with the signal's name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
            _ = self.hup.recv() => "SIGHUP",
        }
    }
}

/// Where [`say`] writes.
enum Out {
    Stdout,
    Stderr,
}

/// Writes one line for whoever started the daemon, ignoring a closed pipe: `println!`
/// panics on `EPIPE` (a launcher that read the first line and closed it, a log reader that
/// died), which would skip the drain.
fn say(out: Out, line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = match out {
        Out::Stdout => {
            let mut stdout = std::io::stdout().lock();
            writeln!(stdout, "{line}").and_then(|()| stdout.flush())
        }
        Out::Stderr => writeln!(std::io::stderr().lock(), "{line}"),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_cap_fits_the_descriptor_limit_beside_the_processes() {
        let reserved = (FDS_RESERVED + FDS_PER_PROCESS * 64) as usize + METRICS_MAX_CONNECTIONS;
        assert_eq!(cap_for_descriptors(4096, 64, 1 << 20), 4096, "room enough");
        assert_eq!(
            cap_for_descriptors(4096, 64, 1024),
            (1024 - reserved).max(16),
            "lowered to fit 1,024 descriptors"
        );
        assert_eq!(cap_for_descriptors(4096, 64, 100), 16, "never below 16");
        assert_eq!(cap_for_descriptors(10, 64, 100), 10, "never raised");
    }

    #[tokio::test]
    async fn a_stopping_daemon_removes_its_own_socket_file_and_never_a_successors() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("api.sock");
        let listen = ListenAddress::Unix(path.clone());

        let bound = bind(&listen, "the API", "listen").await.expect("bound");
        drop(bound);
        assert!(
            !path.exists(),
            "the socket file is removed with its listener"
        );

        let bound = bind(&listen, "the API", "listen")
            .await
            .expect("bound again");
        // A successor bound the path while this daemon stopped answering on it.
        std::fs::remove_file(&path).expect("the stale file removed");
        let successor = std::os::unix::net::UnixListener::bind(&path).expect("bound by another");
        drop(bound);
        assert!(path.exists(), "the successor's socket file is left");
        std::os::unix::net::UnixStream::connect(&path).expect("the successor still answers");
        drop(successor);
    }

    #[tokio::test]
    async fn the_api_socket_is_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        // Under the usual umask (022) a socket file is made 0755: anyone could connect.
        // (The test leaves the process's umask alone: other tests run beside it.)
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("api.sock");
        let bound = bind(&ListenAddress::Unix(path.clone()), "the API", "listen")
            .await
            .expect("bound");
        let mode = std::fs::metadata(&path)
            .expect("the socket file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        drop(bound);
    }

    #[test]
    fn the_apis_settings_come_from_the_daemons() {
        let config: ServeConfig = toml::from_str(
            "allow_local_mcp_servers = true\nmax_body_bytes = 4096\n\
             [turns]\ntool_secs = 7\nmax_unread_event_bytes = 4194304\n",
        )
        .expect("a config");
        let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
            .build_recorder()
            .handle();
        let api = api_config(&config, &metrics);
        assert_eq!(api.max_unread_event_bytes, 4 << 20);
        assert_eq!(api.timeouts.tool, Duration::from_secs(7));
        assert_eq!(api.max_body_bytes, 4096);
        assert!(api.allow_local_mcp_servers);
        assert!(api.metrics.is_some(), "/metrics on the API's listener");
    }
}
