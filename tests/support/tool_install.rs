//! Installing a tool the tests need (promtool, schemathesis) with its script of `scripts/`,
//! into `<cache>/tools`: under the tools' exclusive `flock` (`<cache>/tools.lock`, so
//! concurrent test binaries install once and the others wait and reuse it), one deadline for
//! waiting for the lock and running the installer, the installer in its own process group
//! (SIGKILLed at the deadline or when the install is dropped), and every failure naming the
//! manual fix. The one place for this; `promtool` and `schemathesis` say only what they
//! install. Also the one check of the `node` the tests' Node tools run on (the official Node
//! SDK, Gemini CLI): [`require_node`].

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
use tokio::sync::OnceCell;
use tokio::time::Instant;

/// How much of the installer's output a failure keeps (its end).
const OUTPUT_TAIL_BYTES: usize = 4096;

/// How long to wait for the installer to be reaped after its group was sent SIGKILL.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

/// The Node.js versions the tests' Node tools run on: the official Node SDK's `engines`
/// (Gemini CLI's, `>=20`, is wider).
pub const NODE_ENGINES: &str = "^20.19.0 || >=22.12.0";

/// How long `node --version` may take (a failure guard).
const NODE_VERSION_TIMEOUT: Duration = Duration::from_secs(30);

/// The outcome of checking the `node` on `PATH`, once per test binary.
static NODE: OnceCell<Result<(), String>> = OnceCell::const_new();

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
    /// How the temporary folders the installer makes in `<cache>/tools` begin
    /// (`.schemathesis-install.`): one killed at its deadline leaves its folder, which the
    /// next install removes under the lock.
    pub leftovers: Option<&'static str>,
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
         holds it (the lock goes with its process: `fuser -v` on the file names it; never \
         delete the file, which would let a second install run beside it); {fix}",
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
    if let Some(prefix) = tool.leftovers {
        remove_leftovers(&dir, prefix);
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

/// Removes the folders `<dir>/<prefix>*` that installs killed at their deadline left (their
/// SIGKILL ran no cleanup), as the runtime's installer does; call it with the install's lock
/// held, so that none of them is another install's work in progress.
pub fn remove_leftovers(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            // Best effort: what stays is tried again by the next install.
            let _ = std::fs::remove_dir_all(entry.path());
        }
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

/// Panics, naming the versions needed and the one found, unless the first `node` on `PATH`
/// is one [`NODE_ENGINES`] accepts; `what` (`the official Node SDK`) is what needs it. Asks
/// `node --version` once per test binary, by a deadline.
pub async fn require_node(what: &str) {
    if let Err(error) = NODE.get_or_init(check_node).await {
        panic!("cannot run {what} for tests: {error}");
    }
}

async fn check_node() -> Result<(), String> {
    let fix = "install Node.js 22.12 or later (or 20.19 or later of Node.js 20; Debian 12's \
               own nodejs is 18: take it from nodejs.org or NodeSource) and put it first on PATH";
    let node = runtime::find_on_path("node", std::env::var_os("PATH"))
        .ok_or_else(|| format!("there is no `node` on PATH; {fix}"))?;
    let mut command = Command::new(&node);
    command.arg("--version");
    let what = format!("{} --version", node.display());
    let deadline = Instant::now() + NODE_VERSION_TIMEOUT;
    let printed = super::step::run(&what, command, deadline, "a failure guard")
        .await
        .map_err(|error| format!("{error}; {fix}"))?;
    let version = printed.trim();
    if node_version_supported(version) {
        Ok(())
    } else {
        Err(format!(
            "{} is Node.js {version}, but the tests' Node tools need {NODE_ENGINES} (the \
             official Node SDK's `engines`); {fix}",
            node.display()
        ))
    }
}

/// Whether `node --version`'s `version` (`v20.19.0`) is one [`NODE_ENGINES`] accepts.
pub fn node_version_supported(version: &str) -> bool {
    let Some(numbers) = version.strip_prefix('v') else {
        return false;
    };
    // A pre-release (`v23.0.0-rc.1`) counts as its release.
    let numbers = numbers.split('-').next().unwrap_or_default();
    let parsed: Vec<u64> = numbers.split('.').map_while(|n| n.parse().ok()).collect();
    let &[major, minor, patch] = parsed.as_slice() else {
        return false;
    };
    let version = (major, minor, patch);
    (major == 20 && version >= (20, 19, 0)) || version >= (22, 12, 0)
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

#[cfg(test)]
mod tests {
    use super::node_version_supported;

    #[test]
    fn node_versions_are_checked_against_the_node_sdks_engines() {
        for refused in [
            "v18.20.4", "v20.18.0", "v20.18.9", "v21.0.0", "v21.7.3", "v22.11.0", "20.19.0",
            "v20.19", "", "node",
        ] {
            assert!(!node_version_supported(refused), "{refused} accepted");
        }
        for accepted in [
            "v20.19.0",
            "v20.20.2",
            "v22.12.0",
            "v23.0.0",
            "v24.1.0",
            "v25.0.0-rc.1",
        ] {
            assert!(node_version_supported(accepted), "{accepted} refused");
        }
    }
}
