//! `copilot-pool bench scale`: memory at scale, the compass of a multi-tenant host. Starts a
//! real `serve` (a child, on loopback, the scripted model in this process) with recycling on
//! (by turn count and by resident memory), drives agents x conversations with a total number
//! of plain turns over HTTP/SSE (a fixed number of clients; turn k goes to conversation
//! k mod (agents x conversations), so every conversation turns in rotation and warm-up ends
//! when each has had its first), and samples every N turns completed: the pool's own RSS and
//! PSS and live heap, the total PSS and RSS of every process under it (the runtimes), and
//! their count.
//! Prints the samples, a summary against the targets (pool RSS under 50 MiB; the runtimes'
//! total flat after warm-up) and one JSON object with `--json`, and draws both curves as a
//! PNG (`plot`).
//!
//! This module owns the run, the samples and the summary; `plot` owns the chart.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use copilot_pool::scripted_model::ScriptedModel;
use serde::Serialize;
use serde_json::json;

use super::plot;
use crate::load::{Daemon, gauge, get_text, start_daemon, turn};
use crate::procfs;

/// The pool's RSS target (issue 15, item 5).
const POOL_RSS_TARGET_MIB: f64 = 50.0;
/// The runtimes' total counts as flat after warm-up when it grows by at most this per turn:
/// a quarter of the smallest leak measured for runtime 1.0.85 without recycling (0.2 MiB per
/// turn, packing study §7), so recycling must beat the leak at least fourfold.
const FLAT_MIB_PER_TURN: f64 = 0.05;
/// How long the stopped daemon may take to drain and exit.
const EXIT_LIMIT: Duration = Duration::from_secs(60);
/// The longest one request may take, a whole streamed turn included: a minute past the
/// daemon's default absolute turn timeout (30 min), so a turn normally ends `timeout` first.
const REQUEST_LIMIT: Duration = Duration::from_secs(30 * 60 + 60);

#[derive(Args)]
pub struct ScaleArgs {
    /// Agents (each its own runtime process, replaced as it is recycled).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=500))]
    pub agents: u32,
    /// Conversations per agent.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub conversations: u32,
    /// Turns in all (plain turns: one model call answering text), spread over every
    /// conversation in rotation.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub turns: u64,
    /// Clients sending turns at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=512))]
    pub concurrency: u32,
    /// The daemon's `[pool] max_turns_per_process`: a runtime process is recycled (drained,
    /// then replaced) after this many turns. 50 turns bound the runtime's leak (0.2-0.6 MiB
    /// per turn) to 10-30 MiB per process.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub recycle_turns: u64,
    /// The daemon's `[pool] max_rss_bytes`, in MiB: a runtime process above it is recycled.
    /// 384 MiB: a base of ~105 MiB after its first turn, 20 conversations at +5.1 MiB each
    /// after three turns (packing study §0), and room for the leak between recycles.
    #[arg(long, default_value_t = 384, value_parser = clap::value_parser!(u64).range(64..=65_536))]
    pub recycle_rss_mib: u64,
    /// Sample every this many turns completed (default: a hundredth of the turns).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub sample_every: Option<u64>,
    /// Where the chart (PNG) is written.
    #[arg(long, default_value = "bench-scale.png")]
    pub png: PathBuf,
    /// End with one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// The runtime executable (default: COPILOT_CLI_PATH, the managed install, `copilot` on PATH).
    #[arg(long)]
    pub cli: Option<PathBuf>,
}

/// One reading of the pool and of everything under it.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Sample {
    pub turns_done: u64,
    pub seconds: f64,
    pub pool_rss_mib: f64,
    pub pool_pss_mib: f64,
    /// The pool's live heap (bytes allocated and not freed), from its
    /// `copilot_pool_daemon_heap_bytes` gauge: what of its RSS it holds, not the allocator.
    pub pool_heap_mib: f64,
    pub runtimes_pss_mib: f64,
    pub runtimes_rss_mib: f64,
    /// Live processes under the pool (zombies not counted).
    pub processes: u32,
}

