//! One run of the bench's workload in one mode: starts what the mode needs (a fresh
//! `copilot-pool serve` child for the pool's two modes; nothing for the SDK's, whose runtimes
//! the workload spawns), runs `workload.mjs` under Node, samples the memory (PSS) of the
//! runtimes and of the pool during the load and after it until the agents return (apart),
//! reads their CPU from /proc when the load is done,
//! waits (polling `/v1/pool`, or `/proc` for the SDK's runtimes) until every agent's runtime is
//! gone when the workload's agents go away, checks that the pool's returning agents landed on
//! the primed spares it kept, SIGKILLs agent 0's runtime when the workload asks, and stops and
//! reaps everything it started, whatever happened.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use copilot_pool::process::GroupLeader;
use copilot_pool::sdk_endpoint::sha256_hex;
use nix::sys::signal::Signal;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::stats::percentile;
use super::{BenchArgs, Mode};
use crate::load::{Daemon, start_daemon};
use crate::procfs;

/// How often the memory of the processes is sampled during the load.
const SAMPLE_EVERY: Duration = Duration::from_millis(200);
/// A bound on waiting for any one line of the workload: a failure guard, not a measurement.
const STEP_LIMIT: Duration = Duration::from_secs(600);
/// How long a stopped workload or daemon may take to exit before its group is killed.
const EXIT_LIMIT: Duration = Duration::from_secs(30);
/// The pool's idle TTL in the bench: short, so a returning agent's process is gone within
/// seconds (evicted at the maintenance tick, each second, after this).
const IDLE_TTL_SECS: u64 = 2;
/// How often the harness looks whether the agents' runtimes are gone (and the pool's spares
/// are up) while they are away.
const AWAY_POLL: Duration = Duration::from_millis(100);
/// A bound on the agents' absence: idle TTL, tick, a spare's start and priming, with room for
/// a loaded machine. A failure guard, not a measurement.
const AWAY_LIMIT: Duration = Duration::from_secs(60);

/// What every run shares: the runtime, the SDK, the scripted model, the workload script.
pub struct Setup {
    pub runtime: PathBuf,
    pub sdk: PathBuf,
    pub model_url: String,
    pub model_id: String,
    pub script: PathBuf,
    pub scratch: PathBuf,
}

/// What one run measured (times in milliseconds, memory in MiB).
#[derive(Debug, Clone, Default)]
pub struct Figures {
    pub turns_per_second: Option<f64>,
    pub cold_first_event_p50_ms: Option<f64>,
    pub first_idle_p50_ms: Option<f64>,
    pub warm_turn_p50_ms: Option<f64>,
    pub warm_turn_p99_ms: Option<f64>,
    pub runtime_cpu_per_turn_ms: Option<f64>,
    pub pool_cpu_per_turn_ms: Option<f64>,
    /// The workload's own CPU per turn: the gateway's side (the HTTP client, or the SDK
    /// client attached to the endpoint or driving its own runtimes).
    pub gateway_cpu_per_turn_ms: Option<f64>,
    pub runtime_peak_pss_mib: Option<f64>,
    pub pool_peak_pss_mib: Option<f64>,
    pub kill_to_ready_ms: Option<f64>,
    /// From a returning agent's turn (its runtime gone) to its first event, p50 over agents.
    pub returning_first_event_p50_ms: Option<f64>,
    /// From a returning agent's turn to its end, p50 over the agents.
    pub returning_first_idle_p50_ms: Option<f64>,
    /// The pool only: of the returning conversations, the share that landed on a process
    /// that was a primed spare while the agents were away.
    pub returning_on_spare_percent: Option<f64>,
    /// The runtimes' peak PSS from the load's end until the agents return: the pool's serving
    /// processes until they idle out, then the warm spares that stand in for them; the SDK's
    /// runtimes until their clients stop.
    pub runtime_peak_pss_after_load_mib: Option<f64>,
    /// The pool only: a primed spare's PSS (with its descendants) while the agents were
    /// away, the mean over the spares: the memory warm spares cost beside the load's peak.
    pub spare_pss_mib: Option<f64>,
}

/// The SDK endpoint's token of agent `i` is this prefix and `i`.
const TOKEN_PREFIX: &str = "bench-token-";

