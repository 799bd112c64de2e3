//! The `copilot-pool` binary: the daemon (`serve`), its operator commands (`doctor`,
//! `status`, `install-cli`), one prompt (`run`), the workloads that drive the pool on the
//! embedded model (`demo`, `chaos`, `load`, `bench`), and the hidden `sandbox-exec` wrapper
//! and `scripted-model`. The only place that installs a tracing subscriber, a metrics
//! recorder or signal handlers (`interrupt` and `serve`), none of which the library does.

mod bench;
mod chaos;
mod config;
mod demo;
mod doctor;
mod heap;
mod install;
mod interrupt;
mod load;
mod model;
mod procfs;
mod run;
mod sandbox;
mod serve;
mod status;

use anyhow::Result;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "copilot-pool",
    version,
    about = "Supervises pools of GitHub Copilot CLI processes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The pool at work: N agents x C conversations x M turns on the embedded scripted
    /// model, with a worker killed and a token rotated mid-run. Installs the runtime if
    /// it is missing.
    Demo(demo::DemoArgs),
    /// Agents x conversations x turns through the HTTP API while a seeded fault injector
    /// kills and stops runtimes, fails disk writes, rotates keys and aborts and drops turns;
    /// then checks the invariants (no hung turn, no lost history, no torn transcript, no
    /// orphan) and exits 1 if one is broken.
    Chaos(chaos::ChaosArgs),
    /// Many concurrent SSE clients and turns against one `serve` started for the run,
    /// sampling the daemon's memory, descriptors and tasks (flat after warm-up?) and its
    /// lease waits against the bound.
    Load(load::LoadArgs),
    /// One workload four ways on the same runtime and scripted model: the pool over HTTP, the
    /// official Node SDK attached to the pool's SDK endpoint, and the Node SDK alone (resuming
    /// before every turn, and keeping sessions attached), in alternating runs; prints each
    /// figure's median and spread and the ratios to the SDK alone. Installs the runtime and
    /// the Node SDK if they are missing.
    Bench(bench::BenchArgs),
    /// Install the pinned Copilot runtime with npm into the cache directory and print the
    /// path of its executable. Safe to run twice or concurrently.
    InstallCli(install::InstallArgs),
    /// Check what `serve` needs: the config, the runtime (started once in a throwaway home),
    /// the state and agents directories, and the bindings. Exits 1 if any check fails.
    Doctor(doctor::DoctorArgs),
    /// Show a running daemon's pool (`GET /v1/pool`) as a table.
    Status(status::StatusArgs),
    /// Serve the embedded scripted model on loopback HTTP (for workloads against `serve` in
    /// tests and CI; stops on SIGINT).
    #[command(hide = true)]
    ScriptedModel(model::ModelArgs),
    /// Run the pool as a sidecar daemon with an HTTP API for gateways, health endpoints and
    /// Prometheus metrics.
    Serve(serve::ServeArgs),
    /// Start one worker, send one prompt, and print the reply as it streams. Uses the
    /// embedded scripted model unless a provider or the logged-in user is configured.
    Run(run::RunArgs),
    /// The wrapper a sandboxed worker starts through: drops every capability, applies a
    /// Landlock ruleset, then execs the program after `--` (the daemon runs it).
    #[command(hide = true, name = "sandbox-exec")]
    SandboxExec(sandbox::SandboxExecArgs),
}

/// A command line clap refused: printed as clap prints it; `serve`'s exits 78 like any
/// configuration it refuses (a restart will not help), the others as clap does (2; help and
/// the version 0).
fn refused_command_line(error: clap::Error) -> std::process::ExitCode {
    let _ = error.print();
    let serve = std::env::args_os().nth(1).is_some_and(|a| a == "serve");
    if serve && error.use_stderr() {
        return std::process::ExitCode::from(config::EXIT_CONFIG);
    }
    std::process::ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(2))
}

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return refused_command_line(error),
    };
    // The wrapper execs the runtime from this one thread: no logging, no async runtime.
    let cli = match cli.command {
        Command::SandboxExec(args) => return sandbox::main(args),
        command => Cli { command },
    };
    // What `serve`'s config file and flags ask of the logs and the async runtime; a bad
    // file is reported by `serve` itself.
    let serve_config = match &cli.command {
        Command::Serve(args) => args.config().ok(),
        _ => None,
    };
    // The demo reports what the pool does itself; its crashes are on purpose.
    let (default_level, json) = match &cli.command {
        Command::Demo(_) | Command::Chaos(_) | Command::Load(_) | Command::Bench(_) => {
            ("error", false)
        }
        Command::Serve(_) => (
            "info",
            serve_config
                .as_ref()
                .is_some_and(|c| c.log_format == config::LogFormat::Json),
        ),
        _ => ("warn", false),
    };
    // The MCP bridge's SDK (rmcp) logs each stateless request's service start and end at
    // info: three lines per CLI tool call. Its warnings still show.
    let filter = EnvFilter::try_from_env("COPILOT_POOL_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{default_level},rmcp=warn")));
    // A log line that cannot be written is dropped: tracing-subscriber's own report of the
    // failure is an `eprintln!`, which panics when stderr's reader is gone (EPIPE), and a
    // daemon whose log reader died must still serve and drain.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false);
    if json {
        logs.json().init();
    } else {
        logs.init();
    }
    raise_nofile_limit();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Command::Serve(_) = &cli.command {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = serve_config
            .and_then(|c| c.worker_threads)
            .unwrap_or_else(|| config::default_worker_threads(cpus));
        builder.worker_threads(threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("copilot-pool: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: Result<()> = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => interrupt::until_interrupted(demo::demo(args)).await,
            Command::Chaos(args) => interrupt::until_interrupted(chaos::chaos(args)).await,
            Command::Load(args) => interrupt::until_interrupted(load::load(args)).await,
            Command::Bench(args) => interrupt::until_interrupted(bench::bench(args)).await,
            Command::InstallCli(args) => {
                interrupt::until_interrupted(install::install_cli(args)).await
            }
            Command::Run(args) => run::run(args).await,
            Command::Serve(args) => serve::serve(args).await,
            Command::Doctor(args) => interrupt::until_interrupted(doctor::doctor(args)).await,
            Command::ScriptedModel(args) => model::scripted_model(args).await,
            Command::Status(args) => status::status(args).await,
            // Returned from above, before any thread started.
            Command::SandboxExec(_) => Ok(()),
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Not `eprintln!`: it panics on a closed stderr, and the exit code (78 for a
            // configuration refused) is what a supervisor reads then.
            use std::io::Write;
            let _ = writeln!(std::io::stderr().lock(), "copilot-pool: {e:#}");
            if e.chain().any(|cause| cause.is::<config::ConfigRefused>()) {
                std::process::ExitCode::from(config::EXIT_CONFIG)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit: the daemon holds a descriptor per
/// client connection and several per runtime process, and common soft defaults (1024) run
/// out long before the hard limit does. Children inherit the raised limit.
fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %e, "Could not raise the open-files limit.");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "Could not read the open-files limit."),
    }
}