/// A target of the run, held or missed.
#[derive(Debug, Serialize)]
struct Check {
    name: &'static str,
    held: bool,
    detail: String,
}

/// The figures of the run.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub turns: u64,
    pub failed_turns: u64,
    pub seconds: f64,
    pub turns_per_second: f64,
    /// Turns completed when every conversation had had its first turn.
    pub warm_up_turns: u64,
    pub pool_peak_rss_mib: f64,
    pub pool_peak_pss_mib: f64,
    pub pool_peak_heap_mib: f64,
    pub runtimes_pss_at_warm_up_mib: Option<f64>,
    pub runtimes_pss_at_end_mib: Option<f64>,
    pub runtimes_peak_pss_mib: f64,
    /// Least-squares slope of the runtimes' total PSS over the samples from warm-up on.
    pub runtimes_pss_slope_mib_per_1000_turns: Option<f64>,
    pub processes_peak: u32,
    /// Runtime processes started (the first per agent, then one per recycle or crash).
    pub process_spawns: u64,
    /// Processes the pool stopped after draining them (recycled here).
    pub processes_recycled: u64,
}

pub async fn scale(args: ScaleArgs) -> Result<()> {
    let crate::demo::Workbench {
        program,
        scratch,
        model: _model,
        endpoint,
    } = crate::demo::Workbench::prepare(args.cli.as_deref(), "bench-scale").await?;
    let model_url = endpoint.base_url();
    let conversations = u64::from(args.agents) * u64::from(args.conversations);

    // Every conversation attached at once; a process per agent plus room for a recycled
    // process's successor to start while the old one finishes its turn. No warm spares: this
    // run measures recycling against the runtime's leak (`copilot-pool bench` measures spares).
    let config = scratch.0.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "[pool]\nmax_processes = {}\nmax_sessions = {}\nmax_waiters = {waiters}\n\
             max_waiters_per_agent = {waiters}\nwait_timeout_secs = 300\n\
             max_turns_per_process = {}\nmax_rss_bytes = {}\nwarm_spares = 0\n\n[model]\nallow_private_endpoints = true\n",
            args.agents + args.concurrency,
            conversations.max(1024),
            args.recycle_turns,
            args.recycle_rss_mib << 20,
            waiters = u64::from(args.concurrency).max(1024),
        ),
    )
    .context("writing the daemon's config")?;
    let Daemon {
        process: mut daemon,
        addr,
        ..
    } = start_daemon(&program, &scratch.0, &config, &[]).await?;
    let daemon_pid = daemon.pid().context("the daemon's pid")?;
    let every = args.sample_every.unwrap_or((args.turns / 100).max(1));
    eprintln!(
        "bench scale: daemon {daemon_pid} on {addr}; {} agents x {} conversations, {} turns, {} clients; \
         recycling after {} turns or {} MiB; a sample every {every} turns",
        args.agents,
        args.conversations,
        args.turns,
        args.concurrency,
        args.recycle_turns,
        args.recycle_rss_mib
    );

    // Every request is bounded: a turn past this (or a stuck /metrics read) fails the run
    // instead of hanging it.
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(REQUEST_LIMIT)
        .build()
        .context("an HTTP client")?;
    let started = Instant::now();
    let next_turn = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first_failure = Arc::new(std::sync::Mutex::new(None::<String>));
    // The clients say when a sample is due (every `every` turns, and at warm-up's end).
    let (due_tx, mut due) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let sampler_http = http.clone();
    let sampler = tokio::spawn(async move {
        let http = sampler_http;
        let mut samples = vec![read(&http, addr, 0, daemon_pid, started).await];
        while let Some(turns) = due.recv().await {
            samples.push(read(&http, addr, turns, daemon_pid, started).await);
        }
        samples
    });
    let clients: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (http, model_url, due) = (http.clone(), model_url.clone(), due_tx.clone());
            let (next_turn, done, failed) = (next_turn.clone(), done.clone(), failed.clone());
            let first_failure = first_failure.clone();
            let (agents, total) = (u64::from(args.agents), args.turns);
            tokio::spawn(async move {
                loop {
                    let k = next_turn.fetch_add(1, Ordering::SeqCst);
                    if k >= total {
                        return;
                    }
                    let conversation = k % conversations;
                    let body = json!({
                        "agent_id": format!("agent-{}", conversation % agents),
                        "session_key": format!("conversation-{conversation}"),
                        "prompt": "REPLY=ok",
                        "model": ScriptedModel::MODEL_ID,
                        "provider": {"type": "openai", "base_url": model_url, "api_key": "bench-key"},
                    });
                    let outcome = turn(&http, addr, &body).await;
                    if outcome.as_deref() != Ok("idle") {
                        failed.fetch_add(1, Ordering::SeqCst);
                        if let Ok(mut first) = first_failure.lock() {
                            first.get_or_insert_with(|| match outcome {
                                Ok(status) => format!("a turn ended {status}"),
                                Err(error) => error,
                            });
                        }
                    }
                    let n = done.fetch_add(1, Ordering::SeqCst) + 1;
                    if n % every == 0 || n == conversations || n == total {
                        let _ = due.send(n);
                    }
                }
            })
        })
        .collect();
    drop(due_tx);
    for client in clients {
        client.await.context("a client task panicked")?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut samples = sampler.await.context("the sampler task panicked")?;
    samples.sort_by_key(|s| s.turns_done);
    samples.dedup_by_key(|s| s.turns_done);

    let exposition = get_text(&http, addr, "/metrics").await.unwrap_or_default();
    let process_spawns = counter_sum(
        &exposition,
        copilot_pool::metrics::PROCESS_SPAWNS_TOTAL,
        None,
    );
    let processes_recycled = counter_sum(
        &exposition,
        copilot_pool::metrics::EVICTIONS_TOTAL,
        Some("reason=\"drained\""),
    );

    // Stop the daemon as an operator would (SIGTERM: it drains and stops its children).
    daemon.group().signal(nix::sys::signal::Signal::SIGTERM);
    let stopped = tokio::time::timeout(EXIT_LIMIT, daemon.wait()).await;
    if stopped.is_err() {
        daemon.group().kill();
        let _ = daemon.wait().await;
    }
    endpoint.shutdown().await;
    let orphans = crate::demo::count_orphans(&scratch.0, &[]).await;

    let turns = done.load(Ordering::SeqCst);
    let failed_turns = failed.load(Ordering::SeqCst);
    let mut summary = summarize(&samples, conversations.min(args.turns));
    summary.turns = turns;
    summary.failed_turns = failed_turns;
    summary.seconds = seconds;
    summary.turns_per_second = turns as f64 / seconds.max(f64::MIN_POSITIVE);
    summary.process_spawns = process_spawns;
    summary.processes_recycled = processes_recycled;
    let checks = checks(&summary);

    let title = format!(
        "copilot-pool bench scale: {} agents x {} conversations, {} turns, recycling after {} turns or {} MiB",
        args.agents, args.conversations, args.turns, args.recycle_turns, args.recycle_rss_mib
    );
    let points: Vec<plot::Point> = samples
        .iter()
        .map(|s| plot::Point {
            turns: s.turns_done as f64,
            runtimes_pss_mib: s.runtimes_pss_mib,
            pool_rss_mib: s.pool_rss_mib,
            pool_heap_mib: s.pool_heap_mib,
        })
        .collect();
    plot::draw(
        &points,
        &plot::Labels {
            title: &title,
            warm_up_turns: (summary.warm_up_turns > 0).then_some(summary.warm_up_turns as f64),
            pool_target_mib: POOL_RSS_TARGET_MIB,
        },
        &args.png,
    )?;

    print_report(&args, &samples, &summary, &checks);
    println!("chart: {}", args.png.display());
    if args.json {
        let report = json!({
            "workload": {
                "agents": args.agents,
                "conversations_per_agent": args.conversations,
                "conversations": conversations,
                "turns": args.turns,
                "concurrency": args.concurrency,
                "plain": true,
                "runtime": program.display().to_string(),
            },
            "recycling": {
                "max_turns_per_process": args.recycle_turns,
                "max_rss_mib": args.recycle_rss_mib,
            },
            "machine": super::machine(),
            "sample_every": every,
            "samples": samples,
            "summary": summary,
            "checks": checks,
            "png": args.png.display().to_string(),
        });
        println!("{}", serde_json::to_string(&report)?);
    }
    if stopped.is_err() {
        bail!("the daemon did not stop within {EXIT_LIMIT:?} of SIGTERM (its group was killed)");
    }
    if orphans > 0 {
        bail!("{orphans} runtime processes outlived the daemon");
    }
    if failed_turns > 0 {
        let first = first_failure.lock().ok().and_then(|f| f.clone());
        bail!(
            "{failed_turns} of {turns} turns failed (the first: {}); the figures above count them",
            first.unwrap_or_default()
        );
    }
    Ok(())
}

