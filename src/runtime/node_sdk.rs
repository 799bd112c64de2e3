//! The official Node SDK (`@github/copilot-sdk`, pinned to the runtime's version), found or
//! installed the way the runtime is: the one installer that `copilot-pool bench` and the tests
//! that attach the SDK to the SDK endpoint share.
//!
//! Lookup order: [`NODE_SDK_DIR_ENV`] (a directory holding `node_modules/@github/copilot-sdk`)
//! → `<cache>/tools/node-sdk/<version>` (complete when its marker is there) → installed there
//! by the runtime's own installer ([`install`](super::install): one lock, one deadline, npm in
//! its own process group, an atomic rename, the marker), with optional packages left out (the
//! runtime the SDK spawns, when it spawns one, is always named by path).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::install::{InstallError, NpmPackage, OptionalDeps, install_package};

/// The SDK version installed (the one whose runtime the pool runs by default).
pub const NODE_SDK_VERSION: &str = "1.0.14";

/// Names an existing install (a directory holding `node_modules/@github/copilot-sdk`) to use
/// as is.
pub const NODE_SDK_DIR_ENV: &str = "COPILOT_POOL_NODE_SDK_DIR";

/// How long one install may take in all by default: waiting for the lock, then npm.
pub const NODE_SDK_INSTALL_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// The SDK's entry point, relative to an install prefix: what makes an install complete.
const ENTRY_POINT: &str = "node_modules/@github/copilot-sdk/dist/index.js";

/// Why the Node SDK could not be found or installed. Every message says the manual fix.
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
    /// The install failed (its message says why and what to do).
    #[error("{0}")]
    Install(#[from] InstallError),
}

/// The package directory (`…/node_modules/@github/copilot-sdk`) under an install prefix.
pub fn node_sdk_package_dir(prefix: &Path) -> PathBuf {
    prefix.join("node_modules/@github/copilot-sdk")
}

/// The SDK as one pinned npm package of the cache (`<cache>/tools/node-sdk/<version>`).
fn npm_package() -> NpmPackage {
    NpmPackage {
        slot: "tools/node-sdk",
        version: NODE_SDK_VERSION,
        name: "@github/copilot-sdk".to_owned(),
        executable: PathBuf::from(ENTRY_POINT),
        companions: Vec::new(),
        optional: OptionalDeps::Omit,
        override_hint: "set COPILOT_POOL_NODE_SDK_DIR to a directory holding \
                        node_modules/@github/copilot-sdk",
    }
}

/// Where the managed install lives inside the cache directory.
pub fn node_sdk_install_dir(cache_dir: &Path) -> PathBuf {
    npm_package().install_dir(cache_dir)
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
    let package = npm_package();
    package.is_complete(&package.install_dir(cache_dir))
}

/// Installs the SDK into `<cache_dir>/tools/node-sdk/<version>` unless it is complete there,
/// under the install lock, and returns its package directory. Gives up (killing npm's
/// process group) once `timeout` has passed since the call.
pub async fn install_node_sdk(
    cache_dir: &Path,
    timeout: Duration,
) -> Result<PathBuf, NodeSdkError> {
    let installed = install_package(&npm_package(), cache_dir, timeout).await?;
    Ok(node_sdk_package_dir(&installed.dir))
}

#[cfg(test)]
mod tests {
    use super::super::install::MARKER_FILE;
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
        std::fs::write(prefix.join(MARKER_FILE), NODE_SDK_VERSION).expect("marker");
        let path = cache.path().as_os_str().to_owned();
        let env = move |key: &str| (key == super::super::CACHE_DIR_ENV).then(|| path.clone());
        let found = find_or_install_node_sdk(env, Duration::from_secs(1))
            .await
            .expect("found");
        assert_eq!(found, node_sdk_package_dir(&prefix));
    }
}
