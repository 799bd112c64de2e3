//! Other agent CLIs the pool can run as backends (issue 17), installed from npm by the same
//! installer as the Copilot runtime: pinned, cached, under the install lock, by a deadline.
//!
//! Claude Code ([`AgentCli::ClaudeCode`]), Codex ([`AgentCli::Codex`]) and Gemini CLI
//! ([`AgentCli::Gemini`]):
//! * Claude Code: its npm package ships a native executable in an optional platform package,
//!   `@anthropic-ai/claude-code-<platform>/claude`, run from there directly; npm runs with
//!   `--ignore-scripts`, so the postinstall that would hardlink it to `bin/claude.exe` never
//!   runs;
//! * Codex: `@openai/codex-<platform>` (an alias of `@openai/codex@<version>-<platform>`)
//!   holds `vendor/<rust target>/bin/codex`, a static binary run directly; the package's
//!   `bin/codex.js` is a Node launcher that only picks and execs it (calling it directly
//!   saves a Node process, ~0.1 s and ~50 MiB per turn);
//! * Gemini CLI: `@google/gemini-cli` is one Node script bundle (`bundle/gemini.js`,
//!   Node ≥ 20) with only optional dependencies (a pty and a keychain, which a headless run
//!   does not use), so they are omitted. It runs as `node <bundle/gemini.js>`, with the
//!   `node` found on `PATH` ([`AgentCli::launch`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::install::{InstallError, NpmPackage, OptionalDeps, install_package};
use super::platform::Platform;

/// Version of `@anthropic-ai/claude-code` installed for [`AgentCli::ClaudeCode`].
pub const CLAUDE_CODE_VERSION: &str = "2.1.332";

/// Overrides the Claude Code executable (used as is, nothing installed).
pub const CLAUDE_PATH_ENV: &str = "COPILOT_POOL_CLAUDE_PATH";

/// Version of `@openai/codex` installed for [`AgentCli::Codex`].
pub const CODEX_VERSION: &str = "0.171.0";

/// Overrides the Codex executable (used as is, nothing installed).
pub const CODEX_PATH_ENV: &str = "COPILOT_POOL_CODEX_PATH";
/// Version of `@google/gemini-cli` installed for [`AgentCli::Gemini`].
pub const GEMINI_CLI_VERSION: &str = "0.61.0";

/// Overrides the Gemini CLI script (`bundle/gemini.js` of an existing install, run with
/// `node`; nothing installed).
pub const GEMINI_PATH_ENV: &str = "COPILOT_POOL_GEMINI_PATH";

/// A Node script CLI cannot start: no `node` to run it with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{cli} runs on Node.js (>= 20), but no `node` executable was found on PATH; install \
     Node.js 20 or newer, or put its `bin` directory on the PATH the pool is started with"
)]
pub struct NodeMissing {
    /// The npm package that needs it.
    pub cli: &'static str,
}

/// How to start an agent CLI: the program and the arguments that come before the CLI's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// What to execute.
    pub program: PathBuf,
    /// Arguments before the CLI's own (the script, for a Node CLI).
    pub args: Vec<std::ffi::OsString>,
}

/// An agent CLI other than Copilot, at its pinned version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AgentCli {
    /// Claude Code (`@anthropic-ai/claude-code`), the `claude-cli` backend.
    ClaudeCode,
    /// Codex CLI (`@openai/codex`), the `codex-cli` backend.
    Codex,
    /// Gemini CLI (`@google/gemini-cli`), the `google-gemini-cli` backend.
    Gemini,
}

