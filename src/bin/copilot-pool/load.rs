//! `copilot-pool load`: many concurrent SSE clients and many turns against one real daemon
//! (`copilot-pool serve` started as a child of this command, on loopback, the scripted model
//! in this process), sampling the daemon's resident memory, live heap, open descriptors and
//! async tasks as the turns go, and its lease waits against the configured bound.
//!
//! Warm-up is one turn per client (every conversation and process exists after it); the
//! daemon is read once idle after warm-up and once idle at the end, and [`checks`] says
//! whether it stayed flat between the two (exit 1 if not). Prints the samples, the checks
//! and a summary (and one JSON object with `--json`).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use copilot_pool::process::GroupLeader;
use copilot_pool::scripted_model::ScriptedModel;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Args)]
pub struct LoadArgs {
    /// Concurrent clients, each with its own conversation and SSE stream.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=2000))]
    clients: u32,
    /// Agents the conversations belong to (each its own runtime process or more).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=200))]
    agents: u32,
    /// Turns in all.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    turns: u64,
    /// The daemon's `[pool] wait_timeout_secs` (the bound lease waits are held to).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=3600))]
    wait_timeout_secs: u64,
    /// End with one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// The runtime executable (default: COPILOT_CLI_PATH, the managed install, `copilot` on PATH).
    #[arg(long)]
    cli: Option<std::path::PathBuf>,
}

/// One reading of the daemon.
#[derive(Debug, Clone, Copy, Serialize)]
struct Sample {
    turns_done: u64,
    seconds: f64,
    rss_bytes: u64,
    /// The daemon's live heap, from its `copilot_pool_daemon_heap_bytes` gauge.
    heap_bytes: u64,
    fds: u64,
    tasks: u64,
}

/// One check of the run, held or broken.
#[derive(Debug, Serialize)]
struct Check {
    name: &'static str,
    held: bool,
    detail: String,
}

/// Whether the idle daemon at the end is where it was idle after warm-up (with the noise
/// each figure has: the allocator's caches, a descriptor or task winding down), whether
/// every turn succeeded, and whether the lease waits kept their bound.
fn checks(
    warm: &Sample,
    end: &Sample,
    failed: u64,
    p99: Option<f64>,
    bound_seconds: u64,
    clients: u64,
) -> Vec<Check> {
    // The daemon keeps connections to the model alive (the guard's HTTP client), each with
    // its connection task: at most one per concurrent client, and how many the warm-up's
    // reading saw depends on how its turns overlapped. A leak grows with the turns.
    let connections = 4 + clients;
    let mib = |b: u64| b as f64 / 1048576.0;
    let within =
        |name, what: &str, warm: u64, end: u64, slack: u64, unit: &dyn Fn(u64) -> String| Check {
            name,
            held: end <= warm + slack,
            detail: format!(
                "{what} {} after warm-up, {} at the end (at most {} more allowed)",
                unit(warm),
                unit(end),
                unit(slack)
            ),
        };
    let bytes = |b: u64| format!("{:.1} MiB", mib(b));
    let count = |n: u64| n.to_string();
    vec![
        Check {
            name: "every turn succeeded",
            held: failed == 0,
            detail: format!("{failed} failed"),
        },
        within(
            "live heap flat after warm-up",
            "live heap",
            warm.heap_bytes,
            end.heap_bytes,
            (4 << 20u64).max(warm.heap_bytes / 10),
            &bytes,
        ),
        within(
            "resident memory flat after warm-up",
            "RSS",
            warm.rss_bytes,
            end.rss_bytes,
            (8 << 20u64).max(warm.rss_bytes / 5),
            &bytes,
        ),
        within(
            "descriptors flat after warm-up",
            "descriptors",
            warm.fds,
            end.fds,
            connections,
            &count,
        ),
        within(
            "tasks flat after warm-up",
            "tasks",
            warm.tasks,
            end.tasks,
            connections,
            &count,
        ),
        Check {
            name: "lease waits within their bound",
            held: p99.is_none_or(|p| p <= bound_seconds as f64),
            detail: format!(
                "p99 {} (bound {bound_seconds} s)",
                p99.map(|p| format!("<= {p} s"))
                    .unwrap_or_else(|| "n/a".into())
            ),
        },
    ]
}

