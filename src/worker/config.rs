//! What a worker is started with, and the argv and environment of its CLI child.
//!
//! The child's environment is built from an allowlist of the parent's variables plus the
//! worker's own (`COPILOT_HOME`, the process token). GitHub tokens and other secrets of the
//! parent never reach a child.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::group_ledger::GroupLedger;
use crate::process::ChildSpec;
use crate::rpc::DEFAULT_MAX_FRAME_BYTES;
use crate::sandbox::Sandbox;
use crate::secret::Secret;
use crate::tunnel::ModelTunnel;

use super::error::WorkerError;

/// Parent variables a child may inherit. Everything else is dropped.
pub const ENV_ALLOWLIST: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TZ",
    "TMPDIR",
    "TMP",
    "TEMP",
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_RUNTIME_DIR",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "NODE_EXTRA_CA_CERTS",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
];

/// The XDG base directories a sandboxed worker does not inherit (see `WorkerConfig::env`).
const XDG_DIRS: [&str; 5] = [
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_RUNTIME_DIR",
];

/// Variables that carry GitHub credentials. Never inherited, and refused in `extra_env`:
/// the only token a child gets is the worker's own, through `--auth-token-env`.
pub const TOKEN_VARIABLES: &[&str] = &[
    "GH_TOKEN",
    "GITHUB_TOKEN",
    "COPILOT_GITHUB_TOKEN",
    "OPENCLAW_GITHUB_TOKEN",
    "GH_ENTERPRISE_TOKEN",
    "GITHUB_ENTERPRISE_TOKEN",
    AUTH_TOKEN_ENV,
];

/// The variable the process-level token is passed in (named by `--auth-token-env`).
pub const AUTH_TOKEN_ENV: &str = "COPILOT_SDK_AUTH_TOKEN";

/// Missed health pings in a row after which a runtime is hung, by default.
pub const DEFAULT_HEALTH_MISSES: u32 = 2;

/// The default [`WorkerConfig::max_unread_route_bytes`]: 256 MiB, eight times a turn's own
/// backlog limit ([`crate::turn::DEFAULT_MAX_UNREAD_EVENT_BYTES`]).
pub const DEFAULT_MAX_UNREAD_ROUTE_BYTES: usize = 256 << 20;

/// Everything a worker needs to start and supervise one CLI child.
#[derive(Clone)]
pub struct WorkerConfig {
    /// The runtime executable (`copilot-runtime` or `copilot`); see [`crate::runtime::locate`].
    pub program: PathBuf,
    /// `COPILOT_HOME` of the child: its sessions, logs and settings.
    pub copilot_home: PathBuf,
    /// The child's working directory.
    pub working_directory: PathBuf,
    /// Process-level GitHub token (`--auth-token-env`); `None` runs unauthenticated or BYOK.
    pub auth_token: Option<Secret>,
    /// Let the runtime pick up stored logins (`--no-auto-login` is passed unless true).
    pub auto_login: bool,
    /// `--log-level` (`none`, `error`, `warning`, `info`, `debug`, `all`).
    pub log_level: Option<String>,
    /// The parent environment to filter through [`ENV_ALLOWLIST`]; `None` reads the
    /// process environment at spawn time.
    pub base_env: Option<Vec<(OsString, OsString)>>,
    /// Extra variables for the child (after the allowlist; token variables are refused).
    pub extra_env: Vec<(String, String)>,
    /// Serve model HTTP requests over the pipe (`llmInference.*`) with this tunnel.
    pub model_tunnel: Option<Arc<dyn ModelTunnel>>,
    /// Spawn plus `connect` handshake.
    pub start_timeout: Duration,
    /// Default timeout of a request to the runtime.
    pub request_timeout: Duration,
    /// How often the worker pings the runtime.
    pub health_interval: Duration,
    /// A ping not answered within this is a missed ping.
    pub health_timeout: Duration,
    /// Missed pings in a row after which the runtime is declared hung and killed (an answer
    /// resets the count). 1 kills at the first slow ping; the default 2 lets one slow ping on
    /// a loaded machine pass, and still declares a stopped runtime hung within two health
    /// intervals plus the timeout (when the timeout is shorter than the interval). 0 is
    /// taken as 1.
    pub health_misses: u32,
    /// Time between SIGTERM and SIGKILL when stopping the child.
    pub kill_grace: Duration,
    /// Largest JSON-RPC frame accepted or sent.
    pub max_frame_bytes: usize,
    /// The most the runtime may leave unread in one session's route (what it wrote for a
    /// session that nobody reads: parked between turns, or read far slower than a turn's own
    /// backlog limit, `TurnHandlers::max_unread_event_bytes`, lets it fall behind). A runtime
    /// past it is broken or made to write by something else (a tool process can write into
    /// its output pipe through `/proc/<pid>/fd`): it is killed as having broken the
    /// protocol, so the daemon's memory stays bounded for every other tenant. Its sessions'
    /// routes together may hold four times this.
    pub max_unread_route_bytes: usize,
    /// Record the runtime's process group here while it lives (the daemon's
    /// `<state_dir>/process-groups.json`), so a restart after a crash kills survivors.
    pub group_ledger: Option<Arc<GroupLedger>>,
    /// Start the runtime through this sandbox's wrapper, inside its walls (`None`: with
    /// the parent's rights). A pool fills the agent's directories in per key.
    pub sandbox: Option<Sandbox>,
}

