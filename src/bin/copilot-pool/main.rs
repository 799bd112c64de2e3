//! The `copilot-pool` binary: installs the pinned runtime and runs one-shot prompts. The
//! only place that installs a tracing subscriber or signal handlers.

mod demo;
mod install;
mod run;

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
    /// Install the pinned Copilot runtime with npm into the cache directory and print the
    /// path of its executable. Safe to run twice or concurrently.
    InstallCli(install::InstallArgs),
    /// Start one worker, send one prompt, and print the reply as it streams. Uses the
    /// embedded scripted model unless a provider or the logged-in user is configured.
    Run(run::RunArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The demo reports what the pool does itself; its crashes are on purpose.
    let default_level = match cli.command {
        Command::Demo(_) => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("COPILOT_POOL_LOG")
                .unwrap_or_else(|_| EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("copilot-pool: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result: Result<()> = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo::demo(args).await,
            Command::InstallCli(args) => install::install_cli(args).await,
            Command::Run(args) => run::run(args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("copilot-pool: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
