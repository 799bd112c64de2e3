//! `promtool` (Prometheus' metrics checker) for the tests that validate the `/metrics`
//! exposition, found or installed the way the Copilot runtime is, so that `cargo test` needs
//! nothing beyond Rust and Node.js on a Debian-like machine.
//!
//! Lookup order: `PROMTOOL` (must name an executable) → `<cache>/tools/promtool` → `promtool`
//! on `PATH` → installed into `<cache>/tools` by `scripts/install-promtool.sh` (the
//! executables of Debian's `prometheus` package), where `<cache>` is the runtime's cache
//! directory (`COPILOT_POOL_CACHE_DIR`, `$XDG_CACHE_HOME/copilot-pool`,
//! `~/.cache/copilot-pool`).
//!
//! The install runs under an exclusive `flock` on `<cache>/tools.lock`, so concurrent test
//! binaries (or test runs) install once and the others wait and reuse it. Waiting for the lock
//! and running the installer share one deadline ([`INSTALL_TIMEOUT`]); the installer runs in its
//! own process group, which is SIGKILLed when the deadline passes or the install is dropped.
//! Every failure names the manual fix, [`INSTALL_COMMAND`].
//!
//! Memoized per test binary with a `OnceCell`.

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

/// Names an existing promtool to use as is.
pub const ENV: &str = "PROMTOOL";

/// What a person runs to install promtool by hand (into the same cache the tests look in).
pub const INSTALL_COMMAND: &str = "bash scripts/install-promtool.sh";

/// How long one install may take in all: waiting for the lock, then the installer.
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// How much of the installer's output a failure keeps (its end).
const OUTPUT_TAIL_BYTES: usize = 4096;

/// How long to wait for the installer to be reaped after its group was sent SIGKILL.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

static PROMTOOL: OnceCell<PathBuf> = OnceCell::const_new();

/// Why [`install`] failed. Each message ends with how to fix it by hand.
#[derive(Debug, thiserror::Error)]
pub enum PromtoolError {
    #[error("could not {action} {}: {error}; {}", path.display(), manual_fix())]
    Io {
        action: &'static str,
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("could not lock {}: {error}; {}", path.display(), manual_fix())]
    Lock { path: PathBuf, error: Errno },
    #[error("could not lock {}: {error}; {}", path.display(), manual_fix())]
    LockOther { path: PathBuf, error: String },
    #[error(
        "gave up after {after:?} waiting for the promtool install lock {}: another install \
         holds it (if none is running, delete it); {}",
        path.display(),
        manual_fix()
    )]
    LockTimeout { path: PathBuf, after: Duration },
    #[error(
        "the promtool installer ({}) did not finish within {after:?} and was killed with its \
         process group; check access to the Debian package mirror (apt-get download \
         prometheus), then {}",
        script.display(),
        manual_fix()
    )]
    Timeout { script: PathBuf, after: Duration },
    #[error(
        "the promtool installer ({}) failed ({status}); the end of its output:\n{output_tail}\n{}",
        script.display(),
        manual_fix()
    )]
    Failed {
        script: PathBuf,
        status: ExitStatus,
        output_tail: String,
    },
    #[error(
        "the promtool installer ({}) succeeded but {} is not an executable file; {}",
        script.display(),
        path.display(),
        manual_fix()
    )]
    Missing { script: PathBuf, path: PathBuf },
}

fn manual_fix() -> String {
    format!(
        "run `{INSTALL_COMMAND}` from the repository root by hand (it puts promtool where the \
         tests look), or set {ENV} to a promtool executable"
    )
}

/// The promtool the tests run. Panics with the reason and the manual fix when it is neither
/// configured, cached, on `PATH`, nor installable.
pub async fn promtool_path() -> PathBuf {
    PROMTOOL.get_or_init(resolve).await.clone()
}

