//! The official Node SDK (`@github/copilot-sdk`, pinned to the runtime's version), found or
//! installed the way the runtime is: the one installer that `copilot-pool bench` and the tests
//! that attach the SDK to the SDK endpoint share.
//!
//! Lookup order: [`NODE_SDK_DIR_ENV`] (a directory holding `node_modules/@github/copilot-sdk`)
//! → `<cache>/tools/node-sdk/<version>` (complete when its marker is there) → installed there
//! with `npm install` (optional packages left out: the runtime the SDK spawns, when it spawns
//! one, is always named by path). `<cache>` is the runtime's cache directory.
//!
//! The install runs under an exclusive `flock` on `<cache>/node-sdk-<version>.lock`, into a
//! temporary folder renamed into place when complete, so concurrent processes install once.
//! Waiting for the lock and npm share one deadline; npm runs in its own process group,
//! SIGKILLed at the deadline or when the install is dropped. Every error names the manual fix.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output, Stdio};
use std::time::Duration;

use tokio::process::Command;
use tokio::time::Instant;

use crate::process::GroupLeader;

use super::install::{InstallError, lock_exclusive};

/// The SDK version installed (the one whose runtime the pool runs by default).
pub const NODE_SDK_VERSION: &str = "1.0.14";

/// Names an existing install (a directory holding `node_modules/@github/copilot-sdk`) to use
/// as is.
pub const NODE_SDK_DIR_ENV: &str = "COPILOT_POOL_NODE_SDK_DIR";

/// How long one install may take in all by default: waiting for the lock, then npm.
pub const NODE_SDK_INSTALL_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// Written last into a complete install.
const MARKER: &str = ".copilot-pool-installed";

/// How long to wait for npm to be reaped after its group was sent SIGKILL.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

/// How much of npm's output a failure keeps (its end).
const OUTPUT_TAIL_CHARS: usize = 2000;

/// Why the Node SDK could not be found or installed. Every message ends with the manual fix.
#[derive(Debug, thiserror::Error)]
pub enum NodeSdkError {
    /// [`NODE_SDK_DIR_ENV`] names a directory without the SDK.
    #[error(
        "{NODE_SDK_DIR_ENV} is set, but {} has no dist/index.js; point it at a directory \
         holding node_modules/@github/copilot-sdk, or unset it to install the SDK into the cache",
        package.display()
    )]
    NotInConfiguredDir {
        /// The package directory looked at.
        package: PathBuf,
    },
    /// No cache directory could be found.
    #[error(
        "{0}; or set {NODE_SDK_DIR_ENV} to a directory holding node_modules/@github/copilot-sdk"
    )]
    Cache(#[from] super::CacheDirError),
    /// Taking the install lock failed or timed out.
    #[error("{error}; {fix}")]
    Lock {
        /// The lock error.
        error: InstallError,
        /// The manual fix.
        fix: String,
    },
    /// A filesystem operation failed.
    #[error("could not {action} {}: {error}; {fix}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        error: io::Error,
        /// The manual fix.
        fix: String,
    },
    /// `npm` is not on `PATH`.
    #[error("npm is not on PATH; install Node.js with npm (https://nodejs.org), or {fix}")]
    NpmMissing {
        /// The manual fix.
        fix: String,
    },
    /// npm did not finish before the deadline; its process group was killed.
    #[error(
        "`npm install @github/copilot-sdk@{NODE_SDK_VERSION}` did not finish within {after:?} \
         and was killed; check access to the npm registry (`npm config get registry`), or {fix}"
    )]
    Timeout {
        /// The install's overall timeout.
        after: Duration,
        /// The manual fix.
        fix: String,
    },
    /// npm exited unsuccessfully.
    #[error(
        "`npm install @github/copilot-sdk@{NODE_SDK_VERSION}` failed ({status}); the end of \
         its output:\n{output_tail}\n{fix}"
    )]
    NpmFailed {
        /// npm's exit status.
        status: ExitStatus,
        /// The end of npm's output.
        output_tail: String,
        /// The manual fix.
        fix: String,
    },
    /// npm succeeded but the package is not where it should be.
    #[error("npm succeeded but {} is missing; {fix}", path.display())]
    Missing {
        /// The expected file.
        path: PathBuf,
        /// The manual fix.
        fix: String,
    },
}

