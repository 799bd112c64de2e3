//! `copilot-pool demo`: the pool at work on the embedded scripted model. N agents with C
//! conversations of M turns each run concurrently; mid-run one child is killed with SIGKILL
//! and one agent's token is rotated. Pool events print as they happen; `--json` ends with
//! one summary object. Installs the pinned runtime first if it is missing (and says so).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use copilot_pool::auth::LeaseAuth;
use copilot_pool::pool::{LeaseRequest, Pool, PoolConfig, PoolError, PoolEvent};
use copilot_pool::rpc::messages::ProviderConfig;
use copilot_pool::runtime::{self, CLI_PATH_ENV, Flavour, LocateError, LocatedBy};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::secret::Secret;
use copilot_pool::transcript::{TranscriptMode, count_duplicates};
use copilot_pool::turn::{Answer, GatewayTool, Question, ToolCall, TranscriptSettings, TurnError};
use copilot_pool::worker::WorkerConfig;
use serde::Serialize;
use serde_json::json;
use tokio::sync::{Mutex, Notify};

#[derive(Args)]
pub struct DemoArgs {
    /// Agents (each gets its own COPILOT_HOME and process).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=64))]
    agents: u32,
    /// Conversations per agent (they share the agent's process).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    conversations: u32,
    /// Turns per conversation.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    turns: u32,
    /// End with one JSON summary line on stdout.
    #[arg(long)]
    json: bool,
    /// The runtime executable (default: COPILOT_CLI_PATH, else the managed pinned install,
    /// installed on first use; a `copilot` on PATH is not used).
    #[arg(long)]
    cli: Option<PathBuf>,
}

#[derive(Serialize)]
struct Summary {
    turns_ok: u64,
    turns_failed: u64,
    processes_spawned: u64,
    restarts: u64,
    resumed: u64,
    evicted: u64,
    crashes: u64,
    tool_calls: u32,
    user_inputs: u32,
    compactions: u32,
    timeouts: u32,
    transcript_duplicates: usize,
    orphans: usize,
    seconds: f64,
}

/// What the turn-API showcase did.
#[derive(Default)]
struct Showcase {
    tool_calls: u32,
    user_inputs: u32,
    compactions: u32,
    timeouts: u32,
}

