//! `copilot-pool bench`: one workload (agents x conversations x turns, tool or plain turns,
//! streaming or not) on the same runtime and the same scripted model, four ways: (a) the pool
//! over HTTP/SSE to a real `serve`, (b) the official Node SDK attached by URL to the pool's SDK
//! endpoint, (c) the Node SDK as its product pages show it (one client and runtime per agent,
//! the session resumed before every turn), (d) the Node SDK keeping its sessions attached.
//! Runs alternate (each pair runs every mode once, the order rotating from pair to pair), and
//! each figure is the median of the pairs with its spread; the ratios to (c) are the claims.
//! After the load every agent goes away until its runtime is gone (the pool: evicted after a
//! short idle TTL, a primed warm spare kept per agent; the SDK: its clients stopped) and
//! returns with one turn on its first conversation: the returning agent's cold first event.
//! Prints one table, and one JSON object with `--json`. Finds or installs the runtime and the
//! Node SDK first (cached, under a lock, bounded).
//!
//! `copilot-pool bench scale` is the memory-at-scale run instead (`scale`, drawn by `plot`).
//!
//! This module owns the command's arguments, the order of the runs and the report;
//! `run` owns one run, `stats` the arithmetic, `workload.mjs` the clients.

mod plot;
mod run;
mod scale;
mod stats;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use copilot_pool::runtime;
use copilot_pool::scripted_model::ScriptedModel;
use serde::Serialize;
use serde_json::{Map, Value, json};

use run::{Figures, Setup};
use stats::{Spread, ratios};

/// The clients' side of every mode, written into the scratch directory for Node to run.
const WORKLOAD: &str = include_str!("workload.mjs");

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// Another bench instead of the side-by-side one.
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    /// Agents (each its own runtime process or more).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub agents: u32,
    /// Conversations per agent, all running at once.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub conversations: u32,
    /// Turns per conversation, one after another (the first is cold, the others warm).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub turns: u32,
    /// Every turn is a model call, a gateway (SDK) tool call and a model call (the default).
    #[arg(long, conflicts_with = "plain")]
    pub tool: bool,
    /// Every turn is one model call answering text.
    #[arg(long)]
    pub plain: bool,
    /// Stream the replies' deltas.
    #[arg(long)]
    pub streaming: bool,
    /// Pairs of runs (every mode once per pair); each figure is their median.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub pairs: u32,
    /// How long one turn attempt may take before it counts as failed (after the kill, the SDK
    /// alone learns of its dead runtime only this way).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=600))]
    pub attempt_secs: u64,
    /// End with one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// The runtime executable (default: COPILOT_CLI_PATH, else the managed pinned install,
    /// installed on first use; a `copilot` on PATH is not used).
    #[arg(long)]
    pub cli: Option<PathBuf>,
    /// Conversations each agent's warm spare resumes ahead of its return (`[pool]
    /// warm_spare_conversations`; default: the pool's).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub warm_spare_conversations: Option<u32>,
    /// Write each turn's timeline to this file, one JSON line a turn (emptied first): its run
    /// and mode, its phase (`load`, `return`, `kill`) and, in ms from the phase's start, when
    /// it was sent, when its session was there to send to (over HTTP the answer's head, after
    /// the pool's lease; through an SDK the session created, resumed or kept), its first event
    /// (and that event's type) and its end. Where a cold or returning turn's time went.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
}

impl BenchArgs {
    /// What the pool's runs set `[pool] warm_spare_conversations` to.
    pub fn warm_spare_conversations(&self) -> u32 {
        self.warm_spare_conversations.unwrap_or_else(|| {
            u32::try_from(crate::config::PoolSection::default().warm_spare_conversations)
                .unwrap_or(u32::MAX)
        })
    }

    /// How many conversations each agent's spare holds once it has resumed what it may
    /// ahead of the agent's return: its remembered ones, at most the agent's conversations
    /// and the spare's room (the pool's rule, [`copilot_pool::pool::spare_room`]).
    pub fn resumed_on_each_spare(&self) -> u32 {
        let room = copilot_pool::pool::spare_room(
            crate::config::PoolSection::default().max_sessions_per_process,
        );
        self.conversations
            .min(self.warm_spare_conversations())
            .min(u32::try_from(room).unwrap_or(u32::MAX))
    }
}

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Memory at scale: many agents and conversations through `serve` with recycling on,
    /// sampling the pool's RSS and its runtimes' total PSS every N turns; prints the samples
    /// and a summary against the targets and draws both curves as a PNG.
    Scale(scale::ScaleArgs),
}

