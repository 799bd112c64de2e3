//! The real agent CLIs for integration tests (Claude Code, Codex, Gemini CLI): the
//! executable (for Gemini CLI, its `bundle/gemini.js`) that the CLI's override variable
//! (`AgentCli::path_env`: `COPILOT_POOL_CLAUDE_PATH`, `COPILOT_POOL_CODEX_PATH`,
//! `COPILOT_POOL_GEMINI_PATH`) names if set, otherwise the pinned version installed once into
//! the cache directory the library resolves, with the library's installer (cached, under its
//! lock, by a deadline).
//!
//! Memoized per test binary and CLI with a `OnceCell`; across test binaries the install lock
//! makes concurrent first installs safe, and later ones instant.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use copilot_pool::runtime::{self, AgentCli, Launch};
use tokio::sync::OnceCell;

static CLAUDE: OnceCell<PathBuf> = OnceCell::const_new();
static CODEX: OnceCell<PathBuf> = OnceCell::const_new();
static GEMINI: OnceCell<PathBuf> = OnceCell::const_new();

/// How long a first install may take (Claude Code and Codex are about 400 MB each).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// The Claude Code executable the tests spawn.
pub async fn claude_path() -> PathBuf {
    path(AgentCli::ClaudeCode).await
}

/// A `serve` config with the bundled `claude-cli` backend on the installed Claude Code:
/// `tables` (whole TOML tables, `[pool]\n...`) go before its table, `backend_keys` into it.
pub async fn claude_daemon_config(tables: &str, backend_keys: &str) -> String {
    format!(
        "drain_grace_secs = 5\n{tables}[backends.claude-cli]\ncommand = {:?}\n{backend_keys}",
        claude_path().await.display().to_string()
    )
}

/// The Codex executable (its vendored native binary) the tests spawn.
pub async fn codex_path() -> PathBuf {
    path(AgentCli::Codex).await
}

/// How to start the Gemini CLI the tests spawn (`node <bundle/gemini.js>`); panics when
/// there is no `node`, or one too old (see [`path`]).
pub async fn gemini_launch() -> Launch {
    let script = path(AgentCli::Gemini).await;
    AgentCli::Gemini
        .launch(&script, std::env::var_os("PATH"))
        .unwrap_or_else(|err| panic!("cannot run Gemini CLI for tests: {err}"))
}

/// `cli`'s executable (or script). Panics with the reason when it is neither configured nor
/// installable, or when it runs on Node.js and the `node` on `PATH` is too old for it
/// (`tool_install::require_node`).
pub async fn path(cli: AgentCli) -> PathBuf {
    if cli.runs_on_node() {
        super::tool_install::require_node(cli.package()).await;
    }
    let cell = match cli {
        AgentCli::ClaudeCode => &CLAUDE,
        AgentCli::Codex => &CODEX,
        AgentCli::Gemini => &GEMINI,
        other => panic!("no test install for {other:?}"),
    };
    cell.get_or_init(|| resolve(cli)).await.clone()
}

async fn resolve(cli: AgentCli) -> PathBuf {
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
        .unwrap_or_else(|err| panic!("cannot install {} for tests: {err}", cli.package()));
    match runtime::install_agent_cli(cli, &cache, INSTALL_TIMEOUT).await {
        Ok(installed) => installed.executable,
        Err(err) => panic!(
            "cannot install {} for tests into {}: {err}\n(set {} to an existing install's \
             executable to skip the install)",
            cli.package(),
            cache.display(),
            cli.path_env()
        ),
    }
}
