//! `copilot-pool chaos`: agents x conversations x turns through the HTTP API of a pool (the
//! daemon's router, in this process) and through its SDK endpoint (`--sdk-agents`, whose
//! conversations a JSON-RPC client drives as an official SDK attached by URL would) on the
//! real runtime and the scripted model, while a
//! seeded fault injector SIGKILLs and SIGSTOPs runtime processes, fails binding and transcript
//! writes (ENOSPC, EIO), rotates agents' BYOK keys and GitHub tokens, and aborts turns and drops connections from the
//! client side. At the end it checks the invariants and prints one line per invariant (held or
//! broken, with its count) and, with `--json`, one JSON object; it exits 1 if any is broken.
//!
//! Bounded: every turn has a limit (past it the turn counts as hung), the run has a
//! deadline, and the run's own processes are checked gone at the end.

mod checks;
mod client;
mod injector;
mod sdk_client;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use copilot_pool::faults::{SharedDiskFaults, Store};
use copilot_pool::http::{self, ApiConfig, ConnectionLimits};
use copilot_pool::pool::{Pool, PoolConfig, PoolEvent};
use copilot_pool::scripted_model::ScriptedModel;
use copilot_pool::sdk_endpoint::{self, AgentTokens, SdkConfig, SdkEndpoint};
use copilot_pool::secret::Secret;
use copilot_pool::transcript::TranscriptMode;
use copilot_pool::turn::{TranscriptSettings, TurnTimeouts};
use copilot_pool::worker::WorkerConfig;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::Serialize;
use serde_json::json;
use tokio::sync::watch;

use checks::Invariant;
use client::{ClientFaults, Conversation, Ended, TurnRecord, Via};
use injector::{ChaosDisk, FaultKind, Injected, Schedule};

#[derive(Args)]
pub struct ChaosArgs {
    /// Agents (each its own COPILOT_HOME and processes).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=32))]
    agents: u32,
    /// Agents more whose conversations go through the SDK endpoint (0 for HTTP only).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=32))]
    sdk_agents: u32,
    /// Conversations per agent.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=32))]
    conversations: u32,
    /// Turns per conversation.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    turns: u32,
    /// The fault schedule's seed (default: drawn, and printed so the run can be replayed).
    #[arg(long)]
    seed: Option<u64>,
    /// Time between two faults, in milliseconds.
    #[arg(long, default_value_t = 700, value_parser = clap::value_parser!(u64).range(50..=600_000))]
    fault_every_ms: u64,
    /// No turn starts after this many seconds (the turns in flight then run to their end).
    #[arg(long, default_value_t = 900, value_parser = clap::value_parser!(u64).range(10..=86_400))]
    max_seconds: u64,
    /// End with one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// The runtime executable (default: COPILOT_CLI_PATH, the managed install, `copilot` on PATH).
    #[arg(long)]
    cli: Option<PathBuf>,
}

/// How much more live heap than after warm-up the end may hold: structures that fill as the
/// storm goes on and stay bounded (a metrics series and its summary for each label value
/// seen, the pool's records of ended processes); measured (jemalloc less its thread caches,
/// before the exact counter): +2.1 MiB in a 25 s run, +1.1 MiB in a 10-minute one; with the
/// counter, a 30 s run ended 1.0 MiB below its warm-up reading. A leak per turn outgrows it in a long run (a planted 24 KiB per turn
/// went 13.5 → 23.5 MiB in 60 s).
const HEAP_SLACK: u64 = 4 << 20;
/// Warm-up is over once every conversation has ended this many turns: every agent's
/// processes have started and every cache has filled.
const WARM_UP_TURNS: u32 = 2;

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1048576.0
}

/// A turn longer than this has hung (the daemon's own absolute limit is below it).
const TURN_ABSOLUTE: Duration = Duration::from_secs(60);
const TURN_LIMIT: Duration = Duration::from_secs(90);

