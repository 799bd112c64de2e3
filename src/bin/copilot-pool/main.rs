//! The `copilot-pool` binary: installs the pinned runtime and runs one-shot prompts. The
//! only place that installs a tracing subscriber or signal handlers.

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
    /// Install the pinned Copilot runtime with npm into the cache directory and print the
    /// path of its executable. Safe to run twice or concurrently.
    InstallCli(install::InstallArgs),
    /// Start one worker, send one prompt, and print the reply as it streams. Uses the
    /// embedded scripted model unless a provider or the logged-in user is configured.
    Run(run::RunArgs),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("COPILOT_POOL_LOG").unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
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