/// The four ways of running the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// (a) the pool over HTTP/SSE.
    Http,
    /// (b) the Node SDK attached to the pool's SDK endpoint.
    Endpoint,
    /// (c) the Node SDK alone, resuming before every turn: the baseline.
    SdkResume,
    /// (d) the Node SDK alone, sessions kept attached.
    SdkAttached,
}

impl Mode {
    const ALL: [Mode; 4] = [
        Mode::Http,
        Mode::Endpoint,
        Mode::SdkResume,
        Mode::SdkAttached,
    ];

    /// The mode's name in the JSON and the workload's `MODE`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Http => "http",
            Mode::Endpoint => "endpoint",
            Mode::SdkResume => "resume",
            Mode::SdkAttached => "attached",
        }
    }

    /// The table's column heading.
    fn heading(self) -> &'static str {
        match self {
            Mode::Http => "(a) pool HTTP",
            Mode::Endpoint => "(b) SDK endpoint",
            Mode::SdkResume => "(c) SDK resume",
            Mode::SdkAttached => "(d) SDK attached",
        }
    }
}

/// How a figure is read from one run.
type Read = fn(&Figures) -> Option<f64>;

/// Every figure, by its JSON name, with its table label and how it is read from a run.
const FIGURES: [(&str, &str, Read); 16] = [
    ("turns_per_second", "turns/s", |f| f.turns_per_second),
    ("cold_first_event_p50_ms", "cold first event p50 ms", |f| {
        f.cold_first_event_p50_ms
    }),
    ("first_idle_p50_ms", "first idle p50 ms", |f| {
        f.first_idle_p50_ms
    }),
    ("warm_turn_p50_ms", "warm turn p50 ms", |f| {
        f.warm_turn_p50_ms
    }),
    ("warm_turn_p99_ms", "warm turn p99 ms", |f| {
        f.warm_turn_p99_ms
    }),
    ("runtime_cpu_per_turn_ms", "runtimes CPU/turn ms", |f| {
        f.runtime_cpu_per_turn_ms
    }),
    ("pool_cpu_per_turn_ms", "pool CPU/turn ms", |f| {
        f.pool_cpu_per_turn_ms
    }),
    ("gateway_cpu_per_turn_ms", "gateway CPU/turn ms", |f| {
        f.gateway_cpu_per_turn_ms
    }),
    ("runtime_peak_pss_mib", "runtimes peak PSS MiB", |f| {
        f.runtime_peak_pss_mib
    }),
    (
        "runtime_peak_pss_after_load_mib",
        "runtimes after-load PSS MiB",
        |f| f.runtime_peak_pss_after_load_mib,
    ),
    ("pool_peak_pss_mib", "pool peak PSS MiB", |f| {
        f.pool_peak_pss_mib
    }),
    ("kill_to_ready_ms", "kill to ready ms", |f| {
        f.kill_to_ready_ms
    }),
    (
        "returning_first_event_p50_ms",
        "returning first event p50 ms",
        |f| f.returning_first_event_p50_ms,
    ),
    (
        "returning_first_idle_p50_ms",
        "returning first idle p50 ms",
        |f| f.returning_first_idle_p50_ms,
    ),
    (
        "returning_on_spare_percent",
        "returning on a spare %",
        |f| f.returning_on_spare_percent,
    ),
    ("spare_pss_mib", "spare PSS MiB (each)", |f| f.spare_pss_mib),
];

#[derive(Serialize)]
struct Workload {
    agents: u32,
    conversations: u32,
    turns: u32,
    tool: bool,
    streaming: bool,
    pairs: u32,
    /// `[pool] warm_spare_conversations` in the pool's runs.
    warm_spare_conversations: u32,
    runtime: String,
    node_sdk: &'static str,
}