#[derive(Serialize)]
struct Report {
    seed: u64,
    agents: u32,
    conversations: u32,
    turns: u64,
    seconds: f64,
    ends: BTreeMap<String, u64>,
    /// The ends of the SDK endpoint's conversations alone (also counted in `ends`).
    sdk_ends: BTreeMap<String, u64>,
    faults_injected: BTreeMap<&'static str, u64>,
    processes_started: usize,
    rss_bytes: Resources,
    /// The live heap (the allocator's count of bytes held), the figure the memory invariant
    /// compares: resident size also counts freed pages the allocator keeps for reuse. Its
    /// baseline is read after warm-up ([`WARM_UP_TURNS`]).
    heap_bytes: Resources,
    /// The live heap before the first turn (the pool, its servers and the model started).
    heap_before_storm_bytes: u64,
    /// Whether warm-up ended before the run did (if not, the baseline is the storm's end).
    warmed_up: bool,
    fds: Resources,
    invariants: Vec<Invariant>,
}

#[derive(Serialize, Default, Clone, Copy)]
struct Resources {
    baseline: u64,
    peak: u64,
    end: u64,
}

pub async fn chaos(args: ChaosArgs) -> Result<()> {
    let started = Instant::now();
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    eprintln!(
        "chaos: seed {seed} (replay with --seed {seed}); {} agents over HTTP and {} over the SDK endpoint x {} conversations x {} turns, a fault every {} ms",
        args.agents, args.sdk_agents, args.conversations, args.turns, args.fault_every_ms
    );
    let metrics = install_metrics()?;
    let crate::demo::Workbench {
        program,
        scratch,
        model,
        endpoint,
    } = crate::demo::Workbench::prepare(args.cli.as_deref(), "chaos").await?;
    let base = scratch.0.clone();
    let model_url = endpoint.base_url();
    let disk = Arc::new(ChaosDisk::default());
    let shared_disk: SharedDiskFaults = disk.clone();

    let shim = base.join("runtime-shim.sh");
    std::fs::write(&shim, injector::runtime_shim(&program, &base)).context("writing the shim")?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755))
            .context("making the shim executable")?;
    }
    let mut worker = WorkerConfig::new(shim, PathBuf::new(), PathBuf::new());
    worker.kill_grace = Duration::from_secs(2);
    // A stopped runtime is found hung within two intervals plus the timeout (2.8 s).
    worker.health_interval = Duration::from_secs(1);
    worker.health_timeout = Duration::from_millis(800);
    worker.health_misses = 2;
    let mut config = PoolConfig::new(worker, base.join("state"), base.join("homes"));
    config.maintenance_interval = Duration::from_millis(200);
    config.shutdown_grace = Duration::from_secs(5);
    config.model_guard.allow_private_endpoints = true;
    // Kills from outside are not the conversations' fault: never give up resuming them.
    config.max_resume_crashes = 1000;
    config.disk_faults = Some(shared_disk.clone());
    let pool = Pool::start(config).await?;

    let transcripts = base.join("transcripts");
    let mut api = ApiConfig::default();
    api.timeouts = TurnTimeouts {
        inactivity: Duration::from_secs(20),
        absolute: TURN_ABSOLUTE,
        ..TurnTimeouts::default()
    };
    api.transcript = Some(
        TranscriptSettings::new(transcripts.clone(), TranscriptMode::BestEffort)
            .with_disk_faults(shared_disk),
    );
    let (router, _handle) = http::router_with_handle(pool.clone(), api);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding a loopback port")?;
    let addr = listener.local_addr()?;
    let (stop_server, mut server_stopped) = watch::channel(false);
    let (sdk_addr, sdk_tokens, sdk_server) =
        serve_sdk_endpoint(&pool, args.sdk_agents, server_stopped.clone()).await?;
    let server = tokio::spawn(http::serve(
        listener,
        router,
        ConnectionLimits::default(),
        async move {
            let _ = server_stopped.wait_for(|s| *s).await;
        },
    ));

    // Every process the pool starts, for the orphan check.
    let pids = Arc::new(Mutex::new(Vec::<u32>::new()));
    // Every process that died while serving (the kills and stops must all land here).
    let (crashed_tx, mut crashed) = watch::channel(BTreeSet::<u32>::new());
    // Every process the pool stopped itself (drained after a rotation, idle, recycled): a
    // process faulted while its stop was under way ends as an eviction, not a crash.
    let (evicted_tx, evicted) = watch::channel(BTreeSet::<u32>::new());
    let mut events = pool.subscribe();
    let recorder = tokio::spawn({
        let pids = pids.clone();
        async move {
            loop {
                match events.recv().await {
                    Ok(PoolEvent::WorkerStarted { pid, .. }) => {
                        pids.lock().unwrap_or_else(|e| e.into_inner()).push(pid)
                    }
                    Ok(PoolEvent::WorkerCrashed { pid, .. }) => {
                        crashed_tx.send_modify(|c| {
                            c.insert(pid);
                        });
                    }
                    Ok(PoolEvent::WorkerEvicted { pid, .. }) => {
                        evicted_tx.send_modify(|e| {
                            e.insert(pid);
                        });
                        // Wakes the wait for every faulted process's end below.
                        crashed_tx.send_modify(|_| {});
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(_) => return,
                }
            }
        }
    });

    let (rss0, fds0) = checks::own_resources();
    let heap0 = crate::heap::figures().unwrap_or_default().live_bytes;
    let peak = Arc::new(Mutex::new(Peaks {
        rss: rss0,
        heap: heap0,
        fds: fds0,
    }));
    let before = metrics.render();

    // The conversations and the injector.
    let http_client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()
        .context("an HTTP client")?;
    let mut conversations = Vec::new();
    let agents: Vec<(String, Via)> = (0..args.agents)
        .map(|a| (format!("agent-{a}"), Via::Http))
        .chain((0..args.sdk_agents).map(|a| (sdk_agent(a), Via::Sdk)))
        .collect();
    let versions: Vec<Arc<AtomicU32>> =
        agents.iter().map(|_| Arc::new(AtomicU32::new(1))).collect();
    let token_versions: Vec<Arc<AtomicU32>> =
        agents.iter().map(|_| Arc::new(AtomicU32::new(1))).collect();
    for (a, (agent, via)) in agents.iter().enumerate() {
        for c in 0..args.conversations {
            conversations.push(Arc::new(Conversation {
                index: conversations.len(),
                via: *via,
                agent: agent.clone(),
                key: format!("conversation-{c}"),
                faults: Arc::new(ClientFaults::default()),
                key_version: versions[a].clone(),
                token_version: token_versions[a].clone(),
            }));
        }
    }
    let deadline = started + Duration::from_secs(args.max_seconds);
    let (done_tx, done_rx) = watch::channel(false);
    let done_rx_for_histories = done_rx.clone();
    let injected = Arc::new(Injected::default());
    let injector = tokio::spawn(inject(
        InjectorParts {
            pool: pool.clone(),
            disk: disk.clone(),
            conversations: conversations.clone(),
            versions: versions.clone(),
            token_versions: token_versions[..args.agents as usize].to_vec(),
            injected: injected.clone(),
            peak: peak.clone(),
        },
        Schedule::new(seed),
        Duration::from_millis(args.fault_every_ms),
        done_rx,
    ));
    // Turns as they end; the model's requests are checked against them as they come (the
    // model's log is taken, not kept: a long run's requests would not fit in memory).
    let records: Arc<Mutex<BTreeMap<usize, Vec<TurnRecord>>>> = Arc::default();
    // The live heap once every conversation has warmed up: the memory invariant's baseline.
    let warm_heap: Arc<Mutex<Option<u64>>> = Arc::default();
    let warming = Arc::new(std::sync::atomic::AtomicUsize::new(conversations.len()));
    let histories = tokio::spawn(check_histories(
        model.clone(),
        records.clone(),
        done_rx_for_histories,
    ));
    let runs = conversations.iter().cloned().map(|conversation| {
        let http_client = http_client.clone();
        let model_url = model_url.clone();
        let records = records.clone();
        let (warm_heap, warming) = (warm_heap.clone(), warming.clone());
        let turns = args.turns;
        let mut sdk = (conversation.via == Via::Sdk).then(|| {
            let token = sdk_tokens
                .get(&conversation.agent)
                .cloned()
                .unwrap_or_default();
            sdk_client::SdkClient::new(sdk_addr, token, model_url.clone(), conversation.index)
        });
        tokio::spawn(async move {
            for turn in 0..turns {
                if Instant::now() >= deadline {
                    break;
                }
                let slow = turn % 4 == 3;
                let record = match sdk.as_mut() {
                    Some(sdk) => sdk.run_turn(&conversation, turn, slow, TURN_LIMIT).await,
                    None => {
                        client::run_turn(
                            &http_client,
                            addr,
                            &model_url,
                            &conversation,
                            turn,
                            slow,
                            TURN_LIMIT,
                        )
                        .await
                    }
                };
                records
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(conversation.index)
                    .or_default()
                    .push(record);
                if turn + 1 == WARM_UP_TURNS && warming.fetch_sub(1, Ordering::SeqCst) == 1 {
                    *warm_heap.lock().unwrap_or_else(|e| e.into_inner()) =
                        crate::heap::figures().map(|h| h.live_bytes);
                }
            }
        })
    });
    for run in futures_util::future::join_all(runs).await {
        run.context("a conversation's task")?;
    }
    let _ = done_tx.send(true);
    let storm_end_heap = crate::heap::figures().unwrap_or_default().live_bytes;
    let warm_heap = *warm_heap.lock().unwrap_or_else(|e| e.into_inner());
    let heap_baseline = warm_heap.unwrap_or(storm_end_heap);
    let faulted = injector.await.context("the injector's task")?;
    let (checked, lost, examples) = histories.await.context("the history checker's task")?;
    let turns = std::mem::take(&mut *records.lock().unwrap_or_else(|e| e.into_inner()));
    // A process stopped near the end is found hung a few health intervals later: wait for
    // every faulted process's crash (bounded), so each fault is in the metrics read next.
    let _ = tokio::time::timeout(
        Duration::from_secs(20),
        crashed.wait_for(|c| {
            let evicted = evicted.borrow();
            faulted
                .iter()
                .all(|pid| c.contains(pid) || evicted.contains(pid))
        }),
    )
    .await;
    let after = metrics.render();
    // How each faulted process ended: seen crashed, stopped by the pool first, or not seen.
    let (faulted_crashed, faulted_evicted, faulted_unseen) = {
        let (crashed, evicted) = (crashed.borrow(), evicted.borrow());
        let crashed_n = faulted.iter().filter(|p| crashed.contains(p)).count() as u64;
        let evicted_n = faulted
            .iter()
            .filter(|p| !crashed.contains(p) && evicted.contains(p))
            .count() as u64;
        (
            crashed_n,
            evicted_n,
            faulted.len() as u64 - crashed_n - evicted_n,
        )
    };

    // Stop everything, then look for what is left.
    let _ = stop_server.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
    let _ = tokio::time::timeout(Duration::from_secs(10), sdk_server).await;
    pool.shutdown().await?;
    recorder.abort();
    drop(http_client);
    let all_pids = pids.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let orphans = crate::demo::count_orphans(&base, &all_pids).await as u64;
    let zombies = checks::zombies();
    endpoint.shutdown().await;
    let (rss1, fds1) = checks::own_resources();
    let peaks = *peak.lock().unwrap_or_else(|e| e.into_inner());
    let (rss_peak, fds_peak) = (peaks.rss, peaks.fds);

    // The invariants.
    let mut ends: BTreeMap<String, u64> = BTreeMap::new();
    let mut sdk_ends: BTreeMap<String, u64> = BTreeMap::new();
    let (mut hung, mut broken, mut aborted_seen, mut dropped) = (0u64, 0u64, 0u64, 0u64);
    let via_sdk = |index: &usize| conversations.get(*index).is_some_and(|c| c.via == Via::Sdk);
    for (index, record) in turns
        .iter()
        .flat_map(|(index, records)| records.iter().map(move |r| (index, r)))
    {
        let name = match &record.ended {
            Ended::Status(s) => s.clone(),
            Ended::Refused(code) => format!("refused_{code}"),
            Ended::RpcRefused(code) => format!("refused_rpc_{code}"),
            Ended::Dropped => "dropped".to_owned(),
            Ended::Broken(_) => "broken".to_owned(),
            Ended::Hung => "hung".to_owned(),
        };
        match &record.ended {
            Ended::Hung => hung += 1,
            Ended::Broken(why) => {
                broken += 1;
                tracing::warn!(why, "A chaos turn's stream broke.");
            }
            Ended::Status(s) if s == "aborted" => aborted_seen += 1,
            Ended::Dropped => dropped += 1,
            _ => {}
        }
        if via_sdk(index) {
            *sdk_ends.entry(name.clone()).or_default() += 1;
        }
        *ends.entry(name).or_default() += 1;
    }
    let total_turns: u64 = ends.values().sum();
    let (files, duplicates, torn) = checks::transcript_damage(&transcripts);
    let delta = |name: &str, labels: &str| {
        checks::counter(&after, name, labels).saturating_sub(checks::counter(&before, name, labels))
    };
    use copilot_pool::metrics as m;
    let crash_exits = delta(m::PROCESS_EXITS_TOTAL, "reason=\"crash\"");
    let kills = injected.get(FaultKind::Kill)
        + injected.get(FaultKind::Stop)
        + injected.get(FaultKind::ClosePipe);
    // Each write the disk plan failed must be in the store's failure counter.
    let writes_counted = |name: &'static str, store: Store| {
        let counted = delta(
            m::STORAGE_WRITE_FAILURES_TOTAL,
            &format!("store=\"{}\"", store.as_str()),
        );
        let injected = disk.failed(store);
        Invariant::zero(
            name,
            injected.saturating_sub(counted),
            format!("{injected} injected, {counted} counted"),
        )
    };
    let aborted_metric = delta(m::TURNS_TOTAL, "outcome=\"aborted\"");
    let drained = delta(m::EVICTIONS_TOTAL, "reason=\"drained\"");
    let rotations = injected.get(FaultKind::RotateKey) + injected.get(FaultKind::RotateToken);
    let two_owners = delta(m::OWNERSHIP_VIOLATIONS_TOTAL, "");
    let mut invariants = vec![
        Invariant::zero(
            "every turn ended within its limits",
            hung + broken,
            format!("{hung} hung, {broken} broken of {total_turns} turns"),
        ),
        Invariant::zero(
            "no conversation lost its history",
            lost,
            format!(
                "{lost} of {checked} model requests lacked an earlier completed turn{}",
                if examples.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", examples.join("; "))
                }
            ),
        ),
        Invariant::zero(
            "no session attached to two processes",
            two_owners,
            format!("{two_owners} opens met their session attached elsewhere (alreadyInUse)"),
        ),
        Invariant::zero(
            "no duplicate or torn transcript line",
            duplicates + torn,
            format!("{duplicates} duplicate, {torn} torn lines in {files} transcripts"),
        ),
        Invariant::zero(
            "no orphan process and no zombie",
            orphans + zombies,
            format!(
                "{orphans} orphans, {zombies} zombies of {} processes",
                all_pids.len()
            ),
        ),
        Invariant::zero(
            "descriptors back to their baseline",
            fds1.saturating_sub(fds0 + 4),
            format!("{fds0} before, {fds_peak} at the peak, {fds1} after"),
        ),
        Invariant::zero(
            "every kill, stop and closed pipe seen as a crash exit",
            faulted_unseen + faulted_crashed.saturating_sub(crash_exits),
            format!(
                "{kills} killed, stopped or cut off: {faulted_crashed} seen crashed ({crash_exits} crash exits counted), {faulted_evicted} stopped by the pool first (a drain or eviction under way), {faulted_unseen} never seen to end"
            ),
        ),
        writes_counted("every failed binding write counted", Store::Bindings),
        writes_counted("every failed transcript write counted", Store::Transcript),
        Invariant::zero(
            "every client abort and dropped stream counted as aborted",
            (aborted_seen + dropped).saturating_sub(aborted_metric),
            format!(
                "{aborted_seen} aborted and {dropped} dropped by clients, {aborted_metric} aborted turns counted"
            ),
        ),
    ];
    // The run's own records and metric texts go before the heap is read: what is left is
    // what the pool, its servers and the model kept.
    drop(turns);
    drop((before, after));
    let heap1 = crate::heap::figures().unwrap_or_default().live_bytes;
    invariants.push(Invariant::zero(
        "memory back to its baseline",
        heap1.saturating_sub(heap_baseline + HEAP_SLACK),
        format!(
            "live heap {:.1} MiB after warm-up{}, {:.1} at the peak, {:.1} after (at most {:.0} MiB more allowed)",
            mib(heap_baseline),
            if warm_heap.is_some() {
                ""
            } else {
                " (not reached: the storm's end instead)"
            },
            mib(peaks.heap),
            mib(heap1),
            mib(HEAP_SLACK)
        ),
    ));
    invariants.push(Invariant {
        name: "key and token rotations seen as drained processes",
        held: rotations == 0 || drained > 0,
        count: drained,
        detail: format!("{rotations} rotations, {drained} processes drained"),
    });
    let report = Report {
        seed,
        agents: args.agents,
        conversations: args.conversations,
        turns: total_turns,
        seconds: started.elapsed().as_secs_f64(),
        ends,
        sdk_ends,
        faults_injected: injected.snapshot(),
        processes_started: all_pids.len(),
        rss_bytes: Resources {
            baseline: rss0,
            peak: rss_peak,
            end: rss1,
        },
        heap_bytes: Resources {
            baseline: heap_baseline,
            peak: peaks.heap,
            end: heap1,
        },
        heap_before_storm_bytes: heap0,
        warmed_up: warm_heap.is_some(),
        fds: Resources {
            baseline: fds0,
            peak: fds_peak,
            end: fds1,
        },
        invariants,
    };
    print_report(&report, args.json)?;
    drop(scratch);
    let broken: Vec<&str> = report
        .invariants
        .iter()
        .filter(|i| !i.held)
        .map(|i| i.name)
        .collect();
    if !broken.is_empty() {
        bail!(
            "{} invariant(s) broken: {}; replay with --seed {seed}",
            broken.len(),
            broken.join(", ")
        );
    }
    Ok(())
}