/// Runs the workload once in `mode`, in a directory of its own under the scratch directory.
pub async fn run(mode: Mode, args: &BenchArgs, setup: &Setup, index: usize) -> Result<Figures> {
    let dir = setup.scratch.join(format!("run-{index}-{}", mode.name()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let daemon = match mode {
        Mode::Http | Mode::Endpoint => Some(start_serve(mode, args, setup, &dir).await?),
        Mode::SdkResume | Mode::SdkAttached => None,
    };
    let outcome = drive(mode, args, setup, &dir, daemon.as_ref(), index).await;
    if let Some(daemon) = daemon {
        stop_daemon(daemon).await?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

/// A fresh `serve` for one run: its own state, the SDK endpoint on for `Mode::Endpoint`.
async fn start_serve(mode: Mode, args: &BenchArgs, setup: &Setup, dir: &Path) -> Result<Daemon> {
    // A short idle TTL and one warm spare per key, kept well past the agents' absence: a
    // returning agent finds its process evicted and a primed spare in its place, with its
    // most recent conversations resumed there ahead of its return.
    let warm = args.warm_spare_conversations();
    let mut config = format!(
        "[pool]\nmax_sessions = 4096\nmax_waiters = 4096\nmax_waiters_per_agent = 4096\nidle_ttl_secs = {IDLE_TTL_SECS}\n\
         warm_spares = 1\nwarm_spare_window_secs = 600\n\
         warm_spare_conversations = {warm}\n\n\
         [model]\nallow_private_endpoints = true\n"
    );
    if mode == Mode::Endpoint {
        config.push_str("\n[sdk]\n");
        for a in 0..args.agents {
            config.push_str(&format!(
                "\n[[sdk.tokens]]\nagent = \"agent-{a}\"\nsha256 = \"{}\"\n",
                sha256_hex(&format!("{TOKEN_PREFIX}{a}"))
            ));
        }
    }
    let path = dir.join("serve.toml");
    std::fs::write(&path, config).context("writing the daemon's config")?;
    let extra: &[&str] = match mode {
        Mode::Endpoint => &["--sdk-listen", "127.0.0.1:0"],
        _ => &[],
    };
    let daemon = start_daemon(&setup.runtime, dir, &path, extra).await?;
    if mode == Mode::Endpoint && daemon.sdk.is_none() {
        bail!("the daemon started without saying where its SDK endpoint listens");
    }
    Ok(daemon)
}

/// Stops the daemon as an operator would (SIGTERM, it drains and stops its runtimes).
async fn stop_daemon(mut daemon: Daemon) -> Result<()> {
    daemon.process.group().signal(Signal::SIGTERM);
    if tokio::time::timeout(EXIT_LIMIT, daemon.process.wait())
        .await
        .is_err()
    {
        daemon.process.group().signal(Signal::SIGKILL);
        let _ = daemon.process.wait().await;
        bail!("the daemon did not stop within {EXIT_LIMIT:?} of SIGTERM (its group was killed)");
    }
    Ok(())
}

/// Memory peaks seen so far in one phase, and how many samples were taken.
#[derive(Default)]
struct Peaks {
    runtimes: u64,
    pool: u64,
    samples: u32,
}

impl Peaks {
    /// Samples the runtimes under `root` and the pool (if any) once.
    fn sample(&mut self, root: u32, pool: Option<u32>) {
        let all = procfs::all();
        let runtimes: u64 = procfs::descendants(&all, root)
            .iter()
            .filter_map(|p| procfs::pss_bytes(p.pid))
            .sum();
        self.runtimes = self.runtimes.max(runtimes);
        if let Some(pid) = pool {
            self.pool = self.pool.max(procfs::pss_bytes(pid).unwrap_or(0));
        }
        self.samples += 1;
    }
}

/// CPU seconds (user + system) of one run's three sides at one moment: the runtimes
/// (everything under the daemon, or under the workload in the SDK modes), the pool (the daemon
/// itself; unused in the SDK modes) and the gateway (the workload's own process). One scan of
/// `/proc` gives all three in clock ticks; the pool's and the gateway's are also read from
/// their CPU-time clocks, to the nanosecond (a few ms a turn: a 10 ms tick was 12 % of the
/// pool's figure). The runtimes' (many processes, some already reaped) stay in ticks.
#[derive(Debug, Clone, Copy)]
struct Cpu {
    runtimes: f64,
    pool: Reading,
    gateway: Reading,
}

/// One process's CPU seconds in ticks, and to the nanosecond when its clock was readable.
#[derive(Debug, Clone, Copy)]
struct Reading {
    ticks: f64,
    exact: Option<f64>,
}

impl Reading {
    fn of(pid: u32, ticks: f64) -> Reading {
        Reading {
            ticks,
            exact: procfs::cpu_seconds_exact(pid),
        }
    }

    /// The CPU used between `start` and this reading: exact when both readings are, else in
    /// ticks for both (a process that exited unreaped has a `stat` but no clock).
    fn since(self, start: Reading) -> f64 {
        match (self.exact, start.exact) {
            (Some(end), Some(begin)) => end - begin,
            _ => self.ticks - start.ticks,
        }
    }
}

impl Cpu {
    /// `root`: the daemon, or the workload when there is none; `workload`: Node's pid.
    fn now(root: u32, workload: u32) -> Cpu {
        let all = procfs::all();
        let (pool, runtimes) = procfs::tree_cpu_seconds_in(&all, root);
        let gateway = procfs::tree_cpu_seconds_in(&all, workload).0;
        Cpu {
            runtimes,
            pool: Reading::of(root, pool),
            gateway: Reading::of(workload, gateway),
        }
    }

    /// What was used since `start`: (runtimes, pool, gateway).
    fn since(self, start: Cpu) -> Used {
        Used {
            runtimes: self.runtimes - start.runtimes,
            pool: self.pool.since(start.pool),
            gateway: self.gateway.since(start.gateway),
        }
    }
}

/// CPU seconds each side used over the load.
#[derive(Debug, Clone, Copy)]
struct Used {
    runtimes: f64,
    pool: f64,
    gateway: f64,
}

/// Runs the workload under Node and measures it.
async fn drive(
    mode: Mode,
    args: &BenchArgs,
    setup: &Setup,
    dir: &Path,
    daemon: Option<&Daemon>,
    index: usize,
) -> Result<Figures> {
    let mut command = tokio::process::Command::new("node");
    if let Some(trace) = &args.trace {
        // Made absolute, so it does not depend on where the workload runs.
        let trace = std::path::absolute(trace)
            .with_context(|| format!("the trace file {}", trace.display()))?;
        command.env("TRACE", trace).env("RUN", index.to_string());
    }
    command
        .arg(&setup.script)
        .env("MODE", mode.name())
        .env("SDK_DIR", &setup.sdk)
        .env("AGENTS", args.agents.to_string())
        .env("CONVERSATIONS", args.conversations.to_string())
        .env("TURNS", args.turns.to_string())
        .env("TOOL", if args.plain { "0" } else { "1" })
        .env("STREAMING", if args.streaming { "1" } else { "0" })
        .env("MODEL_URL", &setup.model_url)
        .env("MODEL_ID", &setup.model_id)
        .env("ATTEMPT_MS", (args.attempt_secs * 1000).to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    match (mode, daemon) {
        (Mode::Http, Some(d)) => {
            command.env("HTTP_URL", format!("http://{}", d.addr));
        }
        (Mode::Endpoint, Some(d)) => {
            command
                .env("SDK_URL", d.sdk.as_deref().unwrap_or_default())
                .env("TOKEN_PREFIX", TOKEN_PREFIX);
        }
        (Mode::SdkResume | Mode::SdkAttached, None) => {
            command
                .env("RUNTIME", &setup.runtime)
                .env("HOMES", dir.join("homes"));
        }
        _ => bail!("mode {} was started without what it needs", mode.name()),
    }
    let mut node = GroupLeader::spawn(command)
        .context("starting node (Node.js 20 or later must be on PATH)")?;
    let result = talk(mode, args, &mut node, daemon).await;
    if result.is_err() {
        node.group().kill();
    }
    // `wait` kills whatever the workload left in its group (the SDK modes' runtimes).
    if tokio::time::timeout(EXIT_LIMIT, node.wait()).await.is_err() {
        node.group().kill();
        let _ = node.wait().await;
    }
    result
}

/// Reads the workload's lines and does what they ask, sampling memory in between.
async fn talk(
    mode: Mode,
    args: &BenchArgs,
    node: &mut GroupLeader,
    daemon: Option<&Daemon>,
) -> Result<Figures> {
    let node_pid = node.pid().context("node's pid")?;
    let pool = match daemon {
        Some(d) => Some(d.process.pid().context("the daemon's pid")?),
        None => None,
    };
    // The runtimes are the daemon's descendants, or (the SDK alone) the workload's.
    let root = pool.unwrap_or(node_pid);
    let mut stdin = node.take_stdin().context("node's standard input")?;
    let stdout = node.take_stdout().context("node's standard output")?;
    let mut lines = BufReader::new(stdout).lines();
    // CPU when the workload's clock starts.
    let mut cpu_start: Option<Cpu> = None;
    let mut peaks = Peaks::default();
    // From the load's end until the agents return: the agents' processes, then the pool's
    // warm spares instead of them; the SDK's runtimes until their clients stop.
    let mut after_load = Peaks::default();
    let mut figures = Figures::default();
    let mut phase = Phase::Load;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    // The pool's spares while the agents were away: their pids, and the spawns so far.
    let mut away: Option<(HashSet<u32>, u64)> = None;
    loop {
        let line = tokio::select! {
            // A line that has come ends its phase before another sample is taken.
            biased;
            line = tokio::time::timeout(STEP_LIMIT, lines.next_line()) => line,
            _ = tick.tick(), if phase != Phase::Returning => {
                match phase {
                    Phase::Load => peaks.sample(root, pool),
                    _ => after_load.sample(root, pool),
                }
                continue;
            }
        };
        let line = line
            .with_context(|| {
                format!(
                    "the {} workload said nothing for {STEP_LIMIT:?}",
                    mode.name()
                )
            })?
            .context("reading the workload's output")?
            .with_context(|| {
                format!(
                    "the {} workload ended early (its error is above)",
                    mode.name()
                )
            })?;
        let value: Value = serde_json::from_str(&line)
            .with_context(|| format!("the workload printed a line that is not JSON: {line}"))?;
        if let Some(error) = value.get("error") {
            bail!("the {} workload failed: {error}", mode.name());
        }
        match value["step"].as_str() {
            Some("start") => {
                cpu_start = Some(Cpu::now(root, node_pid));
                // The load's samples count from its clock's start.
                peaks = Peaks::default();
                stdin
                    .write_all(b"go\n")
                    .await
                    .context("telling the workload")?;
            }
            Some("load") => {
                let start = cpu_start.context("the workload reported its load before its start")?;
                // The workload waits for `measured` before it stops anything (the SDK modes'
                // clients): every figure ends where its clock stopped.
                let used = Cpu::now(root, node_pid).since(start);
                // The peak is the load's: the samples taken while its turns ran. Its end is
                // sampled only when the load was too short for any: at its end the pool may
                // already be starting a warm spare for a key that outgrew its processes
                // (measured apart, below).
                if peaks.samples == 0 {
                    peaks.sample(root, pool);
                }
                // The after-load figure starts here, before the workload stops anything: the
                // SDK's clients may stop, and their runtimes exit, before the next tick (a
                // tiny run's after-load figure was then 0).
                after_load.sample(root, pool);
                phase = Phase::AfterLoad;
                stdin
                    .write_all(b"measured\n")
                    .await
                    .context("telling the workload")?;
                let turns = value["turns"].as_f64().unwrap_or(0.0).max(1.0);
                let seconds = value["ms"].as_f64().unwrap_or(0.0) / 1000.0;
                let list = |key: &str| -> Vec<f64> {
                    value[key]
                        .as_array()
                        .map(|a| a.iter().filter_map(Value::as_f64).collect())
                        .unwrap_or_default()
                };
                let warm = list("warm");
                figures.turns_per_second = (seconds > 0.0).then(|| turns / seconds);
                figures.cold_first_event_p50_ms = percentile(&list("cold"), 0.5);
                figures.first_idle_p50_ms = percentile(&list("firstIdle"), 0.5);
                figures.warm_turn_p50_ms = percentile(&warm, 0.5);
                figures.warm_turn_p99_ms = percentile(&warm, 0.99);
                let per_turn_ms = |seconds: f64| seconds * 1000.0 / turns;
                figures.runtime_cpu_per_turn_ms = Some(per_turn_ms(used.runtimes));
                figures.pool_cpu_per_turn_ms = pool.map(|_| per_turn_ms(used.pool));
                figures.gateway_cpu_per_turn_ms = Some(per_turn_ms(used.gateway));
                figures.runtime_peak_pss_mib = Some(peaks.runtimes as f64 / 1048576.0);
                figures.pool_peak_pss_mib = pool.map(|_| peaks.pool as f64 / 1048576.0);
            }
            Some("kill") => {
                let agent = value["agent"].as_u64().unwrap_or(0);
                let pid = runtime_of(root, agent).with_context(|| {
                    format!("no runtime process of agent-{agent} under {root} to kill")
                })?;
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL)
                    .with_context(|| format!("killing runtime {pid}"))?;
                stdin
                    .write_all(b"killed\n")
                    .await
                    .context("telling the workload")?;
            }
            Some("away") => {
                away = match daemon {
                    Some(d) => {
                        let last = std::sync::Mutex::new(Value::Null);
                        let warm = args.resumed_on_each_spare();
                        let waited = sampling(
                            &mut after_load,
                            root,
                            pool,
                            tokio::time::timeout(
                                AWAY_LIMIT,
                                pool_away(d.addr, args.agents, warm, &last),
                            ),
                        )
                        .await;
                        let last = last.lock().map(|l| l.to_string()).unwrap_or_default();
                        let (spares, spawned) = waited.with_context(|| {
                            format!(
                                "the pool did not evict the agents' processes and keep a primed \
                                 spare per agent, with {warm} conversations resumed on it, \
                                 within {AWAY_LIMIT:?} (run with \
                                 COPILOT_POOL_LOG=info for its log); its last /v1/pool: {last}"
                            )
                        })??;
                        figures.spare_pss_mib = spares_pss_mib(&spares);
                        Some((spares, spawned))
                    }
                    None => {
                        sampling(
                            &mut after_load,
                            root,
                            pool,
                            tokio::time::timeout(AWAY_LIMIT, runtimes_gone(node_pid)),
                        )
                        .await
                        .with_context(|| {
                            format!(
                                "the stopped SDK clients' runtimes did not exit within \
                                     {AWAY_LIMIT:?}"
                            )
                        })?;
                        None
                    }
                };
                phase = Phase::Returning;
                figures.runtime_peak_pss_after_load_mib =
                    Some(after_load.runtimes as f64 / 1048576.0);
                stdin
                    .write_all(b"back\n")
                    .await
                    .context("telling the workload")?;
            }
            Some("returned") => {
                let list = |key: &str| -> Vec<f64> {
                    value[key]
                        .as_array()
                        .map(|a| a.iter().filter_map(Value::as_f64).collect())
                        .unwrap_or_default()
                };
                figures.returning_first_event_p50_ms = percentile(&list("firstEvent"), 0.5);
                figures.returning_first_idle_p50_ms = percentile(&list("firstIdle"), 0.5);
                if let (Some(d), Some((spares, spawned))) = (daemon, &away) {
                    let status = pool_status(d.addr).await?;
                    let (on_spare, spawned_since) = on_spares(&status, spares, *spawned);
                    if spawned_since > 0 || on_spare < 100.0 {
                        eprintln!(
                            "bench: {}: the returning agents' conversations are {on_spare:.0} % \
                             on the spares kept while they were away; {spawned_since} \
                             process(es) started for the return",
                            mode.name()
                        );
                    }
                    figures.returning_on_spare_percent = Some(on_spare);
                }
            }
            Some("ready") => figures.kill_to_ready_ms = value["ms"].as_f64(),
            _ if value["done"] == true => return Ok(figures),
            _ => bail!("the workload printed an unexpected line: {line}"),
        }
    }
}

/// What the bench is sampling memory for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Load,
    AfterLoad,
    Returning,
}

/// Awaits `work`, sampling memory into `peaks` every [`SAMPLE_EVERY`] meanwhile.
async fn sampling<T>(
    peaks: &mut Peaks,
    root: u32,
    pool: Option<u32>,
    work: impl std::future::Future<Output = T>,
) -> T {
    tokio::pin!(work);
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = tick.tick() => peaks.sample(root, pool),
        }
    }
}

/// The mean PSS of the processes `spares` still alive (each with its descendants), in MiB.
fn spares_pss_mib(spares: &HashSet<u32>) -> Option<f64> {
    let all = procfs::all();
    let each: Vec<u64> = spares
        .iter()
        .filter_map(|&pid| {
            let below: u64 = procfs::descendants(&all, pid)
                .iter()
                .filter_map(|p| procfs::pss_bytes(p.pid))
                .sum();
            Some(procfs::pss_bytes(pid)? + below)
        })
        .collect();
    (!each.is_empty()).then(|| each.iter().sum::<u64>() as f64 / each.len() as f64 / 1048576.0)
}

/// `GET /v1/pool` of the run's daemon, as JSON.
async fn pool_status(addr: SocketAddr) -> Result<Value> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .context("an HTTP client")?;
    let text = crate::load::get_text(&http, addr, "/v1/pool")
        .await
        .with_context(|| format!("GET http://{addr}/v1/pool answered nothing"))?;
    serde_json::from_str(&text).with_context(|| format!("/v1/pool answered no JSON: {text}"))
}