/// Reads the pool (`pid`, its heap gauge at `addr`) and every live process under it; `/proc`
/// reads block, so they run off the runtime's threads.
async fn read(
    http: &reqwest::Client,
    addr: SocketAddr,
    turns_done: u64,
    pid: u32,
    started: Instant,
) -> Sample {
    let seconds = started.elapsed().as_secs_f64();
    let mib = |b: u64| b as f64 / 1048576.0;
    let exposition = get_text(http, addr, "/metrics").await.unwrap_or_default();
    let pool_heap_mib =
        mib(gauge(&exposition, copilot_pool::metrics::DAEMON_HEAP_BYTES).unwrap_or(0.0) as u64);
    let read = move || {
        let all = procfs::all();
        let under: Vec<u32> = procfs::descendants(&all, pid)
            .iter()
            .filter(|p| p.state != 'Z')
            .map(|p| p.pid)
            .collect();
        Sample {
            turns_done,
            seconds,
            pool_rss_mib: mib(copilot_pool::process::rss_bytes(pid).unwrap_or(0)),
            pool_pss_mib: mib(procfs::pss_bytes(pid).unwrap_or(0)),
            pool_heap_mib,
            runtimes_pss_mib: mib(under.iter().filter_map(|p| procfs::pss_bytes(*p)).sum()),
            runtimes_rss_mib: mib(under
                .iter()
                .filter_map(|p| copilot_pool::process::rss_bytes(*p))
                .sum()),
            processes: under.len() as u32,
        }
    };
    match tokio::task::spawn_blocking(read).await {
        Ok(sample) => sample,
        // Only a panic in the read lands here; a zero sample shows in the figures.
        Err(_) => Sample {
            turns_done,
            seconds,
            pool_rss_mib: 0.0,
            pool_pss_mib: 0.0,
            pool_heap_mib,
            runtimes_pss_mib: 0.0,
            runtimes_rss_mib: 0.0,
            processes: 0,
        },
    }
}