/// The SDK agent `a`'s name.
fn sdk_agent(a: u32) -> String {
    format!("sdk-agent-{a}")
}

/// Serves the SDK endpoint over `pool` on a loopback port, with one connection token per SDK
/// agent; returns its address, each agent's token, and the server's task, which ends when
/// `stop` turns true.
async fn serve_sdk_endpoint(
    pool: &Pool,
    agents: u32,
    mut stop: watch::Receiver<bool>,
) -> Result<(
    std::net::SocketAddr,
    BTreeMap<String, String>,
    tokio::task::JoinHandle<()>,
)> {
    let mut tokens = AgentTokens::new();
    let mut plain = BTreeMap::new();
    for a in 0..agents {
        let agent = sdk_agent(a);
        let token = format!("chaos-sdk-token-{a}");
        tokens
            .add_token(&agent, &Secret::new(token.clone()))
            .context("an SDK connection token")?;
        plain.insert(agent, token);
    }
    let mut config = SdkConfig::new(tokens);
    config.max_turn_duration = TURN_ABSOLUTE;
    let endpoint = SdkEndpoint::new(pool.clone(), config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding a loopback port for the SDK endpoint")?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        sdk_endpoint::serve_tcp(&endpoint, listener, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    });
    Ok((addr, plain, server))
}

fn print_report(report: &Report, json: bool) -> Result<()> {
    eprintln!(
        "chaos: {} turns in {:.1} s; ends {} (through the SDK endpoint {}); faults {}; {} processes started",
        report.turns,
        report.seconds,
        json!(report.ends),
        json!(report.sdk_ends),
        json!(report.faults_injected),
        report.processes_started
    );
    eprintln!(
        "chaos: this process (pool, HTTP API, scripted model, clients): RSS {:.1} MiB before, {:.1} at the peak, {:.1} after; live heap {:.1} MiB before the storm, {:.1} after warm-up, {:.1} at the peak, {:.1} after; descriptors {} / {} / {}",
        mib(report.rss_bytes.baseline),
        mib(report.rss_bytes.peak),
        mib(report.rss_bytes.end),
        mib(report.heap_before_storm_bytes),
        mib(report.heap_bytes.baseline),
        mib(report.heap_bytes.peak),
        mib(report.heap_bytes.end),
        report.fds.baseline,
        report.fds.peak,
        report.fds.end
    );
    for invariant in &report.invariants {
        println!(
            "{:<7} {}: {}",
            if invariant.held { "held" } else { "BROKEN" },
            invariant.name,
            invariant.detail
        );
    }
    if json {
        println!("{}", serde_json::to_string(report)?);
    }
    Ok(())
}

fn install_metrics() -> Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    copilot_pool::metrics::describe();
    copilot_pool::metrics::register_zeroes();
    Ok(handle)
}