pub async fn bench(args: BenchArgs) -> Result<()> {
    if let Some(BenchCommand::Scale(scale)) = args.command {
        return scale::scale(scale).await;
    }
    let started = Instant::now();
    let program = crate::demo::find_or_install(args.cli.as_deref()).await?;
    if !runtime::node_sdk_installed(&runtime::cache_dir(runtime::process_env)?)
        && std::env::var_os(runtime::NODE_SDK_DIR_ENV).is_none()
    {
        eprintln!(
            "bench: installing @github/copilot-sdk {} with npm into the cache (first run only)",
            runtime::NODE_SDK_VERSION
        );
    }
    let sdk =
        runtime::find_or_install_node_sdk(runtime::process_env, runtime::NODE_SDK_INSTALL_TIMEOUT)
            .await?;
    if let Some(trace) = &args.trace {
        std::fs::write(trace, b"").with_context(|| {
            format!(
                "emptying the trace file {} (give --trace a writable file path)",
                trace.display()
            )
        })?;
    }
    let scratch = crate::demo::Scratch::create("bench")?;
    let script = scratch.0.join("workload.mjs");
    std::fs::write(&script, WORKLOAD).context("writing the workload script")?;
    let model = ScriptedModel::new();
    let endpoint = model
        .serve_http()
        .await
        .context("starting the scripted model")?;
    let setup = Setup {
        runtime: program.clone(),
        sdk,
        model_url: endpoint.base_url(),
        model_id: ScriptedModel::MODEL_ID.to_owned(),
        script,
        scratch: scratch.0.clone(),
    };

    // runs[mode][pair]
    let mut runs: Vec<Vec<Figures>> = vec![Vec::new(); Mode::ALL.len()];
    let mut index = 0;
    let mut failures = Vec::new();
    for pair in 0..args.pairs as usize {
        for k in 0..Mode::ALL.len() {
            // Rotated, so no mode always runs first (cold caches) or last (a warm machine).
            let m = (pair + k) % Mode::ALL.len();
            let mode = Mode::ALL[m];
            eprintln!(
                "bench: pair {}/{}, {} ({:.0} s so far)",
                pair + 1,
                args.pairs,
                mode.heading(),
                started.elapsed().as_secs_f64()
            );
            index += 1;
            // A failed run costs its figures, not the others' (a long bench is not lost to
            // one); the command still fails at the end.
            let figures = match run::run(mode, &args, &setup, index).await {
                Ok(figures) => figures,
                Err(error) => {
                    let error = format!("pair {}, {}: {error:#}", pair + 1, mode.heading());
                    eprintln!("bench: {error}");
                    failures.push(error);
                    Figures::default()
                }
            };
            runs[m].push(figures);
        }
    }
    endpoint.shutdown().await;

    let mut report = report(&args, &program, &runs);
    report["failed_runs"] = json!(failures);
    print_table(&args, &runs);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    if !failures.is_empty() {
        bail!(
            "{} of {} runs failed (their figures are left out above): {}",
            failures.len(),
            index,
            failures.join("; ")
        );
    }
    Ok(())
}

/// The mode every ratio is taken against: (c), the SDK in the product pages' mode.
fn baseline() -> usize {
    Mode::ALL
        .iter()
        .position(|m| *m == Mode::SdkResume)
        .unwrap_or(0)
}

/// One figure summed up across the modes, for the table and the JSON object alike.
struct FigureRow {
    name: &'static str,
    label: &'static str,
    /// Each mode's spread (in `Mode::ALL` order).
    per_mode: Vec<Option<Spread>>,
    /// For each mode but the baseline: its index and the spread of its pair-by-pair ratios
    /// to the baseline's runs.
    ratios: Vec<(usize, Option<Spread>)>,
}

fn figure_rows(runs: &[Vec<Figures>]) -> Vec<FigureRow> {
    let baseline = baseline();
    FIGURES
        .iter()
        .map(|(name, label, read)| {
            let values = |m: usize| -> Vec<Option<f64>> { runs[m].iter().map(read).collect() };
            let base = values(baseline);
            FigureRow {
                name,
                label,
                per_mode: (0..runs.len()).map(|m| Spread::of(&values(m))).collect(),
                ratios: (0..runs.len())
                    .filter(|m| *m != baseline)
                    .map(|m| (m, Spread::of(&ratios(&values(m), &base))))
                    .collect(),
            }
        })
        .collect()
}