/// The sum of every series of counter `name` (those whose labels contain `label`, if given).
fn counter_sum(exposition: &str, name: &str, label: Option<&str>) -> u64 {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(r) => r.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            if label.is_some_and(|want| !labels.contains(want)) {
                return None;
            }
            value.trim().parse::<f64>().ok()
        })
        .sum::<f64>() as u64
}

/// The memory figures of the samples (sorted by turns); warm-up ends at `warm_up` turns.
pub fn summarize(samples: &[Sample], warm_up: u64) -> Summary {
    let peak = |f: fn(&Sample) -> f64| samples.iter().map(f).fold(0.0, f64::max);
    let after: Vec<&Sample> = samples.iter().filter(|s| s.turns_done >= warm_up).collect();
    let at_warm_up = after.first().map(|s| s.runtimes_pss_mib);
    let at_end = samples
        .last()
        .filter(|s| s.turns_done > warm_up)
        .map(|s| s.runtimes_pss_mib);
    let points: Vec<(f64, f64)> = after
        .iter()
        .map(|s| (s.turns_done as f64, s.runtimes_pss_mib))
        .collect();
    Summary {
        warm_up_turns: warm_up,
        pool_peak_rss_mib: peak(|s| s.pool_rss_mib),
        pool_peak_pss_mib: peak(|s| s.pool_pss_mib),
        pool_peak_heap_mib: peak(|s| s.pool_heap_mib),
        runtimes_pss_at_warm_up_mib: at_warm_up,
        runtimes_pss_at_end_mib: at_end,
        runtimes_peak_pss_mib: peak(|s| s.runtimes_pss_mib),
        runtimes_pss_slope_mib_per_1000_turns: slope(&points).map(|s| s * 1000.0),
        processes_peak: samples.iter().map(|s| s.processes).max().unwrap_or(0),
        ..Summary::default()
    }
}

