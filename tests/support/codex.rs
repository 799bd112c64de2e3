//! The real Codex CLI for integration tests: `COPILOT_POOL_CODEX_PATH` if set,
//! otherwise the pinned version installed once into the cache directory the library resolves
//! (with the library's installer: cached, under its lock, by a deadline).
//!
//! Memoized per test binary with a `OnceCell`; across test binaries the install lock makes
//! concurrent first installs safe, and later ones instant.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use copilot_pool::runtime::{self, AgentCli};
use tokio::sync::OnceCell;

static CODEX: OnceCell<PathBuf> = OnceCell::const_new();

/// How long the first install may take (a 424 MB install on a slow link).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// The Codex executable (the vendored native binary) the tests spawn. Panics with the reason when it is neither
/// configured nor installable.
pub async fn codex_path() -> PathBuf {
    CODEX.get_or_init(resolve).await.clone()
}

async fn resolve() -> PathBuf {
    if let Some(path) = std::env::var_os(runtime::CODEX_PATH_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{} is set to {}, which is not a file",
            runtime::CODEX_PATH_ENV,
            path.display()
        );
        return path;
    }
    let cache = runtime::cache_dir(runtime::process_env)
        .unwrap_or_else(|err| panic!("cannot install Codex for tests: {err}"));
    match runtime::install_agent_cli(AgentCli::Codex, &cache, INSTALL_TIMEOUT).await {
        Ok(installed) => installed.executable,
        Err(err) => panic!(
            "cannot install Codex for tests into {}: {err}\n\
             (set {} to an existing codex executable (its vendored native binary) to skip the install)",
            cache.display(),
            runtime::CODEX_PATH_ENV
        ),
    }
}
