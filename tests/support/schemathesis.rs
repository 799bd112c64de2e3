//! schemathesis (the OpenAPI fuzzer, from PyPI) for the contract test, found or installed the
//! way promtool is, so that `cargo test` needs nothing beyond Rust, Node.js and Python 3.
//!
//! Lookup order: `SCHEMATHESIS_PYTHON` (a python that has schemathesis) →
//! `<cache>/tools/schemathesis-<version>/bin/python` → installed there by
//! `scripts/install-schemathesis.sh` (a virtual environment of its own, pinned version), where
//! `<cache>` is the runtime's cache directory (`COPILOT_POOL_CACHE_DIR`,
//! `$XDG_CACHE_HOME/copilot-pool`, `~/.cache/copilot-pool`).
//!
//! The install runs under the tools' exclusive `flock` (`<cache>/tools.lock`, shared with
//! promtool's), one deadline for the lock and the installer ([`INSTALL_TIMEOUT`]), and the
//! installer in its own process group, killed at the deadline. A failure names the manual fix.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use copilot_pool::process::GroupLeader;
use copilot_pool::runtime;
use tokio::process::Command;
use tokio::sync::OnceCell;
use tokio::time::Instant;

/// Names a python that has schemathesis installed, to use as is.
pub const ENV: &str = "SCHEMATHESIS_PYTHON";

/// The pinned version (the installer's `version`).
pub const VERSION: &str = "4.32.5";

/// What a person runs to install it by hand (into the cache the tests look in).
pub const INSTALL_COMMAND: &str = "bash scripts/install-schemathesis.sh";

/// How long one install may take in all: waiting for the lock, then pip.
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(5 * 60);

const REAP_AFTER_KILL: Duration = Duration::from_secs(5);
const OUTPUT_TAIL_BYTES: usize = 4096;

static PYTHON: OnceCell<PathBuf> = OnceCell::const_new();

fn manual_fix() -> String {
    format!(
        "run `{INSTALL_COMMAND}` from the repository root by hand (it needs python3 with venv \
         and PyPI), or set {ENV} to a python that has schemathesis=={VERSION}"
    )
}

/// The python to run `-m schemathesis.cli` with. Panics with the reason and the manual fix
/// when it is neither configured, cached, nor installable.
pub async fn python() -> PathBuf {
    PYTHON.get_or_init(resolve).await.clone()
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
        .unwrap_or_else(|err| panic!("cannot find or install schemathesis: {err}"));
    install(&cache, INSTALL_TIMEOUT)
        .await
        .unwrap_or_else(|err| {
            panic!(
                "cannot install schemathesis for tests: {err}; {}",
                manual_fix()
            )
        })
}

/// The environment's python inside the cache.
pub fn python_in(cache: &Path) -> PathBuf {
    cache
        .join("tools")
        .join(format!("schemathesis-{VERSION}"))
        .join("bin/python")
}

/// Installs schemathesis under `<cache>/tools` unless it is there, under the tools' lock,
/// giving up (and killing the installer's process group) once `timeout` has passed.
pub async fn install(cache: &Path, timeout: Duration) -> Result<PathBuf, String> {
    let target = python_in(cache);
    if runtime::is_executable_file(&target) {
        return Ok(target);
    }
    let deadline = Instant::now() + timeout;
    std::fs::create_dir_all(cache).map_err(|e| format!("create {}: {e}", cache.display()))?;
    let lock = cache.join("tools.lock");
    let _lock = runtime::lock_exclusive(lock, deadline, timeout)
        .await
        .map_err(|e| e.to_string())?;
    if runtime::is_executable_file(&target) {
        return Ok(target);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/install-schemathesis.sh");
    let mut command = Command::new("bash");
    command
        .arg(&script)
        .arg("--dir")
        .arg(cache.join("tools"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let installer = GroupLeader::spawn(&mut command)
        .map_err(|e| format!("start bash for {}: {e}", script.display()))?;
    let Ok(output) = installer.output_until(deadline, REAP_AFTER_KILL).await else {
        return Err(format!(
            "the installer ({}) did not finish within {timeout:?} and was killed with its \
             process group; check access to PyPI",
            script.display()
        ));
    };
    let Output {
        status,
        stdout,
        stderr,
    } = output.map_err(|e| format!("wait for the installer: {e}"))?;
    if !status.success() {
        let mut all = stdout;
        all.extend_from_slice(&stderr);
        let start = all.len().saturating_sub(OUTPUT_TAIL_BYTES);
        return Err(format!(
            "the installer ({}) failed ({status}); the end of its output:\n{}",
            script.display(),
            String::from_utf8_lossy(&all[start..]).trim()
        ));
    }
    if runtime::is_executable_file(&target) {
        Ok(target)
    } else {
        Err(format!(
            "the installer succeeded but {} is not an executable file",
            target.display()
        ))
    }
}