/// Checks the model's requests against the turns that ended, as they come, until `done`
/// (then once more); returns (requests checked, lost histories, examples).
async fn check_histories(
    model: ScriptedModel,
    records: Arc<Mutex<BTreeMap<usize, Vec<TurnRecord>>>>,
    mut done: watch::Receiver<bool>,
) -> (u64, u64, Vec<String>) {
    let (mut checked, mut lost, mut examples) = (0, 0, Vec::new());
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        let finished = tokio::select! {
            _ = tick.tick() => false,
            _ = done.wait_for(|d| *d) => true,
        };
        let requests = model.take_requests();
        let (c, l, e) = {
            let records = records.lock().unwrap_or_else(|e| e.into_inner());
            checks::lost_histories(&requests, &records)
        };
        checked += c;
        lost += l;
        examples.extend(e.into_iter().take(5usize.saturating_sub(examples.len())));
        if finished {
            return (checked, lost, examples);
        }
    }
}

struct InjectorParts {
    pool: Pool,
    disk: Arc<ChaosDisk>,
    conversations: Vec<Arc<Conversation>>,
    versions: Vec<Arc<AtomicU32>>,
    /// The HTTP agents' token versions (the SDK endpoint's agents authenticate by their
    /// connection token, not a GitHub token per request).
    token_versions: Vec<Arc<AtomicU32>>,
    injected: Arc<Injected>,
    peak: Arc<Mutex<Peaks>>,
}