impl AgentCli {
    /// The pinned version.
    pub fn version(self) -> &'static str {
        match self {
            AgentCli::ClaudeCode => CLAUDE_CODE_VERSION,
            AgentCli::Codex => CODEX_VERSION,
            AgentCli::Gemini => GEMINI_CLI_VERSION,
        }
    }

    /// The cache subfolder of its installs (`<cache>/<slot>/<version>`).
    pub fn slot(self) -> &'static str {
        match self {
            AgentCli::ClaudeCode => "claude-code",
            AgentCli::Codex => "codex",
            AgentCli::Gemini => "gemini-cli",
        }
    }

    /// The npm package named on the command line.
    pub fn package(self) -> &'static str {
        match self {
            AgentCli::ClaudeCode => "@anthropic-ai/claude-code",
            AgentCli::Codex => "@openai/codex",
            AgentCli::Gemini => "@google/gemini-cli",
        }
    }

    /// Whether the executable is a Node script, started as `node <script>`.
    pub fn runs_on_node(self) -> bool {
        match self {
            AgentCli::ClaudeCode | AgentCli::Codex => false,
            AgentCli::Gemini => true,
        }
    }

    /// The executable (or, for a Node CLI, the script), relative to the install directory.
    pub fn executable_rel_path(self, platform: Platform) -> PathBuf {
        match self {
            AgentCli::ClaudeCode => Path::new("node_modules")
                .join(format!(
                    "@anthropic-ai/claude-code-{}",
                    claude_platform(platform)
                ))
                .join("claude"),
            AgentCli::Codex => Path::new("node_modules")
                .join(format!("@openai/codex-{}", codex_platform(platform)))
                .join("vendor")
                .join(codex_target(platform))
                .join("bin")
                .join("codex"),
            AgentCli::Gemini => {
                Path::new("node_modules/@google/gemini-cli/bundle/gemini.js").into()
            }
        }
    }

    /// The environment variable that names an existing executable (or script) instead of the
    /// managed install.
    pub fn path_env(self) -> &'static str {
        match self {
            AgentCli::ClaudeCode => CLAUDE_PATH_ENV,
            AgentCli::Codex => CODEX_PATH_ENV,
            AgentCli::Gemini => GEMINI_PATH_ENV,
        }
    }

    /// How to start `executable` (an install's, or the one [`AgentCli::path_env`] names): as
    /// is, or with the first `node` on `path_var` for a Node CLI.
    pub fn launch(
        self,
        executable: &Path,
        path_var: Option<std::ffi::OsString>,
    ) -> Result<Launch, NodeMissing> {
        if !self.runs_on_node() {
            return Ok(Launch {
                program: executable.to_path_buf(),
                args: Vec::new(),
            });
        }
        let node = super::find_on_path("node", path_var).ok_or(NodeMissing {
            cli: self.package(),
        })?;
        Ok(Launch {
            program: node,
            args: vec![executable.as_os_str().to_owned()],
        })
    }

    /// `<cache_dir>/<slot>/<version>`.
    pub fn install_dir(self, cache_dir: &Path) -> PathBuf {
        cache_dir.join(self.slot()).join(self.version())
    }

    fn npm_package(self, platform: Platform) -> NpmPackage {
        NpmPackage {
            slot: self.slot(),
            version: self.version(),
            name: self.package().to_owned(),
            executable: self.executable_rel_path(platform),
            companions: Vec::new(),
            optional: match self {
                AgentCli::ClaudeCode | AgentCli::Codex => OptionalDeps::Include,
                AgentCli::Gemini => OptionalDeps::Omit,
            },
            override_hint: match self {
                AgentCli::ClaudeCode => {
                    "set COPILOT_POOL_CLAUDE_PATH to an existing claude executable"
                }
                AgentCli::Codex => "set COPILOT_POOL_CODEX_PATH to an existing codex executable",
                AgentCli::Gemini => {
                    "set COPILOT_POOL_GEMINI_PATH to the bundle/gemini.js of an existing \
                     @google/gemini-cli install"
                }
            },
        }
    }
}

/// Codex's platform package suffix: npm's `<os>-<cpu>` (musl hosts use the same Linux
/// package, whose binary is static).
fn codex_platform(platform: Platform) -> &'static str {
    match platform {
        Platform::LinuxX64 | Platform::LinuxMuslX64 => "linux-x64",
        Platform::LinuxArm64 | Platform::LinuxMuslArm64 => "linux-arm64",
        Platform::DarwinX64 => "darwin-x64",
        Platform::DarwinArm64 => "darwin-arm64",
    }
}

/// Claude Code's platform package suffix (`@anthropic-ai/claude-code-<this>`): musl hosts
/// as `<os>-<arch>-musl`, not npm's `linuxmusl-<arch>` (2.1.332's optional dependencies).
fn claude_platform(platform: Platform) -> &'static str {
    match platform {
        Platform::LinuxX64 => "linux-x64",
        Platform::LinuxArm64 => "linux-arm64",
        Platform::LinuxMuslX64 => "linux-x64-musl",
        Platform::LinuxMuslArm64 => "linux-arm64-musl",
        Platform::DarwinX64 => "darwin-x64",
        Platform::DarwinArm64 => "darwin-arm64",
    }
}

/// The Rust target triple of Codex's vendored binary.
fn codex_target(platform: Platform) -> &'static str {
    match platform {
        Platform::LinuxX64 | Platform::LinuxMuslX64 => "x86_64-unknown-linux-musl",
        Platform::LinuxArm64 | Platform::LinuxMuslArm64 => "aarch64-unknown-linux-musl",
        Platform::DarwinX64 => "x86_64-apple-darwin",
        Platform::DarwinArm64 => "aarch64-apple-darwin",
    }
}