impl std::fmt::Debug for WorkerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerConfig")
            .field("program", &self.program)
            .field("copilot_home", &self.copilot_home)
            .field("working_directory", &self.working_directory)
            .field("auth_token", &self.auth_token)
            .field("auto_login", &self.auto_login)
            .field("model_tunnel", &self.model_tunnel.is_some())
            .field("health_interval", &self.health_interval)
            .field("health_timeout", &self.health_timeout)
            .field("health_misses", &self.health_misses)
            .field("sandbox", &self.sandbox.is_some())
            .field(
                "group_ledger",
                &self.group_ledger.as_ref().map(|l| l.path()),
            )
            .finish_non_exhaustive()
    }
}

impl WorkerConfig {
    /// A config with the default timeouts: start 60 s, requests 60 s, health every 10 s with
    /// a 5 s timeout and hung after 2 missed pings in a row, kill grace 5 s, frames up to
    /// 64 MiB.
    pub fn new(program: PathBuf, copilot_home: PathBuf, working_directory: PathBuf) -> Self {
        Self {
            program,
            copilot_home,
            working_directory,
            auth_token: None,
            auto_login: false,
            log_level: None,
            base_env: None,
            extra_env: Vec::new(),
            model_tunnel: None,
            start_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            health_interval: Duration::from_secs(10),
            health_timeout: Duration::from_secs(5),
            health_misses: DEFAULT_HEALTH_MISSES,
            kill_grace: Duration::from_secs(5),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            max_unread_route_bytes: DEFAULT_MAX_UNREAD_ROUTE_BYTES,
            sandbox: None,
            group_ledger: None,
        }
    }

