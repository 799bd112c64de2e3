//! Interrupts (Ctrl-C, SIGTERM) of the commands that start children: the command's work is
//! dropped at the first signal, and with it every guard that owns a child (a process group
//! leader's is killed with its group; a daemon's runtimes die with it), so an interrupted
//! `bench`, `demo`, `chaos`, `load`, `run`, `install-cli` (npm) or `doctor` (a runtime started
//! once) leaves no process behind. The children lead their own process groups, so a
//! terminal's Ctrl-C never reaches them by itself.

use std::future::Future;

use anyhow::{Result, anyhow};

/// Resolves on the first SIGINT or SIGTERM, with the signal's name.
pub async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        // Without handlers the default action (exit) applies; never resolve here.
        _ => std::future::pending().await,
    }
}

/// Runs `work` to its end, or until the first SIGINT or SIGTERM: then `work` is dropped
/// (its children with it) and the command fails saying which signal ended it. The handlers
/// are in place before `work` first runs (`biased`: the signal branch is polled first), so
/// no child starts while a signal could still end the process by its default action.
pub async fn until_interrupted<T>(work: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::select! {
        biased;
        signal = interrupted() => Err(anyhow!("interrupted by {signal}")),
        outcome = work => outcome,
    }
}
