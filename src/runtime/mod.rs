//! Finding and installing the pinned Copilot runtime.
//!
//! copilot-pool never talks to GitHub to fetch its child executable: the pinned runtime is
//! installed from the npm registry with the user's own `npm`, into a per-user cache, and found
//! again at run time without installing anything.
//!
//! * [`Flavour`] says which npm package is used (the pinned versions live in `flavour.rs`):
//!   [`Flavour::Runtime`] (default) is the SDK's native `copilot-runtime` launcher, used in place
//!   next to its `runtime.node`; [`Flavour::Cli`] is the `copilot` single executable.
//! * [`Platform`] maps the host to the npm platform suffix (`linux-x64`, `darwin-arm64`, ...).
//! * [`cache_dir`] resolves where managed installs live
//!   (`COPILOT_POOL_CACHE_DIR`, `$XDG_CACHE_HOME/copilot-pool`, `~/.cache/copilot-pool`).
//! * [`install`] installs one flavour idempotently, under a file lock, atomically.
//! * [`locate`] finds the executable to run: explicit path, `COPILOT_CLI_PATH`, the managed
//!   installs, then `copilot` on `PATH`.
//! * [`find_or_install_node_sdk`] does the same for the official Node SDK
//!   (`@github/copilot-sdk`), which `copilot-pool bench` and the SDK endpoint's tests drive.
//! * [`install_agent_cli`] installs another agent CLI ([`AgentCli`]: Claude Code, Codex,
//!   Gemini CLI) the same way, for the CLI backends of [`crate::backend`].
//!
//! Every function that reads the environment takes a lookup closure (`Fn(&str) ->
//! Option<OsString>`); pass [`process_env`] to read the real process environment.

mod agent_cli;
mod cache;
mod flavour;
mod install;
mod locate;
mod node_sdk;
mod platform;

pub use agent_cli::{
    AgentCli, CLAUDE_CODE_VERSION, CLAUDE_PATH_ENV, CODEX_PATH_ENV, CODEX_VERSION,
    GEMINI_CLI_VERSION, GEMINI_PATH_ENV, InstalledAgentCli, Launch, NodeMissing, install_agent_cli,
};
pub use cache::{CACHE_DIR_ENV, CacheDirError, cache_dir};
pub use flavour::{CLI_VERSION, Flavour, ParseFlavourError, RUNTIME_VERSION};
pub use install::{
    DEFAULT_INSTALL_TIMEOUT, InstallError, Installed, MARKER_FILE, install, install_with_timeout,
    lock_exclusive,
};
pub use locate::{
    CLI_PATH_ENV, INSTALL_COMMAND, LocateError, Located, LocatedBy, MISSING_CODE, locate,
};
pub use node_sdk::{
    NODE_SDK_DIR_ENV, NODE_SDK_INSTALL_TIMEOUT, NODE_SDK_VERSION, NodeSdkError,
    find_or_install_node_sdk, install_node_sdk, node_sdk_install_dir, node_sdk_installed,
    node_sdk_package_dir,
};
pub use platform::{Platform, PlatformError};

use std::ffi::OsString;

/// Reads a variable from the real process environment; the usual `env` argument for
/// [`cache_dir`] and [`locate`].
pub fn process_env(key: &str) -> Option<OsString> {
    std::env::var_os(key)
}

/// Looks `key` up and treats an empty value as unset.
fn non_empty(env: &impl Fn(&str) -> Option<OsString>, key: &str) -> Option<OsString> {
    env(key).filter(|value| !value.is_empty())
}

/// A program named without a directory (`claude`), which only a `PATH` search finds.
pub fn is_bare_name(program: &std::path::Path) -> bool {
    program.components().count() == 1 && !program.is_absolute()
}

/// The first `name` on a `PATH`-style list that is an executable file. Entries that are not
/// absolute (empty, `.`, `bin`) are skipped: they mean the current directory, whatever it
/// is where the lookup runs, and what is found there would be run, and granted to the
/// sandbox as an install.
pub fn find_on_path(name: &str, path_var: Option<OsString>) -> Option<std::path::PathBuf> {
    let path_var = path_var?;
    std::env::split_paths(&path_var)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable_file(candidate))
}

/// A regular file (after following symlinks) with at least one execute bit.
pub fn is_executable_file(path: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_path_entry_finds_nothing_however_it_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let program = dir.path().join("tool");
        std::fs::write(&program, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        let found = find_on_path("tool", Some(dir.path().as_os_str().to_owned()));
        assert_eq!(found.as_deref(), Some(program.as_path()));
        // The same directory named relatively, from the current directory up to `/` and
        // down again: it resolves there, and is skipped.
        let cwd = std::env::current_dir().unwrap();
        let mut relative = std::path::PathBuf::new();
        for _ in cwd.components().skip(1) {
            relative.push("..");
        }
        relative.push(dir.path().strip_prefix("/").unwrap());
        assert!(relative.is_relative() && relative.join("tool").is_file());
        let joined = std::env::join_paths([relative.clone()]).unwrap();
        assert_eq!(find_on_path("tool", Some(joined)), None, "{relative:?}");
    }
}
