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
//! The install itself (lock, deadline, process group, errors naming the manual fix,
//! [`INSTALL_COMMAND`]) is `tool_install`'s.
//!
//! Memoized per test binary with a `OnceCell`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use copilot_pool::runtime;
use tokio::sync::OnceCell;

use super::tool_install::{self, ToolScript};
#[allow(unused_imports)]
pub use super::tool_install::{InstallError as PromtoolError, lock_path, tools_dir};

/// Names an existing promtool to use as is.
pub const ENV: &str = "PROMTOOL";

/// What a person runs to install promtool by hand (into the same cache the tests look in).
pub const INSTALL_COMMAND: &str = "bash scripts/install-promtool.sh";

/// How long one install may take in all: waiting for the lock, then the installer.
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(5 * 60);

static PROMTOOL: OnceCell<PathBuf> = OnceCell::const_new();

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
    if let Some(path) = tool_install::configured(ENV, &manual_fix()) {
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

/// Installs promtool into `<cache>/tools` with `bash <script> --dir <cache>/tools` unless it
/// is already there (see `tool_install::install`).
pub async fn install(
    script: &Path,
    cache: &Path,
    timeout: Duration,
) -> Result<PathBuf, PromtoolError> {
    let tool = ToolScript {
        name: "promtool",
        script: script.to_path_buf(),
        target: PathBuf::from("promtool"),
        manual_fix: manual_fix(),
        timeout_hint: "check access to the Debian package mirror (apt-get download prometheus)",
        // Its download folder is the system's temporary one; in `<cache>/tools` it leaves
        // only a part file for the moment of one copy.
        leftovers: None,
    };
    tool_install::install(&tool, cache, timeout).await
}