/// Polls `/v1/pool` (its `processes`) until every process is a spare (every agent's serving
/// process was evicted), one for each of the `agents` keys, each holding the `warm`
/// conversations it resumes ahead of their return; answers the spares' pids and the
/// pool's spawns so far.
async fn pool_away(
    addr: SocketAddr,
    agents: u32,
    warm: u32,
    last: &std::sync::Mutex<Value>,
) -> Result<(HashSet<u32>, u64)> {
    let mut poll = tokio::time::interval(AWAY_POLL);
    loop {
        poll.tick().await;
        let status = pool_status(addr).await?;
        let workers = status["processes"].as_array().cloned().unwrap_or_default();
        let settled = workers
            .iter()
            .all(|w| w["state"] == "spare" && w["conversations"].as_u64() == Some(u64::from(warm)));
        let spares: HashSet<u32> = workers
            .iter()
            .filter_map(|w| w["pid"].as_u64().map(|p| p as u32))
            .collect();
        if settled && spares.len() >= agents as usize {
            let spawned = status["totals"]["processes_spawned"].as_u64().unwrap_or(0);
            return Ok((spares, spawned));
        }
        if let Ok(mut l) = last.lock() {
            *l = status;
        }
    }
}

/// The share (percent) of the conversations attached now that sit on one of `spares`, and
/// how many processes the pool started since it had started `spawned`.
fn on_spares(status: &Value, spares: &HashSet<u32>, spawned: u64) -> (f64, u64) {
    let workers = status["processes"].as_array().cloned().unwrap_or_default();
    let (mut total, mut on) = (0u64, 0u64);
    for w in &workers {
        let conversations = w["conversations"].as_u64().unwrap_or(0);
        total += conversations;
        if w["pid"]
            .as_u64()
            .is_some_and(|p| spares.contains(&(p as u32)))
        {
            on += conversations;
        }
    }
    let now = status["totals"]["processes_spawned"].as_u64().unwrap_or(0);
    let percent = if total == 0 {
        0.0
    } else {
        on as f64 * 100.0 / total as f64
    };
    (percent, now.saturating_sub(spawned))
}

