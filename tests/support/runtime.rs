//! The real Copilot runtime for integration tests: `COPILOT_CLI_PATH` if set, otherwise the
//! pinned default flavour, installed once into the cache directory the library resolves.
//!
//! Included through `tests/support/mod.rs` (`pub mod runtime;`) and `mod support;`.
//! Memoized per test binary with a `OnceCell`; across test binaries and processes the
//! library's install lock makes concurrent first installs safe, and later ones instant.

// Each test binary compiles this module; not all of them call everything in it.
#![allow(dead_code)]

use std::path::PathBuf;

use copilot_pool::runtime::{self, Flavour};
use tokio::sync::OnceCell;

static RUNTIME: OnceCell<PathBuf> = OnceCell::const_new();

/// The Copilot executable the integration tests spawn. Panics with the reason when it is
/// neither configured nor installable.
pub async fn runtime_path() -> PathBuf {
    RUNTIME.get_or_init(resolve).await.clone()
}

async fn resolve() -> PathBuf {
    if let Some(path) = std::env::var_os(runtime::CLI_PATH_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{} is set to {}, which is not a file",
            runtime::CLI_PATH_ENV,
            path.display()
        );
        return path;
    }
    let cache = runtime::cache_dir(runtime::process_env)
        .unwrap_or_else(|err| panic!("cannot install the Copilot runtime for tests: {err}"));
    match runtime::install(Flavour::default(), &cache).await {
        Ok(installed) => installed.executable,
        Err(err) => panic!(
            "cannot install the Copilot runtime for tests into {}: {err}\n\
             (set {} to an existing copilot or copilot-runtime executable to skip the install)",
            cache.display(),
            runtime::CLI_PATH_ENV
        ),
    }
}