/// This process's highest readings during the storm.
#[derive(Clone, Copy)]
struct Peaks {
    rss: u64,
    heap: u64,
    fds: u64,
}

/// Makes one fault every `every` until `done`; also samples this process's peak resources.
async fn inject(
    parts: InjectorParts,
    mut schedule: Schedule,
    every: Duration,
    mut done: watch::Receiver<bool>,
) -> BTreeSet<u32> {
    let mut faulted: BTreeSet<u32> = BTreeSet::new();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = done.wait_for(|d| *d) => return faulted,
        }
        {
            let (rss, fds) = checks::own_resources();
            let heap = crate::heap::figures().unwrap_or_default().live_bytes;
            let mut peak = parts.peak.lock().unwrap_or_else(|e| e.into_inner());
            *peak = Peaks {
                rss: peak.rss.max(rss),
                heap: peak.heap.max(heap),
                fds: peak.fds.max(fds),
            };
        }
        let kind = schedule.next_kind();
        let took = match kind {
            FaultKind::Kill | FaultKind::Stop | FaultKind::ClosePipe => {
                let live: Vec<u32> = match parts.pool.status().await {
                    Ok(status) => status
                        .workers
                        .iter()
                        .map(|w| w.pid)
                        .filter(|pid| !faulted.contains(pid))
                        .collect(),
                    Err(_) => Vec::new(),
                };
                if live.is_empty() {
                    false
                } else {
                    // The worker's pid is the runtime's (the shim execs it); the `cat` its
                    // output goes through is in its group.
                    let leader = live[schedule.pick(live.len())];
                    let target = match kind {
                        FaultKind::ClosePipe => injector::group_members(leader)
                            .into_iter()
                            .find(|(_, name)| name == "cat")
                            .map(|(pid, _)| (pid, Signal::SIGKILL)),
                        FaultKind::Kill => Some((leader, Signal::SIGKILL)),
                        _ => Some((leader, Signal::SIGSTOP)),
                    };
                    let sent = target.is_some_and(|(pid, signal)| {
                        kill(Pid::from_raw(pid as i32), signal).is_ok()
                    });
                    if sent {
                        faulted.insert(leader);
                    }
                    sent
                }
            }
            FaultKind::BindingWrite | FaultKind::TranscriptWrite => {
                let store = if kind == FaultKind::BindingWrite {
                    Store::Bindings
                } else {
                    Store::Transcript
                };
                let writes = 1 + schedule.pick(2) as u32;
                parts.disk.arm(store, writes, schedule.disk_error());
                true
            }
            FaultKind::RotateKey => {
                let agent = schedule.pick(parts.versions.len());
                parts.versions[agent].fetch_add(1, Ordering::SeqCst);
                true
            }
            FaultKind::RotateToken => {
                let agent = schedule.pick(parts.token_versions.len());
                parts.token_versions[agent].fetch_add(1, Ordering::SeqCst);
                true
            }
            FaultKind::ClientAbort | FaultKind::ClientDrop => {
                let conversation = &parts.conversations[schedule.pick(parts.conversations.len())];
                let flag = if kind == FaultKind::ClientAbort {
                    &conversation.faults.abort_next
                } else {
                    &conversation.faults.drop_next
                };
                // A flag already set is one fault, not two.
                !flag.swap(true, Ordering::SeqCst)
            }
        };
        if took {
            parts.injected.add(kind);
        }
    }
}