/// The least-squares slope of `points` (`None` with fewer than two distinct x).
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// The run against the targets.
fn checks(summary: &Summary) -> Vec<Check> {
    let flat_per_1000 = FLAT_MIB_PER_TURN * 1000.0;
    vec![
        Check {
            name: "pool RSS under 50 MiB",
            held: summary.pool_peak_rss_mib < POOL_RSS_TARGET_MIB,
            detail: format!(
                "peak {:.1} MiB (target < {POOL_RSS_TARGET_MIB} MiB)",
                summary.pool_peak_rss_mib
            ),
        },
        Check {
            name: "runtimes' total flat after warm-up",
            held: summary
                .runtimes_pss_slope_mib_per_1000_turns
                .is_some_and(|s| s <= flat_per_1000),
            detail: match (
                summary.runtimes_pss_slope_mib_per_1000_turns,
                summary.runtimes_pss_at_warm_up_mib,
                summary.runtimes_pss_at_end_mib,
            ) {
                (Some(slope), Some(warm), Some(end)) => format!(
                    "{slope:+.1} MiB per 1000 turns (at most {flat_per_1000:+.0}: a quarter of the \
                     runtime's smallest leak); PSS {warm:.0} MiB after warm-up, {end:.0} MiB at the end"
                ),
                _ => "too few samples after warm-up to tell (run more turns)".to_owned(),
            },
        },
    ]
}