/// A complete install of an [`AgentCli`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstalledAgentCli {
    /// Which CLI.
    pub cli: AgentCli,
    /// Its pinned version.
    pub version: &'static str,
    /// The executable to spawn (used in place).
    pub executable: PathBuf,
    /// `<cache>/<slot>/<version>`.
    pub dir: PathBuf,
    /// `true` when this call ran npm.
    pub fresh: bool,
}

/// Installs `cli` at its pinned version into `cache_dir` (see
/// [`cache_dir`](super::cache_dir)) unless it is already complete there, giving up after
/// `timeout` (waiting for the lock included). Safe to call concurrently from several tasks
/// and processes: one runs npm, the others wait on `<cache_dir>/<slot>-<version>.lock`.
pub async fn install_agent_cli(
    cli: AgentCli,
    cache_dir: &Path,
    timeout: Duration,
) -> Result<InstalledAgentCli, InstallError> {
    let platform = Platform::current()?;
    let done = install_package(&cli.npm_package(platform), cache_dir, timeout).await?;
    Ok(InstalledAgentCli {
        cli,
        version: cli.version(),
        executable: done.executable,
        dir: done.dir,
        fresh: done.fresh,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claude_code_is_pinned_and_run_from_its_platform_package() {
        let cli = AgentCli::ClaudeCode;
        assert_eq!(cli.version(), "2.1.332");
        assert_eq!(
            cli.executable_rel_path(Platform::LinuxX64),
            Path::new("node_modules/@anthropic-ai/claude-code-linux-x64/claude")
        );
        // Its musl packages are named `<os>-<arch>-musl`, not npm's `linuxmusl-<arch>`.
        for (platform, package) in [
            (Platform::LinuxMuslX64, "claude-code-linux-x64-musl"),
            (Platform::LinuxMuslArm64, "claude-code-linux-arm64-musl"),
        ] {
            assert_eq!(
                cli.executable_rel_path(platform),
                Path::new("node_modules/@anthropic-ai")
                    .join(package)
                    .join("claude")
            );
        }
        assert_eq!(
            cli.install_dir(Path::new("/c")),
            Path::new("/c/claude-code/2.1.332")
        );
        let package = cli.npm_package(Platform::LinuxX64);
        assert_eq!(package.optional, OptionalDeps::Include);
        assert_eq!(package.name, "@anthropic-ai/claude-code");
        let launch = cli
            .launch(Path::new("/c/claude"), None)
            .expect("a native executable needs no node");
        assert_eq!(launch.program, Path::new("/c/claude"));
        assert!(launch.args.is_empty());
    }

    #[test]
    fn gemini_is_pinned_without_optional_packages_and_runs_its_bundle_with_node_from_path() {
        let cli = AgentCli::Gemini;
        assert_eq!(cli.version(), "0.61.0");
        assert_eq!(cli.path_env(), "COPILOT_POOL_GEMINI_PATH");
        let package = cli.npm_package(Platform::LinuxX64);
        assert_eq!(package.name, "@google/gemini-cli");
        assert_eq!(package.optional, OptionalDeps::Omit);
        assert_eq!(
            package.executable,
            Path::new("node_modules/@google/gemini-cli/bundle/gemini.js")
        );
        assert_eq!(
            cli.install_dir(Path::new("/c")),
            Path::new("/c/gemini-cli/0.61.0")
        );

        let bin = tempfile::tempdir().unwrap();
        let node = bin.path().join("node");
        std::fs::write(&node, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&node, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let script = Path::new("/c/gemini.js");
        let launch = cli
            .launch(script, Some(bin.path().as_os_str().to_owned()))
            .expect("node is on the PATH");
        assert_eq!(launch.program, node);
        assert_eq!(launch.args, [script.as_os_str()]);

        let empty = tempfile::tempdir().unwrap();
        let missing = cli
            .launch(script, Some(empty.path().as_os_str().to_owned()))
            .expect_err("no node");
        assert!(missing.to_string().contains("Node.js 20"), "{missing}");
    }

    #[test]
    fn codex_is_pinned_and_run_as_its_vendored_native_binary() {
        let cli = AgentCli::Codex;
        assert_eq!(cli.version(), "0.171.0");
        assert_eq!(
            cli.executable_rel_path(Platform::LinuxX64),
            Path::new(
                "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
            )
        );
        assert_eq!(
            cli.executable_rel_path(Platform::LinuxMuslX64),
            cli.executable_rel_path(Platform::LinuxX64)
        );
        assert_eq!(
            cli.install_dir(Path::new("/c")),
            Path::new("/c/codex/0.171.0")
        );
        assert_eq!(cli.path_env(), "COPILOT_POOL_CODEX_PATH");
        let package = cli.npm_package(Platform::LinuxX64);
        assert_eq!(package.optional, OptionalDeps::Include);
        assert!(package.override_hint.contains(CODEX_PATH_ENV));
    }
}