#[derive(Serialize)]
struct Report {
    clients: u32,
    agents: u32,
    turns: u64,
    failed_turns: u64,
    seconds: f64,
    turns_per_second: f64,
    lease_wait_p99_seconds: Option<f64>,
    /// CPU seconds per turn of the daemon itself and of its runtime processes.
    daemon_cpu_per_turn_seconds: f64,
    runtimes_cpu_per_turn_seconds: f64,
    wait_bound_seconds: u64,
    after_warm_up: Sample,
    end: Sample,
    checks: Vec<Check>,
    samples: Vec<Sample>,
}

pub async fn load(args: LoadArgs) -> Result<()> {
    let crate::demo::Workbench {
        program,
        scratch,
        model: _model,
        endpoint,
    } = crate::demo::Workbench::prepare(args.cli.as_deref(), "load").await?;
    let model_url = endpoint.base_url();

    let config = scratch.0.join("serve.toml");
    // One process per key and no warm spares: placement may open a second process for a
    // key under the load's concurrency (and a spare starts on its key's first quiet tick
    // after it), which the warm-up's idle reading may or may not have seen, so the daemon's
    // descriptors and tasks at the end would differ from it by a process or two (its pipes
    // and its actor's tasks) whatever the daemon keeps. The check is for what the daemon
    // keeps; its processes are counted elsewhere.
    std::fs::write(
        &config,
        format!(
            "[pool]\nmax_sessions = {}\nmax_waiters = {}\nmax_waiters_per_agent = {}\nwait_timeout_secs = {}\nwarm_spares = 0\nmax_processes_per_key = 1\n\n[model]\nallow_private_endpoints = true\n",
            args.clients.max(1024),
            args.clients.max(1024),
            args.clients.max(1024),
            args.wait_timeout_secs
        ),
    )
    .context("writing the daemon's config")?;
    // `/metrics` is served on the API's own listener.
    let Daemon {
        process: mut daemon,
        addr,
        ..
    } = start_daemon(&program, &scratch.0, &config, &[]).await?;
    let metrics_addr = addr;
    let daemon_pid = daemon.pid().context("the daemon's pid")?;
    eprintln!(
        "load: daemon {daemon_pid} on {addr}; {} clients over {} agents, {} turns",
        args.clients, args.agents, args.turns
    );

    // No kept-alive connections: an idle daemon's descriptors are then its own.
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()
        .context("an HTTP client")?;
    let cpu_at_start = crate::procfs::tree_cpu_seconds(daemon_pid);
    let started = Instant::now();
    let next_turn = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    // Warm-up: one turn per client, then all wait at the barrier until the idle daemon has
    // been read.
    let warmed_up = Arc::new(tokio::sync::Barrier::new(args.clients as usize + 1));
    let (go_tx, go) = tokio::sync::watch::channel(false);
    let clients = (0..args.clients).map(|c| {
        let (http, model_url) = (http.clone(), model_url.clone());
        let (next_turn, done, failed) = (next_turn.clone(), done.clone(), failed.clone());
        let (warmed_up, mut go) = (warmed_up.clone(), go.clone());
        let agent = format!("agent-{}", c % args.agents);
        let total = args.turns;
        tokio::spawn(async move {
            let body = json!({
                "agent_id": agent,
                "session_key": format!("conversation-{c}"),
                "prompt": "REPLY=ok",
                "model": ScriptedModel::MODEL_ID,
                "provider": {"type": "openai", "base_url": model_url, "api_key": "load-key"},
            });
            let one = || async {
                if next_turn.fetch_add(1, Ordering::SeqCst) >= total {
                    return false;
                }
                if turn(&http, addr, &body).await.as_deref() != Ok("idle") {
                    failed.fetch_add(1, Ordering::SeqCst);
                }
                done.fetch_add(1, Ordering::SeqCst);
                true
            };
            one().await;
            warmed_up.wait().await;
            if go.wait_for(|g| *g).await.is_err() {
                return;
            }
            while one().await {}
        })
    });
    let clients: Vec<_> = clients.collect();
    warmed_up.wait().await;
    let after_warm_up = idle_sample(&http, daemon_pid, metrics_addr, &done, started).await;
    eprintln!(
        "load: warmed up ({} turns); idle daemon: RSS {:.1} MiB, live heap {:.1} MiB, {} descriptors, {} tasks",
        after_warm_up.turns_done,
        after_warm_up.rss_bytes as f64 / 1048576.0,
        after_warm_up.heap_bytes as f64 / 1048576.0,
        after_warm_up.fds,
        after_warm_up.tasks
    );
    let _ = go_tx.send(true);
    let mut samples = vec![after_warm_up];
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // A daemon that dies (the OOM killer, a crash) ends the run at once: its turns
            // would only fail, and its readings are gone.
            status = daemon.wait() => {
                for client in &clients {
                    client.abort();
                }
                endpoint.shutdown().await;
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                bail!(
                    "the daemon exited during the load ({status}) after {} turns; its log is \
                     above (COPILOT_POOL_LOG=info shows more of it)",
                    done.load(Ordering::SeqCst)
                );
            }
        }
        let finished = clients.iter().all(|c| c.is_finished());
        samples.push(sample(&http, daemon_pid, metrics_addr, &done, started).await);
        if finished {
            break;
        }
        if let Some(last) = samples.last() {
            eprintln!(
                "load: {:>6} turns, daemon RSS {:>6.1} MiB, live heap {:>6.1} MiB, {:>4} descriptors, {:>5} tasks",
                last.turns_done,
                last.rss_bytes as f64 / 1048576.0,
                last.heap_bytes as f64 / 1048576.0,
                last.fds,
                last.tasks
            );
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let end = idle_sample(&http, daemon_pid, metrics_addr, &done, started).await;
    samples.push(end);
    let (daemon_cpu, runtimes_cpu) = crate::procfs::tree_cpu_seconds(daemon_pid);
    let (daemon_cpu, runtimes_cpu) = (daemon_cpu - cpu_at_start.0, runtimes_cpu - cpu_at_start.1);
    let exposition = get_text(&http, metrics_addr, "/metrics")
        .await
        .unwrap_or_default();
    let p99 = histogram_quantile(&exposition, copilot_pool::metrics::LEASE_WAIT_SECONDS, 0.99);

    // Stop the daemon as an operator would (SIGTERM: it drains and stops its children).
    daemon.group().signal(nix::sys::signal::Signal::SIGTERM);
    let stopped = tokio::time::timeout(Duration::from_secs(60), daemon.wait()).await;
    endpoint.shutdown().await;
    let orphans = crate::demo::count_orphans(&scratch.0, &[]).await;

    let turns = done.load(Ordering::SeqCst);
    let failed_turns = failed.load(Ordering::SeqCst);
    let checks = checks(
        &after_warm_up,
        &end,
        failed_turns,
        p99,
        args.wait_timeout_secs,
        u64::from(args.clients),
    );
    let report = Report {
        clients: args.clients,
        agents: args.agents,
        turns,
        failed_turns,
        seconds,
        turns_per_second: turns as f64 / seconds,
        lease_wait_p99_seconds: p99,
        daemon_cpu_per_turn_seconds: daemon_cpu / turns.max(1) as f64,
        runtimes_cpu_per_turn_seconds: runtimes_cpu / turns.max(1) as f64,
        wait_bound_seconds: args.wait_timeout_secs,
        after_warm_up,
        end,
        checks,
        samples,
    };
    println!(
        "{} turns ({} failed) in {:.1} s, {:.1} turns/s; lease wait p99 {} (bound {} s)",
        report.turns,
        report.failed_turns,
        report.seconds,
        report.turns_per_second,
        p99.map(|p| format!("<= {p} s"))
            .unwrap_or_else(|| "n/a".into()),
        args.wait_timeout_secs
    );
    println!(
        "CPU per turn: daemon {:.2} ms, its runtimes {:.2} ms (the daemon {:.1} % of the runtimes')",
        report.daemon_cpu_per_turn_seconds * 1e3,
        report.runtimes_cpu_per_turn_seconds * 1e3,
        100.0 * daemon_cpu / runtimes_cpu.max(f64::MIN_POSITIVE)
    );
    for (name, s) in [("after warm-up", after_warm_up), ("at the end", end)] {
        println!(
            "idle daemon {name:<14} ({:>6} turns): RSS {:>6.1} MiB, live heap {:>6.1} MiB, {:>4} descriptors, {:>5} tasks",
            s.turns_done,
            s.rss_bytes as f64 / 1048576.0,
            s.heap_bytes as f64 / 1048576.0,
            s.fds,
            s.tasks
        );
    }
    for check in &report.checks {
        println!(
            "{:<7} {}: {}",
            if check.held { "held" } else { "BROKEN" },
            check.name,
            check.detail
        );
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    if stopped.is_err() {
        bail!("the daemon did not stop within 60 s of SIGTERM (its group was killed)");
    }
    if orphans > 0 {
        bail!("{orphans} runtime processes outlived the daemon");
    }
    let broken: Vec<&str> = report
        .checks
        .iter()
        .filter(|c| !c.held)
        .map(|c| c.name)
        .collect();
    if !broken.is_empty() {
        bail!("{} check(s) broken: {}", broken.len(), broken.join(", "));
    }
    Ok(())
}

/// A `copilot-pool serve` child on loopback: its process group, its API's address, and its
/// SDK endpoint's address when it was asked for one.
pub(crate) struct Daemon {
    pub(crate) process: GroupLeader,
    pub(crate) addr: SocketAddr,
    pub(crate) sdk: Option<String>,
}

/// Starts `copilot-pool serve` (this executable, with `extra` arguments) in its own process
/// group on a loopback port; returns it with its addresses, read from the lines it prints
/// (the SDK endpoint's `sdk on` comes before `listening on`). Its later output is drained.
pub(crate) async fn start_daemon(
    program: &Path,
    dir: &Path,
    config: &Path,
    extra: &[&str],
) -> Result<Daemon> {
    let me = std::env::current_exe().context("finding this executable")?;
    let mut command = tokio::process::Command::new(me);
    command
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--cli")
        .arg(program)
        .env("COPILOT_POOL_HOME", dir.join("pool-home"))
        // Quiet unless the operator asked for the daemon's log (to see where a run's time goes).
        .env(
            "COPILOT_POOL_LOG",
            std::env::var("COPILOT_POOL_LOG").unwrap_or_else(|_| "error".to_owned()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut process = GroupLeader::spawn(command).context("starting the daemon")?;
    let stdout = process
        .take_stdout()
        .context("the daemon's standard output")?;
    let mut lines = BufReader::new(stdout).lines();
    let (mut addr, mut sdk) = (None, None);
    let read = async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(a) = line.strip_prefix("sdk on ") {
                sdk = Some(a.to_owned());
            }
            if let Some(a) = line.strip_prefix("listening on http://") {
                addr = a.parse().ok();
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .context("the daemon did not say where it listens within 60 s")?;
    // Whatever it prints later must not fill the pipe and block it.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    match addr {
        Some(addr) => Ok(Daemon { process, addr, sdk }),
        None => bail!("the daemon exited before it said where it listens (see its log above)"),
    }
}

/// One streamed turn; its `turn.end` status, or what went wrong.
pub(crate) async fn turn(
    http: &reqwest::Client,
    addr: SocketAddr,
    body: &Value,
) -> Result<String, String> {
    let response = http
        .post(format!("http://{addr}/v1/turns"))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("HTTP {}", response.status()));
    }
    let mut events = response.bytes_stream().eventsource();
    while let Some(event) = events.next().await {
        let event = event.map_err(|e| e.to_string())?;
        if event.event == "turn.end" {
            let data: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
            return Ok(data["status"].as_str().unwrap_or("unknown").to_owned());
        }
    }
    Err("the stream ended without turn.end".to_owned())
}

async fn sample(
    http: &reqwest::Client,
    pid: u32,
    metrics: SocketAddr,
    done: &AtomicU64,
    started: Instant,
) -> Sample {
    let rss_bytes = copilot_pool::process::rss_bytes(pid).unwrap_or(0);
    let fds = crate::procfs::fd_count(pid);
    let exposition = get_text(http, metrics, "/metrics")
        .await
        .unwrap_or_default();
    let tasks = gauge(&exposition, copilot_pool::metrics::DAEMON_TASKS).unwrap_or(0.0) as u64;
    let heap_bytes =
        gauge(&exposition, copilot_pool::metrics::DAEMON_HEAP_BYTES).unwrap_or(0.0) as u64;
    Sample {
        turns_done: done.load(Ordering::SeqCst),
        seconds: started.elapsed().as_secs_f64(),
        rss_bytes,
        heap_bytes,
        fds,
        tasks,
    }
}

/// A sample of the daemon once it is idle: no lease held or waiting, and its descriptor count
/// settled for a second (the last streams' connections closed); bounded, then read as it is.
async fn idle_sample(
    http: &reqwest::Client,
    pid: u32,
    addr: SocketAddr,
    done: &AtomicU64,
    started: Instant,
) -> Sample {
    let fds = || crate::procfs::fd_count(pid);
    // Settled: idle, and the same descriptor count for a second (five readings 200 ms
    // apart): on a loaded machine the last connections take more than one tick to go.
    const STABLE_READINGS: u32 = 5;
    let settle = async {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let mut last = None;
        let mut same = 0;
        loop {
            tick.tick().await;
            let status: Option<Value> = get_text(http, addr, "/v1/pool")
                .await
                .and_then(|t| serde_json::from_str(&t).ok());
            let idle = status.is_some_and(|s| {
                s["leased"].as_u64() == Some(0) && s["waiters"].as_u64() == Some(0)
            });
            let now = fds();
            same = if idle && last == Some(now) {
                same + 1
            } else {
                0
            };
            if same + 1 >= STABLE_READINGS {
                return;
            }
            last = idle.then_some(now);
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(30), settle).await;
    sample(http, pid, addr, done, started).await
}

pub(crate) async fn get_text(
    http: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
) -> Option<String> {
    let response = http.get(format!("http://{addr}{path}")).send().await.ok()?;
    response.text().await.ok()
}

/// The value of an unlabelled gauge in a Prometheus exposition.
pub(crate) fn gauge(exposition: &str, name: &str) -> Option<f64> {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The upper bound of the bucket holding quantile `q` of an unlabelled histogram.
fn histogram_quantile(exposition: &str, name: &str, q: f64) -> Option<f64> {
    let prefix = format!("{name}_bucket{{le=\"");
    let buckets: Vec<(f64, f64)> = exposition
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect();
    let total = buckets.last()?.1;
    if total == 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, count)| *count >= q * total)
        .map(|(le, _)| *le)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantile_is_the_first_bucket_holding_it() {
        let text = "x_bucket{le=\"0.1\"} 90\nx_bucket{le=\"0.5\"} 99\nx_bucket{le=\"1\"} 100\nx_bucket{le=\"+Inf\"} 100\n";
        assert_eq!(histogram_quantile(text, "x", 0.5), Some(0.1));
        assert_eq!(histogram_quantile(text, "x", 0.99), Some(0.5));
        assert_eq!(histogram_quantile(text, "x", 1.0), Some(1.0));
        assert_eq!(histogram_quantile("", "x", 0.99), None);
    }

    fn idle(heap_mib: u64, rss_mib: u64, fds: u64, tasks: u64) -> Sample {
        Sample {
            turns_done: 0,
            seconds: 0.0,
            rss_bytes: rss_mib << 20,
            heap_bytes: heap_mib << 20,
            fds,
            tasks,
        }
    }

    fn broken(checks: &[Check]) -> Vec<&'static str> {
        checks.iter().filter(|c| !c.held).map(|c| c.name).collect()
    }

    #[test]
    fn a_daemon_idle_where_it_was_after_warm_up_holds_every_check() {
        let warm = idle(10, 40, 60, 30);
        let end = idle(11, 47, 63, 33);
        assert!(broken(&checks(&warm, &end, 0, Some(0.5), 120, 0)).is_empty());
        // The model connections 8 clients may leave kept alive, each with its task; a
        // descriptor and a task a turn is past them.
        let kept = idle(10, 40, 72, 42);
        assert!(broken(&checks(&warm, &kept, 0, None, 120, 8)).is_empty());
        assert_eq!(
            broken(&checks(&warm, &idle(10, 40, 120, 90), 0, None, 120, 8)),
            ["descriptors flat after warm-up", "tasks flat after warm-up"]
        );
    }

    #[test]
    fn growth_past_the_noise_breaks_the_check_of_what_grew() {
        let warm = idle(10, 40, 60, 30);
        assert_eq!(
            broken(&checks(&warm, &idle(15, 40, 60, 30), 0, None, 120, 0)),
            ["live heap flat after warm-up"]
        );
        assert_eq!(
            broken(&checks(&warm, &idle(10, 49, 60, 30), 0, None, 120, 0)),
            ["resident memory flat after warm-up"]
        );
        assert_eq!(
            broken(&checks(&warm, &idle(10, 40, 65, 35), 0, None, 120, 0)),
            ["descriptors flat after warm-up", "tasks flat after warm-up"]
        );
        assert_eq!(
            broken(&checks(&warm, &warm.clone(), 1, Some(121.0), 120, 0)),
            ["every turn succeeded", "lease waits within their bound"]
        );
    }

    #[test]
    fn a_gauge_is_read_by_its_exact_name() {
        let text = "x_tasks 12\nx_tasks_total 99\n";
        assert_eq!(gauge(text, "x_tasks"), Some(12.0));
        assert_eq!(gauge(text, "y"), None);
    }
}
