//! schemathesis (the OpenAPI fuzzer, from PyPI) for the contract test, found or installed the
//! way promtool is, so that `cargo test` needs nothing beyond Rust and Node.js on a
//! Debian-like machine (its environment comes from `scripts/make-venv.sh`).
//!
//! Lookup order: `SCHEMATHESIS_PYTHON` (a python that has schemathesis) →
//! `<cache>/tools/schemathesis-<version>/bin/python` → installed there by
//! `scripts/install-schemathesis.sh` (a virtual environment of its own, pinned version), where
//! `<cache>` is the runtime's cache directory (`COPILOT_POOL_CACHE_DIR`,
//! `$XDG_CACHE_HOME/copilot-pool`, `~/.cache/copilot-pool`).
//!
//! The install (the tools' lock shared with promtool, one deadline, [`INSTALL_TIMEOUT`], the
//! installer's process group, errors naming the manual fix) is `tool_install`'s.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use copilot_pool::runtime;
use tokio::sync::OnceCell;

use super::tool_install::{self, ToolScript};

/// Names a python that has schemathesis installed, to use as is.
pub const ENV: &str = "SCHEMATHESIS_PYTHON";

/// The pinned version (the installer's `version`).
pub const VERSION: &str = "4.32.5";

/// What a person runs to install it by hand (into the cache the tests look in).
pub const INSTALL_COMMAND: &str = "bash scripts/install-schemathesis.sh";

/// How long one install may take in all: waiting for the lock, then pip.
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(5 * 60);

static PYTHON: OnceCell<PathBuf> = OnceCell::const_new();

fn manual_fix() -> String {
    format!(
        "run `{INSTALL_COMMAND}` from the repository root by hand (it needs PyPI, and a python3 \
         with venv or Debian's package archive), or set {ENV} to a python that has schemathesis=={VERSION}"
    )
}

/// The python to run `-m schemathesis.cli` with. Panics with the reason and the manual fix
/// when it is neither configured, cached, nor installable.
pub async fn python() -> PathBuf {
    PYTHON.get_or_init(resolve).await.clone()
}

async fn resolve() -> PathBuf {
    if let Some(path) = tool_install::configured(ENV, &manual_fix()) {
        return path;
    }
    let cache = runtime::cache_dir(runtime::process_env)
        .unwrap_or_else(|err| panic!("cannot find or install schemathesis: {err}"));
    install(&cache, INSTALL_TIMEOUT)
        .await
        .unwrap_or_else(|err| panic!("cannot install schemathesis for tests: {err}"))
}

/// The environment's python inside the cache.
pub fn python_in(cache: &Path) -> PathBuf {
    tool_install::tools_dir(cache).join(python_in_tools())
}

/// The environment's python, relative to the tools' directory.
fn python_in_tools() -> PathBuf {
    PathBuf::from(format!("schemathesis-{VERSION}")).join("bin/python")
}

/// Installs schemathesis under `<cache>/tools` unless it is there (see
/// `tool_install::install`).
pub async fn install(cache: &Path, timeout: Duration) -> Result<PathBuf, String> {
    let tool = ToolScript {
        name: "schemathesis",
        script: Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/install-schemathesis.sh"),
        target: python_in_tools(),
        manual_fix: manual_fix(),
        timeout_hint: "check access to PyPI",
        leftovers: Some(".schemathesis-install."),
    };
    tool_install::install(&tool, cache, timeout)
        .await
        .map_err(|e| e.to_string())
}