fn print_report(args: &ScaleArgs, samples: &[Sample], summary: &Summary, checks: &[Check]) {
    println!(
        "{} agents x {} conversations, {} plain turns, {} clients; recycling after {} turns or {} MiB",
        args.agents,
        args.conversations,
        args.turns,
        args.concurrency,
        args.recycle_turns,
        args.recycle_rss_mib
    );
    println!(
        "{:>8} | {:>8} | {:>12} | {:>12} | {:>13} | {:>17} | {:>17} | {:>9}",
        "turns",
        "seconds",
        "pool RSS MiB",
        "pool PSS MiB",
        "pool heap MiB",
        "runtimes PSS MiB",
        "runtimes RSS MiB",
        "processes"
    );
    for s in samples {
        println!(
            "{:>8} | {:>8.1} | {:>12.1} | {:>12.1} | {:>13.1} | {:>17.1} | {:>17.1} | {:>9}",
            s.turns_done,
            s.seconds,
            s.pool_rss_mib,
            s.pool_pss_mib,
            s.pool_heap_mib,
            s.runtimes_pss_mib,
            s.runtimes_rss_mib,
            s.processes
        );
    }
    let opt = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    println!(
        "{} turns ({} failed) in {:.1} s, {:.1} turns/s; {} runtime processes started, {} recycled",
        summary.turns,
        summary.failed_turns,
        summary.seconds,
        summary.turns_per_second,
        summary.process_spawns,
        summary.processes_recycled
    );
    println!(
        "pool peak RSS {:.1} MiB, peak PSS {:.1} MiB, peak live heap {:.1} MiB; runtimes' total PSS {} MiB after warm-up ({} turns), \
         {} MiB at the end, peak {:.1} MiB, slope {} MiB per 1000 turns; at most {} processes",
        summary.pool_peak_rss_mib,
        summary.pool_peak_pss_mib,
        summary.pool_peak_heap_mib,
        opt(summary.runtimes_pss_at_warm_up_mib),
        summary.warm_up_turns,
        opt(summary.runtimes_pss_at_end_mib),
        summary.runtimes_peak_pss_mib,
        opt(summary.runtimes_pss_slope_mib_per_1000_turns),
        summary.processes_peak
    );
    for check in checks {
        println!(
            "{:<7} {}: {}",
            if check.held { "held" } else { "MISSED" },
            check.name,
            check.detail
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(turns_done: u64, runtimes_pss_mib: f64, pool_rss_mib: f64) -> Sample {
        Sample {
            turns_done,
            seconds: turns_done as f64,
            pool_rss_mib,
            pool_pss_mib: pool_rss_mib - 1.0,
            pool_heap_mib: pool_rss_mib / 2.0,
            runtimes_pss_mib,
            runtimes_rss_mib: runtimes_pss_mib * 2.0,
            processes: 3,
        }
    }

    #[test]
    fn the_slope_is_the_least_squares_line_through_the_points() {
        assert_eq!(slope(&[(0.0, 1.0), (10.0, 6.0), (20.0, 11.0)]), Some(0.5));
        assert_eq!(slope(&[(0.0, 1.0)]), None);
        assert_eq!(slope(&[(5.0, 1.0), (5.0, 2.0)]), None);
    }

    #[test]
    fn the_runtimes_are_judged_from_warm_up_on_and_the_pool_on_its_peak() {
        // Growth during warm-up (0..100 turns) does not count; after it, a sawtooth whose
        // recycles keep it level is flat.
        let samples = [
            sample(0, 0.0, 10.0),
            sample(50, 300.0, 20.0),
            sample(100, 600.0, 30.0),
            sample(200, 640.0, 31.0),
            sample(300, 590.0, 32.0),
            sample(400, 640.0, 31.0),
            sample(500, 600.0, 30.0),
        ];
        let summary = summarize(&samples, 100);
        assert_eq!(summary.runtimes_pss_at_warm_up_mib, Some(600.0));
        assert_eq!(summary.runtimes_pss_at_end_mib, Some(600.0));
        assert_eq!(summary.runtimes_peak_pss_mib, 640.0);
        assert_eq!(summary.pool_peak_rss_mib, 32.0);
        let c = checks(&summary);
        assert!(c.iter().all(|c| c.held), "{c:?}");

        // The leak unchecked (0.3 MiB per turn) and a pool over its target: both missed.
        let leaking: Vec<Sample> = (0..=5)
            .map(|i| sample(100 * i, 600.0 + 30.0 * i as f64, 40.0 + 4.0 * i as f64))
            .collect();
        let summary = summarize(&leaking, 100);
        assert_eq!(summary.runtimes_pss_slope_mib_per_1000_turns, Some(300.0));
        let c = checks(&summary);
        assert!(c.iter().all(|c| !c.held), "{c:?}");
    }

    #[test]
    fn counters_are_summed_over_their_series_or_the_matching_ones() {
        let text = "# TYPE copilot_pool_evictions_total counter\n\
                    copilot_pool_evictions_total{reason=\"idle\"} 2\n\
                    copilot_pool_evictions_total{reason=\"drained\"} 5\n\
                    copilot_pool_evictions_total_other 9\n\
                    copilot_pool_process_spawns_total 7\n";
        assert_eq!(counter_sum(text, "copilot_pool_evictions_total", None), 7);
        assert_eq!(
            counter_sum(
                text,
                "copilot_pool_evictions_total",
                Some("reason=\"drained\"")
            ),
            5
        );
        assert_eq!(
            counter_sum(text, "copilot_pool_process_spawns_total", None),
            7
        );
    }
}