/// The JSON object: the workload, every figure of every mode, and the ratios to (c).
fn report(args: &BenchArgs, program: &std::path::Path, runs: &[Vec<Figures>]) -> Value {
    let mut modes: Vec<Map<String, Value>> = vec![Map::new(); Mode::ALL.len()];
    let mut vs: Vec<Map<String, Value>> = vec![Map::new(); Mode::ALL.len()];
    for row in figure_rows(runs) {
        for (m, spread) in row.per_mode.iter().enumerate() {
            modes[m].insert(row.name.to_owned(), json!(spread));
        }
        for (m, spread) in &row.ratios {
            vs[*m].insert(row.name.to_owned(), json!(spread));
        }
    }
    let baseline = baseline();
    let name = |m: usize| Mode::ALL[m].name().to_owned();
    let modes: Map<String, Value> = modes
        .into_iter()
        .enumerate()
        .map(|(m, figures)| (name(m), Value::Object(figures)))
        .collect();
    let vs: Map<String, Value> = vs
        .into_iter()
        .enumerate()
        .filter(|(m, _)| *m != baseline)
        .map(|(m, ratios)| (name(m), Value::Object(ratios)))
        .collect();
    json!({
        "workload": Workload {
            agents: args.agents,
            conversations: args.conversations,
            turns: args.turns,
            tool: !args.plain,
            streaming: args.streaming,
            pairs: args.pairs,
            warm_spare_conversations: args.warm_spare_conversations(),
            runtime: program.display().to_string(),
            node_sdk: runtime::NODE_SDK_VERSION,
        },
        "machine": machine(),
        "modes": modes,
        "ratios_vs_resume": vs,
    })
}

/// What the numbers were measured on: cores and the load average when the bench ended.
fn machine() -> Value {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    json!({"cpus": cpus, "loadavg": crate::procfs::load_average()})
}

/// One table: a row per figure, the median [min-max] of each mode, then each mode / (c).
fn print_table(args: &BenchArgs, runs: &[Vec<Figures>]) {
    println!(
        "{} agents x {} conversations x {} turns, {} turns{}, {} pair(s), {} conversation(s) \
         resumed on each spare; median [min-max]",
        args.agents,
        args.conversations,
        args.turns,
        if args.plain { "plain" } else { "tool" },
        if args.streaming { ", streaming" } else { "" },
        args.pairs,
        args.resumed_on_each_spare()
    );
    let baseline = baseline();
    let mut header = format!("{:<28}", "");
    for mode in Mode::ALL {
        header.push_str(&format!(" | {:<22}", mode.heading()));
    }
    for (m, mode) in Mode::ALL.iter().enumerate() {
        if m != baseline {
            header.push_str(&format!(
                " | {:<17}",
                format!("{} / (c)", &mode.heading()[..3])
            ));
        }
    }
    println!("{header}");
    for row in figure_rows(runs) {
        let mut line = format!("{:<28}", row.label);
        for spread in &row.per_mode {
            line.push_str(&format!(" | {:<22}", cell(spread.as_ref(), 1)));
        }
        for (_, spread) in &row.ratios {
            line.push_str(&format!(" | {:<17}", cell(spread.as_ref(), 2)));
        }
        println!("{line}");
    }
}

fn cell(spread: Option<&Spread>, decimals: usize) -> String {
    match spread {
        None => "-".to_owned(),
        Some(s) if s.runs.len() == 1 => format!("{:.decimals$}", s.median),
        Some(s) => format!(
            "{:.decimals$} [{:.decimals$}-{:.decimals$}]",
            s.median, s.min, s.max
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs_of(turns_per_second: [&[f64]; 4]) -> Vec<Vec<Figures>> {
        turns_per_second
            .iter()
            .map(|values| {
                values
                    .iter()
                    .map(|v| Figures {
                        turns_per_second: Some(*v),
                        ..Figures::default()
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_mode_but_the_sdk_resume_one_is_compared_to_it_pair_by_pair() {
        assert_eq!(Mode::ALL[baseline()], Mode::SdkResume);
        let runs = runs_of([&[4.0, 6.0], &[3.0, 3.0], &[2.0, 3.0], &[1.0, 1.5]]);
        let rows = figure_rows(&runs);
        let turns = rows
            .iter()
            .find(|r| r.name == "turns_per_second")
            .expect("the turns/s row");
        let medians: Vec<Option<f64>> = turns
            .per_mode
            .iter()
            .map(|s| s.as_ref().map(|s| s.median))
            .collect();
        assert_eq!(medians, [Some(5.0), Some(3.0), Some(2.5), Some(1.25)]);
        let ratios: Vec<(usize, Option<f64>)> = turns
            .ratios
            .iter()
            .map(|(m, s)| (*m, s.as_ref().map(|s| s.median)))
            .collect();
        assert_eq!(ratios, [(0, Some(2.0)), (1, Some(1.25)), (3, Some(0.5))]);
        // A figure no run measured has no spread in any mode.
        let cold = rows
            .iter()
            .find(|r| r.name == "cold_first_event_p50_ms")
            .expect("the cold row");
        assert!(cold.per_mode.iter().all(Option::is_none));
    }
}
