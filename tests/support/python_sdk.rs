//! The official Python SDK (`github-copilot-sdk`, pinned below) for the tests that attach it
//! to the SDK endpoint, found or installed the way the runtime and the Node SDK are, so that
//! `cargo test` needs nothing beyond Rust and Node.js on a Debian-like machine.
//!
//! Lookup order: `COPILOT_POOL_PYTHON_SDK_PYTHON` (a Python that imports `copilot` at this
//! version) → `<cache>/tools/python-sdk/<version>/bin/python` (a virtual environment,
//! complete when its marker is there) → installed there: a virtual environment made by
//! [`MAKE_VENV`] (the `python3` on `PATH`, else Debian's Python unpacked into the cache), then
//! `pip install github-copilot-sdk==<version>`. `<cache>` is the runtime's cache directory
//! (`COPILOT_POOL_CACHE_DIR`, `$XDG_CACHE_HOME/copilot-pool`, `~/.cache/copilot-pool`).
//!
//! The install runs under an exclusive `flock` on `<cache>/python-sdk-<version>.lock`, into a
//! temporary directory renamed into place when complete (the environment's `bin/python` is a
//! link to the Python that made it and finds its packages relative to itself, so the move keeps it
//! working; only `python` is ever run from it), so concurrent test binaries install once.
//! Waiting for the lock, `venv` and pip share one deadline ([`INSTALL_TIMEOUT`]); each runs
//! in its own process group, SIGKILLed at the deadline or when the install is dropped. Every
//! failure names the manual fix.
//!
//! Memoized per test binary with a `OnceCell`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use copilot_pool::runtime;
use tokio::process::Command;
use tokio::sync::OnceCell;
use tokio::time::Instant;

/// The SDK version the tests attach.
pub const VERSION: &str = "1.0.27";

/// The package on PyPI.
pub const PACKAGE: &str = "github-copilot-sdk";

/// Names a Python to use as is.
pub const ENV: &str = "COPILOT_POOL_PYTHON_SDK_PYTHON";

/// How long one install may take in all: waiting for the lock, venv, then pip.
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// Makes a virtual environment with pip at its argument, whether or not a Python is installed.
pub const MAKE_VENV: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/make-venv.sh");

/// Written last into a complete install.
const MARKER: &str = ".copilot-pool-installed";

static PYTHON: OnceCell<PathBuf> = OnceCell::const_new();

/// One install step by the install's deadline (see [`super::step::run`]).
async fn run(what: &str, command: Command, deadline: Instant) -> Result<(), String> {
    super::step::run(
        what,
        command,
        deadline,
        "check access to the Python package index, and to Debian's package archive on a \
         machine without python3",
    )
    .await
    .map(drop)
}

/// The Python of an environment with the SDK installed. Panics with the reason and the
/// manual fix when it is neither configured, cached nor installable.
pub async fn python() -> PathBuf {
    PYTHON.get_or_init(resolve).await.clone()
}

fn python_in(prefix: &Path) -> PathBuf {
    prefix.join("bin/python")
}

fn manual_fix(prefix: &Path) -> String {
    format!(
        "install it by hand with `bash {MAKE_VENV} {p} && {p}/bin/python -m pip install \
         {PACKAGE}=={VERSION}` and `touch {m}`, or set {ENV} to a Python that imports copilot \
         ({PACKAGE} {VERSION})",
        p = prefix.display(),
        m = prefix.join(MARKER).display()
    )
}

async fn resolve() -> PathBuf {
    let fix = format!("set it to a Python that imports copilot ({PACKAGE} {VERSION})");
    if let Some(python) = super::tool_install::configured(ENV, &fix) {
        return python;
    }
    let cache = runtime::cache_dir(runtime::process_env)
        .unwrap_or_else(|err| panic!("cannot find or install the Python SDK for tests: {err}"));
    let prefix = cache.join("tools/python-sdk").join(VERSION);
    if let Err(error) = install(&cache, &prefix).await {
        panic!(
            "cannot install {PACKAGE}=={VERSION} for tests: {error}; {}",
            manual_fix(&prefix)
        );
    }
    python_in(&prefix)
}

/// Installs the SDK into a virtual environment at `prefix` unless it is complete there,
/// under the install lock.
async fn install(cache: &Path, prefix: &Path) -> Result<(), String> {
    let deadline = Instant::now() + INSTALL_TIMEOUT;
    std::fs::create_dir_all(cache).map_err(|e| format!("creating {}: {e}", cache.display()))?;
    let lock = cache.join(format!("python-sdk-{VERSION}.lock"));
    let _lock = runtime::lock_exclusive(lock, deadline, INSTALL_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    if prefix.join(MARKER).is_file() && python_in(prefix).exists() {
        return Ok(());
    }
    let parent = prefix.parent().unwrap_or(cache);
    std::fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
    // What installs killed at their deadline left (any process's: the lock is held).
    let tmp_prefix = format!(".{VERSION}.tmp-");
    super::tool_install::remove_leftovers(parent, &tmp_prefix);
    let tmp = parent.join(format!("{tmp_prefix}{}", std::process::id()));
    let mut venv = Command::new("bash");
    venv.arg(MAKE_VENV).arg(&tmp);
    if let Err(error) = run("make-venv.sh", venv, deadline).await {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(error);
    }
    let mut pip = Command::new(python_in(&tmp));
    pip.env("PIP_NO_INPUT", "1")
        .args([
            "-m",
            "pip",
            "install",
            "--no-input",
            "--disable-pip-version-check",
            "--quiet",
        ])
        .arg(format!("{PACKAGE}=={VERSION}"));
    if let Err(error) = run("pip install", pip, deadline).await {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(error);
    }
    std::fs::write(tmp.join(MARKER), VERSION).map_err(|e| format!("writing the marker: {e}"))?;
    let _ = std::fs::remove_dir_all(prefix);
    std::fs::rename(&tmp, prefix).map_err(|e| format!("moving the install into place: {e}"))
}
