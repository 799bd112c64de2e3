//! `copilot-pool run --prompt TEXT`: one worker, one session, one turn, reply streamed to
//! stdout. The model is the embedded scripted model unless `--provider-url` or
//! `--logged-in` says otherwise. Never installs anything.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use copilot_pool::model_guard::{GuardError, ModelGuard, ModelGuardConfig};
use copilot_pool::rpc::EventKind;
use copilot_pool::rpc::messages::{ProviderConfig, SessionConfig};
use copilot_pool::runtime;
use copilot_pool::scripted_model::{HttpEndpoint, ScriptedModel};
use copilot_pool::secret::Secret;
use copilot_pool::worker::{Session, SessionUpdate, WorkerConfig, WorkerHandle};
use tokio::io::AsyncWriteExt;

#[derive(Args)]
pub struct RunArgs {
    /// The prompt to send.
    #[arg(long)]
    prompt: String,
    /// The runtime executable (default: COPILOT_CLI_PATH, the managed install, `copilot` on PATH).
    #[arg(long)]
    cli: Option<PathBuf>,
    /// COPILOT_HOME for the worker (default: a temporary directory removed afterwards; with
    /// `--logged-in`, `~/.copilot`, where the Copilot CLI keeps its login).
    #[arg(long)]
    home: Option<PathBuf>,
    /// An OpenAI-compatible endpoint to use instead of the scripted model, e.g.
    /// `http://127.0.0.1:8080/v1`.
    #[arg(long, conflicts_with = "logged_in")]
    provider_url: Option<String>,
    /// Name of the environment variable holding the provider's API key.
    #[arg(long, requires = "provider_url")]
    provider_key_env: Option<String>,
    /// Let --provider-url be a loopback or private address (plain http:// only to loopback),
    /// for a local model. The provider is called through the guarded model path either way.
    #[arg(long, requires = "provider_url")]
    allow_private_endpoints: bool,
    /// Model id for the provider.
    #[arg(long)]
    model: Option<String>,
    /// Use the GitHub user logged in to the Copilot CLI instead of a model endpoint.
    #[arg(long)]
    logged_in: bool,
    /// Serve the scripted model over the JSON-RPC pipe instead of loopback HTTP.
    #[arg(long, conflicts_with_all = ["provider_url", "logged_in"])]
    tunnel: bool,
    /// Give up on the turn after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
}

/// A COPILOT_HOME that is removed on drop when we created it.
struct Home {
    path: PathBuf,
    remove: bool,
}

impl Drop for Home {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

pub async fn run(args: RunArgs) -> Result<()> {
    let located = runtime::locate(args.cli.as_deref(), runtime::process_env)?;
    tracing::debug!(path = %located.path.display(), source = %located.source, "Using runtime.");

    let home = match &args.home {
        Some(path) => Home {
            path: path.clone(),
            remove: false,
        },
        None if args.logged_in => Home {
            path: std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".copilot"))
                .ok_or_else(|| anyhow!("--logged-in needs HOME or --home to find the login"))?,
            remove: false,
        },
        None => Home {
            path: std::env::temp_dir().join(format!("copilot-pool-run-{}", uuid::Uuid::new_v4())),
            remove: true,
        },
    };
    std::fs::create_dir_all(&home.path)
        .with_context(|| format!("creating COPILOT_HOME {}", home.path.display()))?;
    let cwd = std::env::current_dir().context("reading the current directory")?;

    let scripted = ScriptedModel::new();
    let mut endpoint: Option<HttpEndpoint> = None;
    let mut config = WorkerConfig::new(located.path.clone(), home.path.clone(), cwd.clone());
    let mut session = SessionConfig {
        streaming: true,
        working_directory: Some(cwd.display().to_string()),
        env_value_mode: Some("direct".to_owned()),
        tool_filter_precedence: Some("excluded".to_owned()),
        ..Default::default()
    };
    // The current directory's hook files (a cloned repository's) run nothing.
    copilot_pool::pool::without_command_files(&mut session.extra);
    if args.logged_in {
        config.auto_login = true;
        session.model = args.model.clone();
    } else if let Some(url) = &args.provider_url {
        let key = match &args.provider_key_env {
            Some(var) => {
                Some(Secret::new(std::env::var(var).map_err(|_| {
                    anyhow!("--provider-key-env {var}: variable not set")
                })?))
            }
            None => None,
        };
        // The guarded path, as in the pool: the child gets placeholders, the tunnel the key.
        let provider = ProviderConfig::openai(url.clone(), key);
        let mut guard = ModelGuardConfig::default();
        guard.allow_private_endpoints = args.allow_private_endpoints;
        let guard = ModelGuard::new(guard)?;
        let tunnel = guard.tunnel_for(&provider).map_err(|e| {
            // The guard's message names the daemon's and the library's switch for a local
            // model; here it is a flag.
            use copilot_pool::kinds::BlockReason as R;
            let local = matches!(
                &e,
                GuardError::Refused {
                    reason: R::Scheme | R::Loopback | R::Private | R::UniqueLocal,
                    ..
                }
            );
            if local && !args.allow_private_endpoints {
                anyhow!("{e}; with `copilot-pool run`, pass --allow-private-endpoints")
            } else {
                anyhow::Error::new(e)
            }
        })?;
        config.model_tunnel = Some(tunnel);
        session.provider = Some(ModelGuard::placeholder(&provider));
        session.model = args.model.clone();
    } else {
        // The embedded scripted model: no tools, so the demo never touches the machine.
        session.model = Some(ScriptedModel::MODEL_ID.to_owned());
        session.available_tools = Some(Vec::new());
        let base_url = if args.tunnel {
            config.model_tunnel = Some(Arc::new(scripted.clone()));
            // Nothing listens here: every model call goes through the pipe.
            "http://127.0.0.1:9/v1".to_owned()
        } else {
            let ep = scripted
                .serve_http()
                .await
                .context("starting the scripted model")?;
            let url = ep.base_url();
            endpoint = Some(ep);
            url
        };
        session.provider = Some(ProviderConfig::openai(
            base_url,
            Some(Secret::new("scripted")),
        ));
    }

    // Interrupts (Ctrl-C, SIGTERM) end the run cleanly at any point, start included: the
    // futures below are dropped, which stops the worker and kills its process group.
    let limit = Duration::from_secs(args.timeout_secs);
    let outcome =
        crate::interrupt::until_interrupted(start_and_turn(config, session, &args.prompt, limit))
            .await;
    drop(endpoint);
    outcome
}