/// Removes the demo's scratch directory on every exit path.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    /// A new `copilot-pool-<what>-<uuid>` directory in the temp dir, with its `work` folder.
    pub(crate) fn create(what: &str) -> Result<Scratch> {
        let scratch = Scratch(
            std::env::temp_dir().join(format!("copilot-pool-{what}-{}", uuid::Uuid::new_v4())),
        );
        std::fs::create_dir_all(scratch.0.join("work"))
            .with_context(|| format!("creating the {what} directory {}", scratch.0.display()))?;
        Ok(scratch)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a command that drives the pool on the embedded model needs first (`load`, `chaos`,
/// `bench scale`): the runtime (found or installed), a scratch directory, and the scripted
/// model served on loopback.
pub(crate) struct Workbench {
    /// The runtime executable.
    pub(crate) program: PathBuf,
    /// Removed when dropped.
    pub(crate) scratch: Scratch,
    /// The model, for its replies and recorded requests.
    pub(crate) model: ScriptedModel,
    /// Where it listens; shut down by the command.
    pub(crate) endpoint: copilot_pool::scripted_model::HttpEndpoint,
}

impl Workbench {
    /// Finds or installs the runtime, creates `copilot-pool-<what>-<uuid>` and starts the model.
    pub(crate) async fn prepare(cli: Option<&Path>, what: &str) -> Result<Workbench> {
        let program = find_or_install(cli).await?;
        let scratch = Scratch::create(what)?;
        let model = ScriptedModel::new();
        let endpoint = model
            .serve_http()
            .await
            .context("starting the scripted model")?;
        Ok(Workbench {
            program,
            scratch,
            model,
            endpoint,
        })
    }
}

pub async fn demo(args: DemoArgs) -> Result<()> {
    let started = Instant::now();
    let program = find_or_install(args.cli.as_deref()).await?;
    let scratch = Scratch::create("demo")?;
    let base = scratch.0.clone();

    let model = ScriptedModel::new();
    let endpoint = model
        .serve_http()
        .await
        .context("starting the scripted model")?;
    let mut worker = WorkerConfig::new(program, PathBuf::new(), PathBuf::new());
    worker.kill_grace = Duration::from_secs(2);
    let mut config = PoolConfig::new(worker, base.join("state"), base.join("homes"));
    config.maintenance_interval = Duration::from_millis(200);
    config.shutdown_grace = Duration::from_secs(5);
    // The demo's model is the scripted one on loopback: its BYOK requests go through the
    // guarded path like any provider's, with private endpoints allowed.
    config.model_guard.allow_private_endpoints = true;
    let pool = Pool::start(config).await?;
    let mut events = pool.subscribe();
    let printer = tokio::spawn(async move {
        while let Ok(event) = events.recv().await {
            let line = match &event {
                PoolEvent::WorkerStarted {
                    pid,
                    restart: true,
                    key_hash,
                    ..
                } => {
                    format!("restart: worker {pid} replaces a crashed one (key {key_hash})")
                }
                PoolEvent::WorkerStarted { pid, key_hash, .. } => {
                    format!("spawned: worker {pid} (key {key_hash})")
                }
                PoolEvent::WorkerCrashed { pid, .. } => format!("crashed: worker {pid}"),
                PoolEvent::WorkerEvicted { pid, reason, .. } => {
                    format!("evicted: worker {pid} ({})", reason.describe())
                }
                PoolEvent::KeyQuarantined { key_hash } => format!("quarantined: key {key_hash}"),
                PoolEvent::ConversationOpened { pid, reason }
                    if reason.continued()
                        && *reason != copilot_pool::pool::OpenReason::Attached =>
                {
                    format!("resumed: a conversation on worker {pid}")
                }
                PoolEvent::ConversationOpened { .. } => continue,
                // Events added later are not part of the demo's story.
                _ => continue,
            };
            eprintln!("  [pool] {line}");
        }
    });

    let total = u64::from(args.agents * args.conversations * args.turns);
    let done = Arc::new(AtomicU64::new(0));
    let progress = Arc::new(Notify::new());
    let failed = Arc::new(AtomicU64::new(0));
    let token_version = Arc::new(AtomicU64::new(1));
    let rotated = Arc::new(Notify::new());
    let agent_pids: Arc<Mutex<HashMap<u32, u32>>> = Arc::default();
    eprintln!(
        "demo: {} agents x {} conversations x {} turns on the scripted model ({total} turns)",
        args.agents, args.conversations, args.turns
    );

    let mut runs = Vec::new();
    for agent in 0..args.agents {
        for conv in 0..args.conversations {
            let ctx = Conversation {
                pool: pool.clone(),
                agent,
                conv,
                turns: args.turns,
                work: base.join("work"),
                provider: ProviderConfig::openai(
                    endpoint.base_url(),
                    Some(Secret::new("demo-key")),
                ),
                token_version: token_version.clone(),
                rotated: rotated.clone(),
                done: done.clone(),
                failed: failed.clone(),
                progress: progress.clone(),
                agent_pids: agent_pids.clone(),
            };
            runs.push(tokio::spawn(ctx.run()));
        }
    }

    // Mid-run: kill one child, then rotate agent 0's token. Agent 0's last turns wait for the
    // rotation, so it always happens while agent 0 still has work (never deadlocks: the
    // rotation comes at the latest when everything else is done).
    // Agent 0's last turn of each conversation waits for the rotation: every other turn can
    // be done before it.
    let ungated = total - u64::from(args.conversations);
    let rotate_at = (total * 2 / 3).min(ungated);
    let kill_at = (total / 3).min(rotate_at);
    let chaos = {
        let rotated = rotated.clone();
        let done = done.clone();
        let progress = progress.clone();
        let agent_pids = agent_pids.clone();
        let token_version = token_version.clone();
        let victim = if args.agents > 1 { 1 } else { 0 };
        async move {
            wait_progress(&done, &progress, kill_at).await;
            // The victim's worker is known once one of its leases has opened.
            let pid = loop {
                let notified = progress.notified();
                if let Some(pid) = agent_pids.lock().await.get(&victim).copied() {
                    break Some(pid);
                }
                // Every turn that could still open a lease waits for the rotation (one agent
                // of one turn), or failed without one (a runtime that never starts): no
                // worker to kill.
                if done.load(Ordering::SeqCst) >= ungated {
                    break None;
                }
                notified.await;
            };
            if let Some(pid) = pid {
                eprintln!("  [demo] SIGKILL to agent-{victim}'s worker {pid}");
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            wait_progress(&done, &progress, rotate_at).await;
            eprintln!("  [demo] rotating agent-0's token (profile version v1 -> v2)");
            token_version.store(2, Ordering::SeqCst);
            rotated.notify_waiters();
        }
    };
    let chaos = tokio::spawn(chaos);
    for run in runs {
        let _ = run.await;
    }
    chaos.abort();

    let showcase = showcase(&pool, &base, &endpoint.base_url()).await;
    let status = pool.status().await?;
    if !args.json {
        // The same table `copilot-pool status` prints.
        eprint!("{}", crate::status::render(&status));
    }
    let pids: Vec<u32> = status.workers.iter().map(|w| w.pid).collect();
    pool.shutdown().await?;
    drop(endpoint);
    printer.abort();
    let orphans = count_orphans(&base, &pids).await;
    let transcript_duplicates = count_transcript_duplicates(&base.join("transcripts"));
    let turns_failed = failed.load(Ordering::SeqCst);
    let summary = Summary {
        turns_ok: done.load(Ordering::SeqCst) - turns_failed,
        turns_failed,
        processes_spawned: status.totals.processes_spawned,
        restarts: status.totals.restarts,
        resumed: status.totals.resumed,
        evicted: status.totals.evicted,
        crashes: status.totals.crashes,
        tool_calls: showcase.tool_calls,
        user_inputs: showcase.user_inputs,
        compactions: showcase.compactions,
        timeouts: showcase.timeouts,
        transcript_duplicates,
        orphans,
        seconds: started.elapsed().as_secs_f64(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        println!(
            "turns ok {} failed {}; processes spawned {}, restarts {}, resumed {}, evicted {}; \
             tool calls {}, questions {}, compactions {}, timeouts {}, transcript duplicates {}; \
             orphans after shutdown {}; {:.1} s",
            summary.turns_ok,
            summary.turns_failed,
            summary.processes_spawned,
            summary.restarts,
            summary.resumed,
            summary.evicted,
            summary.tool_calls,
            summary.user_inputs,
            summary.compactions,
            summary.timeouts,
            summary.transcript_duplicates,
            summary.orphans,
            summary.seconds
        );
    }
    if orphans > 0 {
        bail!("{orphans} pool processes were still alive after shutdown");
    }
    if summary.turns_ok == 0 {
        bail!(
            "no turn succeeded (each failure is printed above); check the runtime with \
             `copilot-pool doctor`"
        );
    }
    if transcript_duplicates > 0 {
        bail!("{transcript_duplicates} duplicate transcript entries");
    }
    Ok(())
}

/// One conversation that uses the turn API: a gateway tool, an ask_user question, a
/// compaction, and a stuck tool call that ends in a timeout.
async fn showcase(pool: &Pool, base: &Path, base_url: &str) -> Showcase {
    let mut done = Showcase::default();
    let lookup = GatewayTool::new(
        "lookup_number",
        "Looks up the number for a key",
        json!({"type": "object", "properties": {"key": {"type": "string"}}}),
        |call: ToolCall| async move { Ok(format!("the number for {} is 42", call.arguments["key"])) },
    );
    let stuck = GatewayTool::new(
        "stuck",
        "Never returns",
        json!({"type": "object"}),
        |_c: ToolCall| std::future::pending::<Result<String, String>>(),
    )
    .with_timeout(Duration::from_millis(500));
    let mut req = LeaseRequest::new("agent-showcase", "showcase", base.join("work"));
    req.model = Some(ScriptedModel::MODEL_ID.to_owned());
    req.provider = Some(ProviderConfig::openai(
        base_url,
        Some(Secret::new("demo-key")),
    ));
    req.streaming = false;
    req.handlers.tools = vec![lookup, stuck];
    req.handlers.user_input = Some(Arc::new(|_q: Question| async { Some(Answer::Choice(1)) }));
    req.handlers.transcript = Some(TranscriptSettings::new(
        base.join("transcripts"),
        TranscriptMode::BestEffort,
    ));
    let mut lease = match pool.lease(req).await {
        Ok(lease) => lease,
        Err(e) => {
            eprintln!("  [demo] showcase lease failed: {e}");
            return done;
        }
    };
    let tool = r#"SCENARIO:tool NAME=lookup_number ARGS={"key":"alpha"}"#;
    match lease.run(tool).await {
        Ok(o) => {
            done.tool_calls += o.gateway_tool_calls;
            eprintln!("  [demo] tool call answered: {}", o.text);
        }
        Err(e) => eprintln!("  [demo] tool turn failed: {e}"),
    }
    let ask = r#"SCENARIO:tool NAME=ask_user ARGS={"question":"Pick a colour","choices":["red","blue"],"allow_freeform":false}"#;
    match lease.run(ask).await {
        Ok(o) => {
            done.user_inputs += o.user_inputs;
            eprintln!("  [demo] ask_user answered: {}", o.text);
        }
        Err(e) => eprintln!("  [demo] ask_user turn failed: {e}"),
    }
    match lease.compact(None).await {
        Ok(r) => {
            done.compactions += 1;
            eprintln!(
                "  [demo] compaction removed {} messages",
                r.messages_removed.unwrap_or(0)
            );
        }
        Err(e) => eprintln!("  [demo] compaction failed: {e}"),
    }
    match lease.run("SCENARIO:tool NAME=stuck ARGS={}").await {
        Err(PoolError::Turn(TurnError::Timeout { kind, .. })) => {
            done.timeouts += 1;
            eprintln!("  [demo] stuck tool call ended in a {kind:?} timeout; turn aborted");
        }
        Ok(o) => eprintln!("  [demo] the stuck tool call did not time out: {}", o.text),
        Err(e) => eprintln!("  [demo] stuck tool turn failed otherwise: {e}"),
    }
    done
}

/// Ids that appear more than once across the demo's transcript files.
fn count_transcript_duplicates(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| count_duplicates(&e.path()).ok())
        .sum()
}

struct Conversation {
    pool: Pool,
    agent: u32,
    conv: u32,
    turns: u32,
    work: PathBuf,
    provider: ProviderConfig,
    token_version: Arc<AtomicU64>,
    rotated: Arc<Notify>,
    done: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    progress: Arc<Notify>,
    agent_pids: Arc<Mutex<HashMap<u32, u32>>>,
}

impl Conversation {
    async fn run(self) {
        for turn in 0..self.turns {
            if self.agent == 0 && turn + 1 == self.turns {
                loop {
                    let notified = self.rotated.notified();
                    if self.token_version.load(Ordering::SeqCst) > 1 {
                        break;
                    }
                    notified.await;
                }
            }
            let mut ok = self.one_turn(turn).await;
            if let Err(e) = &ok {
                // What a gateway does when the worker died under a turn: take a new lease,
                // which resumes the conversation on the restarted worker, and retry once.
                eprintln!(
                    "  [demo] agent-{} conv-{} turn {turn} failed ({e}); retrying",
                    self.agent, self.conv
                );
                ok = self.one_turn(turn).await;
            }
            if let Err(e) = &ok {
                eprintln!(
                    "  [demo] agent-{} conv-{} turn {turn} failed: {e}",
                    self.agent, self.conv
                );
                self.failed.fetch_add(1, Ordering::SeqCst);
            }
            self.done.fetch_add(1, Ordering::SeqCst);
            self.progress.notify_waiters();
        }
    }

    async fn one_turn(&self, turn: u32) -> Result<()> {
        let mut req = LeaseRequest::new(
            format!("agent-{}", self.agent),
            format!("agent-{}/conv-{}", self.agent, self.conv),
            self.work.clone(),
        );
        req.model = Some(ScriptedModel::MODEL_ID.to_owned());
        req.provider = Some(self.provider.clone());
        req.available_tools = Some(Vec::new());
        req.streaming = false;
        req.handlers.transcript = Some(TranscriptSettings::new(
            self.work.with_file_name("transcripts"),
            TranscriptMode::BestEffort,
        ));
        if self.agent == 0 {
            let version = self.token_version.load(Ordering::SeqCst);
            req.auth = LeaseAuth {
                github_token: Some(Secret::new(format!("demo-token-v{version}"))),
                profile_id: Some("demo-profile".to_owned()),
                profile_version: Some(format!("v{version}")),
                ..Default::default()
            };
        }
        let mut lease = self.pool.lease(req).await?;
        self.agent_pids
            .lock()
            .await
            .insert(self.agent, lease.worker_pid());
        self.progress.notify_waiters();
        let prompt = format!(
            "SCENARIO:slow SLOW=4x25 agent {} conversation {} turn {turn}",
            self.agent, self.conv
        );
        let outcome = lease.run(prompt).await?;
        if let Some(error) = outcome.error {
            bail!("turn error: {error}");
        }
        Ok(())
    }
}

async fn wait_progress(done: &AtomicU64, progress: &Notify, target: u64) {
    loop {
        let notified = progress.notified();
        if done.load(Ordering::SeqCst) >= target {
            return;
        }
        notified.await;
    }
}

/// The runtime to use: the one given (`--cli`, `COPILOT_CLI_PATH`) or the managed pinned
/// install, installed on first use. A `copilot` on `PATH` is not taken: its version is
/// whatever was installed there, and the demo, the benchmarks and the tests run the pinned
/// one.
pub(crate) async fn find_or_install(explicit: Option<&Path>) -> Result<PathBuf> {
    let on_path = match runtime::locate(explicit, runtime::process_env) {
        Ok(located) if located.source != LocatedBy::Path => return Ok(located.path),
        Ok(located) => Some(located.path),
        Err(LocateError::Missing { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    let cache = runtime::cache_dir(runtime::process_env)?;
    let ignored = match &on_path {
        Some(path) => format!(
            " ({} on PATH is not used: pass --cli or set {CLI_PATH_ENV} to run it)",
            path.display()
        ),
        None => String::new(),
    };
    eprintln!(
        "installing the pinned Copilot runtime ({} flavour, {}) with npm into {} (first run \
         only){ignored}",
        Flavour::default(),
        Flavour::default().version(),
        cache.display()
    );
    let installed = runtime::install(Flavour::default(), &cache).await?;
    Ok(installed.executable)
}

/// Pool processes still alive after shutdown: the workers' groups, and anything whose
/// COPILOT_HOME lies under the demo's directory (from /proc).
pub(crate) async fn count_orphans(base: &Path, pids: &[u32]) -> usize {
    let base = base.display().to_string();
    // Killed groups take a moment to disappear from /proc; there is no event for that.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let alive = live_pool_processes(&base, pids);
        if alive == 0 || Instant::now() >= deadline {
            return alive;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn live_pool_processes(base: &str, pids: &[u32]) -> usize {
    crate::procfs::all()
        .iter()
        .filter(|p| p.state != 'Z')
        .filter(|p| {
            let under_base = crate::procfs::environ_var(p.pid, "COPILOT_HOME")
                .is_some_and(|home| home.contains(base));
            pids.contains(&p.pgid) || under_base
        })
        .count()
}