/// The package directory (`…/node_modules/@github/copilot-sdk`) under an install prefix.
pub fn node_sdk_package_dir(prefix: &Path) -> PathBuf {
    prefix.join("node_modules/@github/copilot-sdk")
}

/// Where the managed install lives inside the cache directory.
pub fn node_sdk_install_dir(cache_dir: &Path) -> PathBuf {
    cache_dir.join("tools/node-sdk").join(NODE_SDK_VERSION)
}

/// What a person does instead of the automatic install.
fn manual_fix(prefix: &Path) -> String {
    format!(
        "install it by hand with `npm install --prefix {} --omit=optional --ignore-scripts \
         @github/copilot-sdk@{NODE_SDK_VERSION}` and `touch {}`, or set {NODE_SDK_DIR_ENV} to a \
         directory holding node_modules/@github/copilot-sdk",
        prefix.display(),
        prefix.join(MARKER).display()
    )
}

/// The SDK's package directory: from [`NODE_SDK_DIR_ENV`] if set, else the cache's install,
/// installed there first if it is missing (within `timeout`). `env` reads the environment
/// (pass [`process_env`](super::process_env)).
pub async fn find_or_install_node_sdk(
    env: impl Fn(&str) -> Option<OsString>,
    timeout: Duration,
) -> Result<PathBuf, NodeSdkError> {
    if let Some(dir) = env(NODE_SDK_DIR_ENV).filter(|d| !d.is_empty()) {
        let package = node_sdk_package_dir(Path::new(&dir));
        if !package.join("dist/index.js").is_file() {
            return Err(NodeSdkError::NotInConfiguredDir { package });
        }
        return Ok(package);
    }
    let cache = super::cache_dir(&env)?;
    install_node_sdk(&cache, timeout).await
}

/// Whether the cache's install is complete (nothing to install).
pub fn node_sdk_installed(cache_dir: &Path) -> bool {
    let prefix = node_sdk_install_dir(cache_dir);
    prefix.join(MARKER).is_file()
        && node_sdk_package_dir(&prefix)
            .join("dist/index.js")
            .is_file()
}

/// Installs the SDK into `<cache_dir>/tools/node-sdk/<version>` unless it is complete there,
/// under the install lock, and returns its package directory. Gives up (killing npm's
/// process group) once `timeout` has passed since the call.
pub async fn install_node_sdk(
    cache_dir: &Path,
    timeout: Duration,
) -> Result<PathBuf, NodeSdkError> {
    let prefix = node_sdk_install_dir(cache_dir);
    if node_sdk_installed(cache_dir) {
        return Ok(node_sdk_package_dir(&prefix));
    }
    let fix = manual_fix(&prefix);
    let io = |action: &'static str, path: &Path| {
        let (path, fix) = (path.to_path_buf(), fix.clone());
        move |error| NodeSdkError::Io {
            action,
            path,
            error,
            fix,
        }
    };
    let deadline = Instant::now() + timeout;
    std::fs::create_dir_all(cache_dir).map_err(io("create directory", cache_dir))?;
    let lock = cache_dir.join(format!("node-sdk-{NODE_SDK_VERSION}.lock"));
    let _lock = lock_exclusive(lock, deadline, timeout)
        .await
        .map_err(|error| NodeSdkError::Lock {
            error,
            fix: fix.clone(),
        })?;
    if node_sdk_installed(cache_dir) {
        return Ok(node_sdk_package_dir(&prefix));
    }
    let parent = prefix.parent().unwrap_or(cache_dir);
    std::fs::create_dir_all(parent).map_err(io("create directory", parent))?;
    let tmp = parent.join(format!(".{NODE_SDK_VERSION}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io("create directory", &tmp))?;
    let result = run_npm(&tmp, deadline, timeout, &fix).await;
    if let Err(error) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(error);
    }
    std::fs::write(tmp.join(MARKER), NODE_SDK_VERSION).map_err(io("write", &tmp.join(MARKER)))?;
    let _ = std::fs::remove_dir_all(&prefix);
    std::fs::rename(&tmp, &prefix).map_err(io("move the install into place at", &prefix))?;
    Ok(node_sdk_package_dir(&prefix))
}

