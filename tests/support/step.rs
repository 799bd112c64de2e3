//! One command run to its end by a deadline, in its own process group (SIGKILLed with the
//! group at the deadline or when the future is dropped): what the tool installs and their
//! tests run (make-venv, pip).

#![allow(dead_code)]

use std::process::{Output, Stdio};
use std::time::Duration;

use copilot_pool::process::GroupLeader;
use tokio::process::Command;
use tokio::time::Instant;

/// How long to wait for a step to be reaped after its group was sent SIGKILL.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

/// How much of a failed step's output its error keeps (its end, where the error is).
const TAIL_CHARS: usize = 2000;

/// Runs `command` (`what`, for the errors) to its end by `deadline`: its stdout, or an error
/// with its exit status and the tail of what it printed; past the deadline, an error ending
/// with `hint`.
pub async fn run(
    what: &str,
    mut command: Command,
    deadline: Instant,
    hint: &str,
) -> Result<String, String> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let leader = GroupLeader::spawn(command).map_err(|e| format!("starting {what}: {e}"))?;
    let Ok(output) = leader.output_until(deadline, REAP_AFTER_KILL).await else {
        return Err(format!(
            "{what} did not finish by its deadline and was killed ({hint})"
        ));
    };
    let Output {
        status,
        stdout,
        stderr,
    } = output.map_err(|e| format!("waiting for {what}: {e}"))?;
    let stdout = String::from_utf8_lossy(&stdout).into_owned();
    if status.success() {
        return Ok(stdout);
    }
    let text = stdout + &String::from_utf8_lossy(&stderr);
    let skip = text.chars().count().saturating_sub(TAIL_CHARS);
    let tail: String = text.chars().skip(skip).collect();
    Err(format!("{what} failed ({status}):\n{tail}"))
}
