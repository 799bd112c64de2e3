//! The real Gemini CLI for integration tests: the script `COPILOT_POOL_GEMINI_PATH` names if
//! set, otherwise the pinned `@google/gemini-cli` installed once into the cache directory the
//! library resolves (the library's installer: cached, under its lock, by a deadline); started
//! as `node <bundle/gemini.js>` with the `node` on `PATH`.
//!
//! Memoized per test binary with a `OnceCell`; across test binaries the install lock makes
//! concurrent first installs safe, and later ones instant.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use copilot_pool::runtime::{self, AgentCli, Launch};
use tokio::sync::OnceCell;

static GEMINI: OnceCell<PathBuf> = OnceCell::const_new();

/// How long the first install may take (a 100 MB download on a slow link).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// How to start the Gemini CLI the tests spawn. Panics with the reason when it is neither
/// configured nor installable, or when there is no `node`.
pub async fn gemini_launch() -> Launch {
    let script = GEMINI.get_or_init(resolve).await;
    AgentCli::Gemini
        .launch(script, std::env::var_os("PATH"))
        .unwrap_or_else(|err| panic!("cannot run Gemini CLI for tests: {err}"))
}

async fn resolve() -> PathBuf {
    let cli = AgentCli::Gemini;
    if let Some(path) = std::env::var_os(cli.path_env()).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{} is set to {}, which is not a file",
            cli.path_env(),
            path.display()
        );
        return path;
    }
    let cache = runtime::cache_dir(runtime::process_env)
        .unwrap_or_else(|err| panic!("cannot install Gemini CLI for tests: {err}"));
    match runtime::install_agent_cli(cli, &cache, INSTALL_TIMEOUT).await {
        Ok(installed) => installed.executable,
        Err(err) => panic!(
            "cannot install Gemini CLI for tests into {}: {err}\n\
             (set {} to the bundle/gemini.js of an existing install to skip the install)",
            cache.display(),
            cli.path_env()
        ),
    }
}