/// Runs `npm install` into `tmp` in its own process group until `deadline`.
async fn run_npm(
    tmp: &Path,
    deadline: Instant,
    timeout: Duration,
    fix: &str,
) -> Result<(), NodeSdkError> {
    let npm = super::find_on_path("npm", std::env::var_os("PATH")).ok_or_else(|| {
        NodeSdkError::NpmMissing {
            fix: fix.to_owned(),
        }
    })?;
    let mut command = Command::new(&npm);
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
        .arg(tmp)
        .arg(format!("@github/copilot-sdk@{NODE_SDK_VERSION}"))
        .current_dir(tmp)
        .env("npm_config_update_notifier", "false")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let process = GroupLeader::spawn(&mut command).map_err(|error| NodeSdkError::Io {
        action: "start",
        path: npm.clone(),
        error,
        fix: fix.to_owned(),
    })?;
    let Ok(output) = process.output_until(deadline, REAP_AFTER_KILL).await else {
        return Err(NodeSdkError::Timeout {
            after: timeout,
            fix: fix.to_owned(),
        });
    };
    let Output {
        status,
        stdout,
        stderr,
    } = output.map_err(|error| NodeSdkError::Io {
        action: "wait for",
        path: npm,
        error,
        fix: fix.to_owned(),
    })?;
    if !status.success() {
        let mut text = String::from_utf8_lossy(&stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&stderr));
        let skip = text.chars().count().saturating_sub(OUTPUT_TAIL_CHARS);
        return Err(NodeSdkError::NpmFailed {
            status,
            output_tail: text.chars().skip(skip).collect(),
            fix: fix.to_owned(),
        });
    }
    let index = node_sdk_package_dir(tmp).join("dist/index.js");
    if !index.is_file() {
        return Err(NodeSdkError::Missing {
            path: index,
            fix: fix.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_configured_directory_without_the_sdk_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().as_os_str().to_owned();
        let env = move |key: &str| (key == NODE_SDK_DIR_ENV).then(|| path.clone());
        let error = find_or_install_node_sdk(env, Duration::from_secs(1))
            .await
            .expect_err("no SDK there");
        assert!(matches!(error, NodeSdkError::NotInConfiguredDir { .. }));
        assert!(error.to_string().contains("unset it"), "{error}");
    }

    #[tokio::test]
    async fn a_complete_install_in_the_cache_is_used_without_npm() {
        let cache = tempfile::tempdir().expect("tempdir");
        let prefix = node_sdk_install_dir(cache.path());
        let dist = node_sdk_package_dir(&prefix).join("dist");
        std::fs::create_dir_all(&dist).expect("mkdir");
        std::fs::write(dist.join("index.js"), "").expect("index");
        assert!(!node_sdk_installed(cache.path()), "no marker yet");
        std::fs::write(prefix.join(MARKER), NODE_SDK_VERSION).expect("marker");
        let path = cache.path().as_os_str().to_owned();
        let env = move |key: &str| (key == super::super::CACHE_DIR_ENV).then(|| path.clone());
        let found = find_or_install_node_sdk(env, Duration::from_secs(1))
            .await
            .expect("found");
        assert_eq!(found, node_sdk_package_dir(&prefix));
    }
}