async fn start_and_turn(
    config: WorkerConfig,
    session: SessionConfig,
    prompt: &str,
    limit: Duration,
) -> Result<()> {
    let worker = WorkerHandle::start(config).await?;
    let outcome = turn(&worker, session, prompt, limit).await;
    worker.shutdown().await;
    outcome
}

async fn turn(
    worker: &WorkerHandle,
    config: SessionConfig,
    prompt: &str,
    limit: Duration,
) -> Result<()> {
    let mut session = worker.create_session(config).await?;
    session.send(prompt).await?;
    let result = tokio::time::timeout(limit, stream_reply(&mut session)).await;
    match result {
        Ok(outcome) => outcome,
        Err(_) => {
            let _ = session.abort().await;
            bail!(
                "no reply within {} s (raise --timeout-secs)",
                limit.as_secs()
            )
        }
    }
}

async fn stream_reply(session: &mut Session) -> Result<()> {
    let mut out = tokio::io::stdout();
    let mut streamed = false;
    let mut error: Option<String> = None;
    while let Some(update) = session.next().await {
        match update {
            SessionUpdate::Event(event) => match event.kind {
                EventKind::AssistantMessageDelta(delta) if event.agent_id().is_none() => {
                    streamed = true;
                    out.write_all(delta.delta_content.as_bytes()).await?;
                    out.flush().await?;
                }
                EventKind::AssistantMessage(message) if event.agent_id().is_none() => {
                    if !streamed && !message.content.is_empty() {
                        out.write_all(message.content.as_bytes()).await?;
                    }
                    if !message.content.is_empty() {
                        out.write_all(b"\n").await?;
                        out.flush().await?;
                    }
                    streamed = false;
                }
                EventKind::SessionError(e) => error = Some(e.message),
                EventKind::SessionIdle(idle) => {
                    if let Some(message) = error {
                        bail!("the turn failed: {message}");
                    }
                    if idle.aborted == Some(true) {
                        bail!("the turn was aborted");
                    }
                    return Ok(());
                }
                _ => {}
            },
            // Questions to a user nobody is asking: refuse. Hooks: default answer.
            SessionUpdate::UserInput(request) => {
                request.fail("copilot-pool run is not interactive")
            }
            SessionUpdate::Hook(hook) => drop(hook),
            SessionUpdate::Request(request) => drop(request),
            SessionUpdate::Notification(_) => {}
            SessionUpdate::Ended(err) => return Err(err.into()),
        }
    }
    bail!("the worker ended without finishing the turn")
}