async fn resolve() -> PathBuf {
    if let Some(path) = std::env::var_os(ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            runtime::is_executable_file(&path),
            "{ENV} is set to {}, which is not an executable file; unset it, or {}",
            path.display(),
            manual_fix()
        );
        return path;
    }
    let cache = runtime::cache_dir(runtime::process_env)
        .unwrap_or_else(|err| panic!("cannot find or install promtool for tests: {err}"));
    let cached = tools_dir(&cache).join("promtool");
    if runtime::is_executable_file(&cached) {
        return cached;
    }
    if let Some(found) = runtime::find_on_path("promtool", std::env::var_os("PATH")) {
        return found;
    }
    install(&install_script(), &cache, INSTALL_TIMEOUT)
        .await
        .unwrap_or_else(|err| panic!("cannot install promtool for tests: {err}"))
}

/// `scripts/install-promtool.sh` of this checkout.
pub fn install_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/install-promtool.sh")
}

/// Where installed tools live inside the cache directory (the script's default too).
pub fn tools_dir(cache: &Path) -> PathBuf {
    cache.join("tools")
}

/// The install lock inside the cache directory.
pub fn lock_path(cache: &Path) -> PathBuf {
    cache.join("tools.lock")
}

/// Installs promtool into `<cache>/tools` with `bash <script> --dir <cache>/tools` unless it
/// is already there, under the install lock, giving up (and killing the installer's process
/// group) once `timeout` has passed since the call.
pub async fn install(
    script: &Path,
    cache: &Path,
    timeout: Duration,
) -> Result<PathBuf, PromtoolError> {
    let deadline = Instant::now() + timeout;
    let dir = tools_dir(cache);
    tokio::fs::create_dir_all(cache)
        .await
        .map_err(io_err("create directory", cache))?;
    let _lock = lock_exclusive(lock_path(cache), deadline, timeout).await?;
    let target = dir.join("promtool");
    if runtime::is_executable_file(&target) {
        return Ok(target);
    }
    run_installer(script, &dir, deadline, timeout).await?;
    if runtime::is_executable_file(&target) {
        Ok(target)
    } else {
        Err(PromtoolError::Missing {
            script: script.to_path_buf(),
            path: target,
        })
    }
}

/// Runs the installer in its own process group, draining its output, and kills the group at
/// the deadline (or when this future is dropped).
async fn run_installer(
    script: &Path,
    dir: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), PromtoolError> {
    let timed_out = || PromtoolError::Timeout {
        script: script.to_path_buf(),
        after: timeout,
    };
    if Instant::now() >= deadline {
        return Err(timed_out());
    }
    let mut command = Command::new("bash");
    command
        .arg(script)
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Its own group, so that a kill reaches apt-get and everything else it starts.
    let installer =
        GroupLeader::spawn(&mut command).map_err(io_err("start bash for the installer", script))?;
    let Ok(output) = installer.output_until(deadline, REAP_AFTER_KILL).await else {
        return Err(timed_out());
    };
    let Output {
        status,
        stdout,
        stderr,
    } = output.map_err(io_err("wait for the installer", script))?;
    if status.success() {
        return Ok(());
    }
    let mut output = stdout;
    output.extend_from_slice(&stderr);
    Err(PromtoolError::Failed {
        script: script.to_path_buf(),
        status,
        output_tail: tail(&output, OUTPUT_TAIL_BYTES),
    })
}

/// The runtime installer's bounded `flock` (`runtime::lock_exclusive`), with its errors in
/// this module's terms.
async fn lock_exclusive(
    path: PathBuf,
    deadline: Instant,
    timeout: Duration,
) -> Result<Flock<File>, PromtoolError> {
    match runtime::lock_exclusive(path.clone(), deadline, timeout).await {
        Ok(guard) => Ok(guard),
        Err(runtime::InstallError::LockTimeout { path, after }) => {
            Err(PromtoolError::LockTimeout { path, after })
        }
        Err(runtime::InstallError::Lock { path, error }) => {
            Err(PromtoolError::Lock { path, error })
        }
        Err(other) => Err(PromtoolError::LockOther {
            path,
            error: other.to_string(),
        }),
    }
}

fn tail(bytes: &[u8], max: usize) -> String {
    let start = bytes.len().saturating_sub(max);
    String::from_utf8_lossy(&bytes[start..]).trim().to_owned()
}

fn io_err(
    action: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> PromtoolError + use<> {
    let path = path.to_path_buf();
    move |error| PromtoolError::Io {
        action,
        path,
        error,
    }
}
