//! Installing a tool the tests need (promtool, schemathesis) with its script of `scripts/`,
//! into `<cache>/tools`: under the tools' exclusive `flock` (`<cache>/tools.lock`, so
//! concurrent test binaries install once and the others wait and reuse it), one deadline for
//! waiting for the lock and running the installer, the installer in its own process group
//! (SIGKILLed at the deadline or when the install is dropped), and every failure naming the
//! manual fix. The one place for this; `promtool` and `schemathesis` say only what they
//! install.

#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output, Stdio};
use std::time::Duration;

use copilot_pool::process::GroupLeader;
use copilot_pool::runtime;
use nix::errno::Errno;
use nix::fcntl::Flock;
use tokio::process::Command;
use tokio::time::Instant;

/// How much of the installer's output a failure keeps (its end).
const OUTPUT_TAIL_BYTES: usize = 4096;

/// How long to wait for the installer to be reaped after its group was sent SIGKILL.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

/// One tool and the script that installs it (`bash <script> --dir <cache>/tools`).
#[derive(Debug, Clone)]
pub struct ToolScript {
    /// For messages (`promtool`).
    pub name: &'static str,
    pub script: PathBuf,
    /// Where the script puts the tool, relative to `<cache>/tools`.
    pub target: PathBuf,
    /// What a person does instead when the install fails.
    pub manual_fix: String,
    /// What a timeout most likely means (`check access to PyPI`).
    pub timeout_hint: &'static str,
}

/// Why [`install`] failed. Each message ends with how to fix it by hand.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("could not {action} {}: {error}; {fix}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        error: std::io::Error,
        fix: String,
    },
    #[error("could not lock {}: {error}; {fix}", path.display())]
    Lock {
        path: PathBuf,
        error: Errno,
        fix: String,
    },
    #[error("could not lock {}: {error}; {fix}", path.display())]
    LockOther {
        path: PathBuf,
        error: String,
        fix: String,
    },
    #[error(
        "gave up after {after:?} waiting for the {tool} install lock {}: another install \
         holds it (if none is running, delete it); {fix}",
        path.display()
    )]
    LockTimeout {
        tool: &'static str,
        path: PathBuf,
        after: Duration,
        fix: String,
    },
    #[error(
        "the {tool} installer ({}) did not finish within {after:?} and was killed with its \
         process group; {hint}, then {fix}",
        script.display()
    )]
    Timeout {
        tool: &'static str,
        script: PathBuf,
        after: Duration,
        hint: &'static str,
        fix: String,
    },
    #[error(
        "the {tool} installer ({}) failed ({status}); the end of its output:\n{output_tail}\n{fix}",
        script.display()
    )]
    Failed {
        tool: &'static str,
        script: PathBuf,
        status: ExitStatus,
        output_tail: String,
        fix: String,
    },
    #[error(
        "the {tool} installer ({}) succeeded but {} is not an executable file; {fix}",
        script.display(),
        path.display()
    )]
    Missing {
        tool: &'static str,
        script: PathBuf,
        path: PathBuf,
        fix: String,
    },
}

/// `path` from the variable `env`, if it is set: it must name an executable file.
pub fn configured(env: &str, manual_fix: &str) -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os(env).filter(|p| !p.is_empty())?);
    assert!(
        runtime::is_executable_file(&path),
        "{env} is set to {}, which is not an executable file; unset it, or {manual_fix}",
        path.display()
    );
    Some(path)
}

/// Where installed tools live inside the cache directory (the scripts' default too).
pub fn tools_dir(cache: &Path) -> PathBuf {
    cache.join("tools")
}

/// The install lock inside the cache directory.
pub fn lock_path(cache: &Path) -> PathBuf {
    cache.join("tools.lock")
}

/// Installs `tool` into `<cache>/tools` unless it is already there, under the install lock,
/// giving up (and killing the installer's process group) once `timeout` has passed since
/// the call. Returns the tool's path.
pub async fn install(
    tool: &ToolScript,
    cache: &Path,
    timeout: Duration,
) -> Result<PathBuf, InstallError> {
    let deadline = Instant::now() + timeout;
    let dir = tools_dir(cache);
    let target = dir.join(&tool.target);
    if runtime::is_executable_file(&target) {
        return Ok(target);
    }
    tokio::fs::create_dir_all(cache)
        .await
        .map_err(io_err(tool, "create directory", cache))?;
    let _lock = lock_exclusive(tool, lock_path(cache), deadline, timeout).await?;
    if runtime::is_executable_file(&target) {
        return Ok(target);
    }
    run_installer(tool, &dir, deadline, timeout).await?;
    if runtime::is_executable_file(&target) {
        Ok(target)
    } else {
        Err(InstallError::Missing {
            tool: tool.name,
            script: tool.script.clone(),
            path: target,
            fix: tool.manual_fix.clone(),
        })
    }
}

/// Runs the installer in its own process group, draining its output, and kills the group at
/// the deadline (or when this future is dropped).
async fn run_installer(
    tool: &ToolScript,
    dir: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), InstallError> {
    let timed_out = || InstallError::Timeout {
        tool: tool.name,
        script: tool.script.clone(),
        after: timeout,
        hint: tool.timeout_hint,
        fix: tool.manual_fix.clone(),
    };
    if Instant::now() >= deadline {
        return Err(timed_out());
    }
    let mut command = Command::new("bash");
    command
        .arg(&tool.script)
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Its own group, so that a kill reaches apt-get, pip and everything else it starts.
    let installer = GroupLeader::spawn(command).map_err(io_err(
        tool,
        "start bash for the installer",
        &tool.script,
    ))?;
    let Ok(output) = installer.output_until(deadline, REAP_AFTER_KILL).await else {
        return Err(timed_out());
    };
    let Output {
        status,
        stdout,
        stderr,
    } = output.map_err(io_err(tool, "wait for the installer", &tool.script))?;
    if status.success() {
        return Ok(());
    }
    let mut output = stdout;
    output.extend_from_slice(&stderr);
    Err(InstallError::Failed {
        tool: tool.name,
        script: tool.script.clone(),
        status,
        output_tail: tail(&output, OUTPUT_TAIL_BYTES),
        fix: tool.manual_fix.clone(),
    })
}

/// The runtime installer's bounded `flock` (`runtime::lock_exclusive`), with its errors in
/// this module's terms.
async fn lock_exclusive(
    tool: &ToolScript,
    path: PathBuf,
    deadline: Instant,
    timeout: Duration,
) -> Result<Flock<File>, InstallError> {
    let fix = tool.manual_fix.clone();
    match runtime::lock_exclusive(path.clone(), deadline, timeout).await {
        Ok(guard) => Ok(guard),
        Err(runtime::InstallError::LockTimeout { path, after }) => Err(InstallError::LockTimeout {
            tool: tool.name,
            path,
            after,
            fix,
        }),
        Err(runtime::InstallError::Lock { path, error }) => {
            Err(InstallError::Lock { path, error, fix })
        }
        Err(other) => Err(InstallError::LockOther {
            path,
            error: other.to_string(),
            fix,
        }),
    }
}

fn tail(bytes: &[u8], max: usize) -> String {
    let start = bytes.len().saturating_sub(max);
    String::from_utf8_lossy(&bytes[start..]).trim().to_owned()
}

fn io_err(
    tool: &ToolScript,
    action: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> InstallError + use<> {
    let path = path.to_path_buf();
    let fix = tool.manual_fix.clone();
    move |error| InstallError::Io {
        action,
        path,
        error,
        fix,
    }
}