    /// The argv after the program name, in the order the SDK builds it.
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec!["--headless".into(), "--no-auto-update".into()];
        if let Some(level) = &self.log_level {
            args.push("--log-level".into());
            args.push(level.into());
        }
        args.push("--stdio".into());
        if self.auth_token.is_some() {
            args.push("--auth-token-env".into());
            args.push(AUTH_TOKEN_ENV.into());
        }
        if !self.auto_login {
            args.push("--no-auto-login".into());
        }
        args
    }

    /// The child's complete environment.
    pub fn env(&self) -> Result<Vec<(OsString, OsString)>, WorkerError> {
        for (name, _) in &self.extra_env {
            if TOKEN_VARIABLES.contains(&name.as_str()) {
                return Err(WorkerError::Config(format!(
                    "extra_env sets {name}, a GitHub token variable; pass the token as the \
                     worker's auth_token instead so it reaches only this child"
                )));
            }
            if name == "COPILOT_HOME" {
                return Err(WorkerError::Config(
                    "extra_env sets COPILOT_HOME; set WorkerConfig::copilot_home instead".into(),
                ));
            }
        }
        let base: Vec<(OsString, OsString)> = match &self.base_env {
            Some(env) => env.clone(),
            None => std::env::vars_os().collect(),
        };
        let mut env: Vec<(OsString, OsString)> = base
            .into_iter()
            .filter(|(k, _)| k.to_str().is_some_and(|k| ENV_ALLOWLIST.contains(&k)))
            .collect();
        if let Some(sandbox) = &self.sandbox {
            // Inside the walls, the parent's temporary directory and home are out of reach:
            // the agent's own stand in (an explicit `extra_env` still wins).
            let mut set = |name: &str, value: &std::path::Path| {
                env.retain(|(k, _)| k != name);
                env.push((name.into(), value.into()));
            };
            if let Some(temp) = &sandbox.temp_dir {
                for name in ["TMPDIR", "TMP", "TEMP"] {
                    set(name, temp);
                }
            }
            if let Some(home) = &sandbox.home {
                set("HOME", home);
                // The daemon's own cache, config, data and state directories (and its
                // session's runtime directory) are out of reach too, or shared by every
                // agent where a root every agent may write holds them: without these, the
                // runtime and the tools it runs keep theirs under the agent's `HOME`.
                env.retain(|(k, _)| !XDG_DIRS.iter().any(|x| k == x));
            }
        }
        for (k, v) in &self.extra_env {
            env.retain(|(name, _)| name != k.as_str());
            env.push((k.into(), v.into()));
        }
        env.push(("COPILOT_HOME".into(), self.copilot_home.clone().into()));
        if let Some(token) = &self.auth_token {
            env.push((AUTH_TOKEN_ENV.into(), token.expose().into()));
        }
        Ok(env)
    }

    /// The process spec for [`crate::process::ChildGroup::spawn`].
    /// With a sandbox, the program is its wrapper and the runtime's argv follows the rules.
    pub fn child_spec(&self) -> Result<ChildSpec, WorkerError> {
        let (program, args) = match &self.sandbox {
            Some(sandbox) => sandbox.command(&self.program, &self.args()),
            None => (self.program.clone(), self.args()),
        };
        Ok(ChildSpec {
            program,
            args,
            env: self.env()?,
            cwd: self.working_directory.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> WorkerConfig {
        let mut c = WorkerConfig::new("/bin/rt".into(), "/h/copilot".into(), "/w".into());
        c.base_env = Some(vec![
            ("PATH".into(), "/usr/bin".into()),
            ("HOME".into(), "/home/u".into()),
            ("GH_TOKEN".into(), "ghp_parent".into()),
            ("GITHUB_TOKEN".into(), "ghp_parent2".into()),
            ("COPILOT_GITHUB_TOKEN".into(), "ghp_parent3".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "aws".into()),
        ]);
        c
    }

    fn get<'a>(env: &'a [(OsString, OsString)], key: &str) -> Option<&'a OsString> {
        env.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    #[test]
    fn parent_secrets_never_reach_the_child() {
        let env = config().env().unwrap();
        for key in [
            "GH_TOKEN",
            "GITHUB_TOKEN",
            "COPILOT_GITHUB_TOKEN",
            "AWS_SECRET_ACCESS_KEY",
        ] {
            assert!(get(&env, key).is_none(), "{key} leaked");
        }
        assert_eq!(get(&env, "PATH").unwrap(), "/usr/bin");
        assert_eq!(get(&env, "COPILOT_HOME").unwrap(), "/h/copilot");
        assert!(get(&env, AUTH_TOKEN_ENV).is_none());
    }

    #[test]
    fn argv_without_and_with_token() {
        let mut c = config();
        assert_eq!(
            c.args(),
            [
                "--headless",
                "--no-auto-update",
                "--stdio",
                "--no-auto-login"
            ]
            .map(OsString::from)
            .to_vec()
        );
        c.auth_token = Some(Secret::new("ghu_worker"));
        c.log_level = Some("info".into());
        assert_eq!(
            c.args(),
            [
                "--headless",
                "--no-auto-update",
                "--log-level",
                "info",
                "--stdio",
                "--auth-token-env",
                AUTH_TOKEN_ENV,
                "--no-auto-login"
            ]
            .map(OsString::from)
            .to_vec()
        );
        let env = c.env().unwrap();
        assert_eq!(get(&env, AUTH_TOKEN_ENV).unwrap(), "ghu_worker");
        assert!(!format!("{c:?}").contains("ghu_worker"));
    }

    #[test]
    fn a_sandboxed_worker_starts_through_its_wrapper_with_its_own_temp_and_home() {
        let mut c = config();
        c.base_env
            .as_mut()
            .unwrap()
            .push(("TMPDIR".into(), "/tmp".into()));
        for xdg in XDG_DIRS {
            c.base_env
                .as_mut()
                .unwrap()
                .push((xdg.into(), "/home/daemon/.xdg".into()));
        }
        assert!(get(&c.env().unwrap(), "XDG_CACHE_HOME").is_some());
        let mut sandbox = Sandbox::new("/bin/wrapper".into(), vec!["sandbox-exec".into()]);
        sandbox.temp_dir = Some("/a/tmp".into());
        sandbox.home = Some("/a".into());
        c.sandbox = Some(sandbox);
        let spec = c.child_spec().unwrap();
        assert_eq!(spec.program, PathBuf::from("/bin/wrapper"));
        assert_eq!(spec.args[0], "sandbox-exec");
        let tail: Vec<&OsString> = spec
            .args
            .iter()
            .skip_while(|a| a.as_os_str() != "--")
            .collect();
        assert_eq!(tail[1], "/bin/rt");
        assert_eq!(&tail[2..], c.args().iter().collect::<Vec<_>>().as_slice());
        let env = c.env().unwrap();
        assert_eq!(get(&env, "TMPDIR").unwrap(), "/a/tmp");
        assert_eq!(get(&env, "TEMP").unwrap(), "/a/tmp");
        assert_eq!(get(&env, "HOME").unwrap(), "/a");
        assert_eq!(env.iter().filter(|(k, _)| k == "HOME").count(), 1);
        for xdg in XDG_DIRS {
            assert_eq!(get(&env, xdg), None, "{xdg} is the daemon's");
        }
        // An explicit HOME of the caller wins.
        c.extra_env = vec![("HOME".into(), "/elsewhere".into())];
        assert_eq!(get(&c.env().unwrap(), "HOME").unwrap(), "/elsewhere");
    }

    #[test]
    fn extra_env_overrides_but_cannot_smuggle_tokens() {
        let mut c = config();
        c.extra_env = vec![("HOME".into(), "/tmp/h".into())];
        let env = c.env().unwrap();
        assert_eq!(get(&env, "HOME").unwrap(), "/tmp/h");
        assert_eq!(env.iter().filter(|(k, _)| k == "HOME").count(), 1);
        c.extra_env = vec![("GH_TOKEN".into(), "x".into())];
        let err = c.env().unwrap_err().to_string();
        assert!(
            err.contains("GH_TOKEN") && err.contains("auth_token"),
            "{err}"
        );
    }
}