/// Polls `/proc` until no live process is left under the workload (its stopped clients'
/// runtimes exited).
async fn runtimes_gone(node: u32) {
    let mut poll = tokio::time::interval(AWAY_POLL);
    loop {
        poll.tick().await;
        let all = procfs::all();
        if procfs::descendants(&all, node)
            .iter()
            .all(|p| p.state == 'Z')
        {
            return;
        }
    }
}

/// The runtime process of agent `agent` under `root`: the topmost descendant whose
/// `COPILOT_HOME` is the agent's (`…/agents/agent-<n>/copilot`, the pool's layout, which the
/// workload gives the SDK's runtimes too).
fn runtime_of(root: u32, agent: u64) -> Option<u32> {
    let suffix = format!("/agents/agent-{agent}/copilot");
    let all = procfs::all();
    let under = procfs::descendants(&all, root);
    let homes: Vec<(u32, u32)> = under
        .iter()
        .filter(|p| p.state != 'Z')
        .filter(|p| {
            procfs::environ_var(p.pid, "COPILOT_HOME")
                .is_some_and(|h| h.trim_end_matches('/').ends_with(&suffix))
        })
        .map(|p| (p.pid, p.ppid))
        .collect();
    homes
        .iter()
        .find(|(_, ppid)| !homes.iter().any(|(pid, _)| pid == ppid))
        .map(|(pid, _)| *pid)
}
