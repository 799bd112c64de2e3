//! The official Node SDK (`@github/copilot-sdk`, pinned below) for the tests that attach it to
//! the SDK endpoint, found or installed the way the runtime is, so that `cargo test` needs
//! nothing beyond Rust and Node.js.
//!
//! Lookup order: `COPILOT_POOL_NODE_SDK_DIR` (a directory holding
//! `node_modules/@github/copilot-sdk`) → `<cache>/tools/node-sdk/<version>` (complete when
//! its marker is there) → installed there with `npm install` (optional packages left out:
//! the SDK attached by URL runs no runtime of its own). `<cache>` is the runtime's cache
//! directory (`COPILOT_POOL_CACHE_DIR`, `$XDG_CACHE_HOME/copilot-pool`,
//! `~/.cache/copilot-pool`).
//!
//! The install runs under an exclusive `flock` on `<cache>/node-sdk-<version>.lock`, into a
//! temporary folder renamed into place when complete, so concurrent test binaries install
//! once. Waiting for the lock and npm share one deadline ([`INSTALL_TIMEOUT`]); npm runs in
//! its own process group, SIGKILLed at the deadline or when the install is dropped. Every
//! failure names the manual fix.
//!
//! Memoized per test binary with a `OnceCell`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use copilot_pool::process::GroupLeader;
use copilot_pool::runtime;
use tokio::process::Command;
use tokio::sync::OnceCell;
use tokio::time::Instant;

/// The SDK version the tests attach (the one whose runtime the pool runs).
pub const VERSION: &str = "1.0.14";

/// Names an existing install to use as is.
pub const ENV: &str = "COPILOT_POOL_NODE_SDK_DIR";

/// How long one install may take in all: waiting for the lock, then npm.
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// Written last into a complete install.
const MARKER: &str = ".copilot-pool-installed";

/// How long to wait for npm to be reaped after its group was sent SIGKILL.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

static SDK: OnceCell<PathBuf> = OnceCell::const_new();

/// The package directory of the SDK (`…/node_modules/@github/copilot-sdk`). Panics with the
/// reason and the manual fix when it is neither configured, cached nor installable.
pub async fn sdk_dir() -> PathBuf {
    SDK.get_or_init(resolve).await.clone()
}

fn package_dir(prefix: &Path) -> PathBuf {
    prefix.join("node_modules/@github/copilot-sdk")
}

fn manual_fix(prefix: &Path) -> String {
    format!(
        "install it by hand with `npm install --prefix {} --omit=optional --ignore-scripts \
         @github/copilot-sdk@{VERSION}` and `touch {}`, or set {ENV} to a directory holding \
         node_modules/@github/copilot-sdk",
        prefix.display(),
        prefix.join(MARKER).display()
    )
}

async fn resolve() -> PathBuf {
    if let Some(dir) = std::env::var_os(ENV).filter(|d| !d.is_empty()) {
        let dir = package_dir(Path::new(&dir));
        assert!(
            dir.join("dist/index.js").is_file(),
            "{ENV} is set, but {} has no dist/index.js",
            dir.display()
        );
        return dir;
    }
    let cache = runtime::cache_dir(runtime::process_env)
        .unwrap_or_else(|err| panic!("cannot find or install the Node SDK for tests: {err}"));
    let prefix = cache.join("tools/node-sdk").join(VERSION);
    if let Err(error) = install(&cache, &prefix).await {
        panic!(
            "cannot install @github/copilot-sdk@{VERSION} for tests: {error}; {}",
            manual_fix(&prefix)
        );
    }
    package_dir(&prefix)
}

/// Installs the SDK into `prefix` unless it is complete there, under the install lock.
async fn install(cache: &Path, prefix: &Path) -> Result<(), String> {
    let deadline = Instant::now() + INSTALL_TIMEOUT;
    std::fs::create_dir_all(cache).map_err(|e| format!("creating {}: {e}", cache.display()))?;
    let lock = cache.join(format!("node-sdk-{VERSION}.lock"));
    let _lock = runtime::lock_exclusive(lock, deadline, INSTALL_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    if prefix.join(MARKER).is_file() && package_dir(prefix).join("dist/index.js").is_file() {
        return Ok(());
    }
    let parent = prefix.parent().unwrap_or(cache);
    std::fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
    let tmp = parent.join(format!(".{VERSION}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    let npm = runtime::find_on_path("npm", std::env::var_os("PATH"))
        .ok_or("npm is not on PATH (install Node.js with npm)")?;
    let mut command = Command::new(npm);
    command
        .args([
            "install",
            "--no-save",
            "--no-audit",
            "--no-fund",
            "--ignore-scripts",
            "--no-package-lock",
            "--omit=optional",
            "--prefix",
        ])
        .arg(&tmp)
        .arg(format!("@github/copilot-sdk@{VERSION}"))
        .current_dir(&tmp)
        .env("npm_config_update_notifier", "false")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let npm = GroupLeader::spawn(&mut command).map_err(|e| format!("starting npm: {e}"))?;
    let Ok(output) = npm.output_until(deadline, REAP_AFTER_KILL).await else {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(format!(
            "npm did not finish within {INSTALL_TIMEOUT:?} and was killed (check access to \
             the npm registry)"
        ));
    };
    let Output {
        status,
        stdout,
        stderr,
    } = output.map_err(|e| format!("waiting for npm: {e}"))?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        let mut text = String::from_utf8_lossy(&stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&stderr));
        let tail: String = text
            .chars()
            .rev()
            .take(2000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return Err(format!("npm failed ({status}):\n{tail}"));
    }
    if !package_dir(&tmp).join("dist/index.js").is_file() {
        return Err("npm succeeded but dist/index.js is missing".to_owned());
    }
    std::fs::write(tmp.join(MARKER), VERSION).map_err(|e| format!("writing the marker: {e}"))?;
    let _ = std::fs::remove_dir_all(prefix);
    std::fs::rename(&tmp, prefix).map_err(|e| format!("moving the install into place: {e}"))
}
