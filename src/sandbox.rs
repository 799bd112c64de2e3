//! The walls around one worker, as a description: which directories its runtime (and every
//! tool the runtime starts, bash included) may read, write or execute, which files of
//! `/proc` it may read, which TCP ports it may connect to and bind (by default an ephemeral
//! port only, never a fixed one), and the wrapper program that
//! enforces them. The library enforces nothing itself and depends on no sandboxing crate: a
//! worker whose [`crate::worker::WorkerConfig::sandbox`] is set is started as
//! `<wrapper> <wrapper args> <rules> -- <runtime> <runtime args>`, and the wrapper (the
//! daemon's own `copilot-pool sandbox-exec`, which applies a Landlock ruleset, drops every
//! capability and then execs the runtime in the same process) does the rest. Without a
//! sandbox a worker runs with its parent's rights, as before.
//!
//! The pool fills a [`Sandbox`] per key ([`Sandbox::for_agent`]): the agent's own directory
//! (its `COPILOT_HOME`, work directory and private temp directory), read and write; the
//! provider's port for a BYOK key without a model tunnel. [`Sandbox::SANDBOX_ARGS`] is the
//! argv the wrapper parses; [`SandboxStatus`] is what a probe of the wrapper found enforced
//! on this kernel (for logs, `doctor`, `/v1/pool` and the metrics).

use std::ffi::{OsStr, OsString};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::kinds::{SandboxMode, SandboxRule};

/// System directories a worker may read and execute (missing ones are skipped by the
/// wrapper).
pub const SYSTEM_EXEC_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt",
];

/// System directories a worker may read (configuration, certificates, the resolver).
pub const SYSTEM_READ_DIRS: &[&str] = &["/etc", "/run/systemd/resolve"];

/// Device files a worker may read, write and `ioctl` (the shell's terminal included).
pub const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
];

/// System-wide `/proc` files a worker may read. The worker's own `/proc/<pid>` is added by
/// the wrapper (the pid survives its exec of the runtime); no other process's entry is
/// readable.
pub const PROC_FILES: &[&str] = &[
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/stat",
    "/proc/loadavg",
    "/proc/uptime",
    "/proc/version",
];

/// The port of HTTPS: the Copilot API and GitHub in token mode.
pub const HTTPS_PORT: u16 = 443;

/// Where a worker may go, and the wrapper that holds it there.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sandbox {
    /// The wrapper program (the daemon passes its own executable).
    pub wrapper: PathBuf,
    /// The wrapper's arguments before the rules (the daemon passes `["sandbox-exec"]`).
    pub wrapper_args: Vec<OsString>,
    /// Refuse to start the worker unless every wall is enforced (else the wrapper enforces
    /// what the kernel supports).
    pub required: bool,
    /// Read, write, create and remove beneath these (the agent's directory is added per key;
    /// the daemon adds its `allowed_work_roots`).
    pub read_write: Vec<PathBuf>,
    /// Read and execute beneath these (the runtime's install is added at spawn).
    pub read_exec: Vec<PathBuf>,
    /// Read beneath these.
    pub read_only: Vec<PathBuf>,
    /// Device files to read, write and `ioctl`.
    pub devices: Vec<PathBuf>,
    /// Files of `/proc` to read.
    pub proc_files: Vec<PathBuf>,
    /// TCP ports the worker may connect to; `None` leaves TCP connect unrestricted, an empty
    /// list allows none.
    pub tcp_connect: Option<Vec<u16>>,
    /// Fixed TCP ports the worker may bind besides an ephemeral one (port 0, the kernel's
    /// pick, always allowed); `None` leaves TCP bind unrestricted. Default empty: no agent
    /// takes a fixed port another agent, a local model or the daemon after a restart needs.
    pub tcp_bind: Option<Vec<u16>>,
    /// Ports never allowed, whatever a provider names (the daemon's own listeners).
    pub never_connect: Vec<u16>,
    /// The worker's private temporary directory (`TMPDIR`, `TMP`, `TEMP`), set per key.
    pub temp_dir: Option<PathBuf>,
    /// The worker's `HOME` unless its `extra_env` sets one, set per key. It is the agent's
    /// own directory: when `read_write` holds it too ([`Sandbox::for_agent`]), the wrapper
    /// grants it only if the path, as given, leads to it with no link on the way, so it must
    /// be a resolved path.
    pub home: Option<PathBuf>,
}

/// Whether a sandbox asks for `rule`'s wall, given whether it restricts TCP connect and TCP
/// bind: every wall but those two left unrestricted, which are open on purpose. The one
/// place of that rule, for [`Sandbox::asks_for`] and the wrapper's own flags (`--any-tcp`,
/// `--any-tcp-bind`).
pub fn wall_wanted(rule: SandboxRule, restricts_connect: bool, restricts_bind: bool) -> bool {
    match rule {
        SandboxRule::TcpConnect => restricts_connect,
        SandboxRule::TcpBind => restricts_bind,
        SandboxRule::Filesystem
        | SandboxRule::Signals
        | SandboxRule::AbstractUnixSockets
        | SandboxRule::Capabilities => true,
    }
}

/// A sandbox the pool could not prepare for a key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SandboxError {
    /// The agent's private temporary directory could not be made.
    #[error(
        "could not create the worker's private temporary directory {path:?}: {source}; if it \
         is a file or a link (which the agent's own processes may have put there), remove it, \
         else make the agent's directory writable by the daemon's user"
    )]
    TempDir {
        /// The directory.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// A conversation's working directory lies outside everything the worker may write.
    #[error(
        "the working directory {path:?} lies outside what the sandbox lets this agent's \
         runtime write ({allowed}); use a directory inside them, or add its root to the \
         sandbox's read_write (allowed_work_roots in the daemon's config)"
    )]
    WorkingDirectoryOutside {
        /// The working directory.
        path: PathBuf,
        /// The writable roots, comma-separated.
        allowed: String,
    },
}

impl Sandbox {
    /// Whether this sandbox asks for `rule`'s wall: every one but TCP connect and bind left
    /// unrestricted (`tcp_connect`, `tcp_bind` `None`), which are open on purpose.
    pub fn asks_for(&self, rule: SandboxRule) -> bool {
        wall_wanted(rule, self.tcp_connect.is_some(), self.tcp_bind.is_some())
    }

    /// Flags of the wrapper's argv (after `wrapper_args`), each followed by one value, then
    /// `--` and the runtime's argv: `--rw`, `--agent-dir` (the path of `read_write` that is
    /// `home`: the agent's own directory, granted only if no link leads elsewhere),
    /// `--rx`, `--ro`, `--dev`, `--proc` (paths),
    /// `--tcp-connect`, `--tcp-bind` (a port); `--any-tcp` (TCP connect unrestricted),
    /// `--any-tcp-bind` (TCP bind unrestricted; without it a bind takes an ephemeral port or
    /// a `--tcp-bind` port) and `--required` stand alone.
    pub const SANDBOX_ARGS: &'static [&'static str] = &[
        "--rw",
        "--agent-dir",
        "--rx",
        "--ro",
        "--dev",
        "--proc",
        "--tcp-connect",
        "--any-tcp",
        "--tcp-bind",
        "--any-tcp-bind",
        "--required",
    ];

    /// A sandbox run by `wrapper wrapper_args`, with the system directories, devices and
    /// `/proc` files above, TCP connect to port 443 only, TCP bind to an ephemeral port only,
    /// and nothing writable yet.
    pub fn new(wrapper: PathBuf, wrapper_args: Vec<OsString>) -> Self {
        let paths = |list: &[&str]| list.iter().map(PathBuf::from).collect::<Vec<_>>();
        Self {
            wrapper,
            wrapper_args,
            required: false,
            read_write: Vec::new(),
            read_exec: paths(SYSTEM_EXEC_DIRS),
            read_only: paths(SYSTEM_READ_DIRS),
            devices: paths(DEVICES),
            proc_files: paths(PROC_FILES),
            tcp_connect: Some(vec![HTTPS_PORT]),
            tcp_bind: Some(Vec::new()),
            never_connect: Vec::new(),
            temp_dir: None,
            home: None,
        }
    }

    /// This sandbox for one agent whose directory is `agent_root` (its `COPILOT_HOME` and
    /// work directory lie inside): `agent_root` read and write, `<agent_root>/tmp` (created,
    /// mode 0700) as the temporary directory, `agent_root` as `HOME`, and `ports` allowed for
    /// TCP connect too (a BYOK provider reached directly, the pool's priming sink).
    /// `agent_root` must be a resolved path (`std::fs::canonicalize`, as the pool's homes
    /// are): the wrapper refuses to start a process whose agent directory's path leads
    /// anywhere through a link (`--agent-dir`).
    pub fn for_agent(&self, agent_root: &Path, ports: &[u16]) -> Result<Sandbox, SandboxError> {
        let mut sandbox = self.clone();
        let temp = agent_root.join("tmp");
        // The agent's directory is the pool's (resolved); `tmp` in it is made without
        // following a link the agent's processes may have planted there.
        crate::home::ensure_private_dir(agent_root)
            .and_then(|()| crate::agent_files::create_dirs(agent_root, Path::new("tmp"), 0o700))
            .map_err(|source| SandboxError::TempDir {
                path: temp.clone(),
                source,
            })?;
        sandbox.read_write.push(agent_root.to_path_buf());
        sandbox.temp_dir = Some(temp);
        sandbox.home = Some(agent_root.to_path_buf());
        if let Some(allowed) = sandbox.tcp_connect.as_mut() {
            for port in ports {
                if !allowed.contains(port) {
                    allowed.push(*port);
                }
            }
        }
        Ok(sandbox)
    }

    /// Checks that a conversation's working directory lies where the worker may write (links
    /// and `..` resolved), so a lease that could not work fails before anything starts.
    pub fn check_working_directory(&self, path: &Path) -> Result<(), SandboxError> {
        if crate::confine::confine("workingDirectory", path, &self.read_write).is_ok() {
            return Ok(());
        }
        Err(SandboxError::WorkingDirectoryOutside {
            path: path.to_path_buf(),
            allowed: self
                .read_write
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// The directory of this sandbox that every worker may read (the system directories,
    /// `read_exec`, `read_only`, the devices, and `read_write` as far as it is shared: the
    /// daemon's `allowed_work_roots`) under which `path` lies, if any. What the daemon keeps
    /// from its agents (its state, the agents' homes, the transcripts, the API token) must
    /// lie under none. Compares the paths as given: resolve both first.
    pub fn shared_root_of(&self, path: &Path) -> Option<&Path> {
        self.read_exec
            .iter()
            .chain(&self.read_only)
            .chain(&self.devices)
            .chain(&self.read_write)
            .map(PathBuf::as_path)
            // Every path "lies under" an empty or relative one; such a root grants nothing.
            .filter(|root| root.is_absolute())
            .find(|root| path.starts_with(root))
    }

    /// The TCP ports the wrapper allows: `tcp_connect` without `never_connect`, sorted, each
    /// once (`None`: unrestricted).
    pub fn allowed_ports(&self) -> Option<Vec<u16>> {
        self.tcp_connect.as_ref().map(|ports| {
            let mut ports: Vec<u16> = ports
                .iter()
                .copied()
                .filter(|p| !self.never_connect.contains(p))
                .collect();
            ports.sort_unstable();
            ports.dedup();
            ports
        })
    }

    /// The program and argv that start `program args` inside this sandbox: the wrapper,
    /// its arguments, the rules, `--`, then the runtime's argv. The runtime's install
    /// directory ([`install_root`]) is added to what may be read and executed.
    pub fn command(&self, program: &Path, args: &[OsString]) -> (PathBuf, Vec<OsString>) {
        let mut argv = self.wrapper_args.clone();
        if self.required {
            argv.push("--required".into());
        }
        // The agent's own directory goes as `--agent-dir`: the wrapper grants it only if it
        // is still the directory the pool resolved, with no link planted on the way.
        for path in &self.read_write {
            let flag = if self.home.as_ref() == Some(path) {
                "--agent-dir"
            } else {
                "--rw"
            };
            argv.push(flag.into());
            argv.push(path.clone().into());
        }
        let mut paths = |flag: &str, list: &[PathBuf]| {
            for path in list {
                argv.push(flag.into());
                argv.push(path.clone().into());
            }
        };
        let mut exec = self.read_exec.clone();
        // A bare name found nowhere has no install to grant (its "directory" would be the
        // empty path, under which every path lies).
        if !crate::runtime::is_bare_name(program) {
            exec.push(install_root(program));
        }
        paths("--rx", &exec);
        paths("--ro", &self.read_only);
        paths("--dev", &self.devices);
        paths("--proc", &self.proc_files);
        match self.allowed_ports() {
            None => argv.push("--any-tcp".into()),
            Some(ports) => {
                for port in ports {
                    argv.push("--tcp-connect".into());
                    argv.push(port.to_string().into());
                }
            }
        }
        match &self.tcp_bind {
            None => argv.push("--any-tcp-bind".into()),
            Some(ports) => {
                for port in ports {
                    argv.push("--tcp-bind".into());
                    argv.push(port.to_string().into());
                }
            }
        }
        argv.push("--".into());
        argv.push(program.into());
        argv.extend(args.iter().cloned());
        (self.wrapper.clone(), argv)
    }
}

impl Sandbox {
    /// The program and argv that start one CLI backend process (Claude Code, Codex, Gemini
    /// CLI, ...) inside this sandbox: as [`Sandbox::command`], with the program resolved on
    /// `path_var` when it is a bare name, the install roots of [`cli_install_roots`] added to
    /// what may be read and executed, and `ports` (the model endpoint's, a loopback MCP
    /// bridge's) to what TCP may connect to (an unrestricted sandbox stays unrestricted).
    ///
    /// `configured` are the backend's argument lists as its configuration writes them (its
    /// `args` and `resumeArgs`, placeholders not filled in). The first of `args` is taken as
    /// a script the program runs (`node <bundle.js>`), and its install root granted, only
    /// when it is the first of one of these lists as written: an argument filled in from a
    /// caller's prompt, model or a session id (`{prompt}` first) names no script, so a
    /// prompt that is a path grants nothing.
    pub fn cli_command(
        &self,
        program: &Path,
        args: &[OsString],
        configured: &[&[String]],
        path_var: Option<&OsStr>,
        ports: &[u16],
    ) -> (PathBuf, Vec<OsString>) {
        let mut sandbox = self.clone();
        let program = resolve_program(program, path_var);
        let script = match args.first() {
            Some(first)
                if configured
                    .iter()
                    .any(|list| list.first().is_some_and(|arg| OsStr::new(arg) == first)) =>
            {
                &args[..1]
            }
            _ => &[],
        };
        for root in cli_install_roots(&program, script, path_var) {
            if !sandbox.read_exec.contains(&root) {
                sandbox.read_exec.push(root);
            }
        }
        if let Some(allowed) = sandbox.tcp_connect.as_mut() {
            for port in ports {
                if !allowed.contains(port) {
                    allowed.push(*port);
                }
            }
        }
        sandbox.command(&program, args)
    }

    /// This sandbox for an agent's CLI backend processes: TCP connect to `model_ports` only
    /// (the configured ports are the Copilot runtime's; a CLI talks to its model endpoint),
    /// everything else as [`Sandbox::for_agent`] (the agent's directory, which holds each
    /// backend's home, read and write; its private temporary directory).
    pub fn for_cli_agent(
        &self,
        agent_root: &Path,
        model_ports: &[u16],
    ) -> Result<Sandbox, SandboxError> {
        let mut sandbox = self.for_agent(agent_root, &[])?;
        if let Some(ports) = sandbox.tcp_connect.as_mut() {
            ports.clear();
            ports.extend_from_slice(model_ports);
        }
        Ok(sandbox)
    }
}

/// `program` as found on `path_var` when it is a bare name (no `/`), else as given.
fn resolve_program(program: &Path, path_var: Option<&OsStr>) -> PathBuf {
    match program.to_str() {
        Some(name) if crate::runtime::is_bare_name(program) => {
            crate::runtime::find_on_path(name, path_var.map(OsStr::to_owned))
                .unwrap_or_else(|| program.to_path_buf())
        }
        _ => program.to_path_buf(),
    }
}

/// What a CLI process must read and execute beyond the system directories: the program's
/// install root ([`install_root`]); for a `#!` script (an npm `.bin` launcher), its
/// interpreter's (`#!/usr/bin/env node` resolved on `path_var`); for an interpreter given a
/// script as its first argument (`node <bundle/gemini.js>`), the script's. `args` must be
/// arguments as configured, never ones filled in from a request (see
/// [`Sandbox::cli_command`]): their first, when it is an existing file, has its install root
/// granted.
pub fn cli_install_roots(
    program: &Path,
    args: &[OsString],
    path_var: Option<&OsStr>,
) -> Vec<PathBuf> {
    let program = resolve_program(program, path_var);
    // A program not found (a bare name on no `PATH` entry) has no install to grant.
    let mut roots = Vec::new();
    if !crate::runtime::is_bare_name(&program) {
        roots.push(install_root(&program));
    }
    // Nor does an interpreter found nowhere (its "directory" would be the empty path).
    if let Some(interpreter) = shebang_interpreter(&program, path_var)
        && interpreter.is_absolute()
    {
        roots.push(install_root(&interpreter));
    }
    if let Some(script) = args.first().map(Path::new)
        && script.is_absolute()
        && script.is_file()
    {
        roots.push(install_root(script));
    }
    roots.dedup();
    roots
}

/// The interpreter a `#!` line names (`env`'s first operand resolved on `path_var`).
fn shebang_interpreter(program: &Path, path_var: Option<&OsStr>) -> Option<PathBuf> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let read = std::fs::File::open(program).ok()?.read(&mut head).ok()?;
    let line = head[..read].strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut words = line.split_whitespace();
    let interpreter = PathBuf::from(words.next()?);
    if interpreter.file_name().is_some_and(|n| n == "env") {
        // `env`'s options and `NAME=value` settings come before the program.
        let name = words.find(|w| !w.starts_with('-') && !w.contains('='))?;
        return Some(resolve_program(Path::new(name), path_var));
    }
    Some(interpreter)
}

/// The directory a runtime executable is installed in, for read and execute: the directory
/// above the outermost `node_modules` of its path (an npm prefix holds the launcher, its
/// native module and its packages), else the executable's own directory.
pub fn install_root(program: &Path) -> PathBuf {
    let program = std::fs::canonicalize(program).unwrap_or_else(|_| program.to_path_buf());
    let outermost = program
        .ancestors()
        .filter(|a| a.file_name().is_some_and(|n| n == "node_modules"))
        .last()
        .and_then(Path::parent);
    match outermost {
        Some(root) => root.to_path_buf(),
        None => program
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("/")),
    }
}

/// The TCP port of an `http(s)` URL (its explicit port, else 80 or 443); `None` for
/// anything else. Read by the WHATWG URL rules, as the model guard and the CLIs (Node's
/// `URL`) read it: `https://host\:80/` is port 443 to all of them, so the port the sandbox
/// opens is the one the CLI connects to and the one the guard checked.
pub fn url_port(url: &str) -> Option<u16> {
    let parsed = url::Url::parse(url).ok()?;
    match parsed.scheme() {
        "http" | "https" => parsed.port_or_known_default(),
        _ => None,
    }
}

/// What a probe of the wrapper found enforced on this kernel (the daemon runs it once at
/// start): for the log line, `doctor`, `/v1/pool` and `copilot_pool_sandbox_enforced`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[serde(default)]
#[non_exhaustive]
pub struct SandboxStatus {
    /// `auto`, `required` or `off` (`None`: not configured, as for an embedder).
    pub mode: Option<SandboxMode>,
    /// The Landlock ABI the wrapper used (0: none).
    pub landlock_abi: u32,
    /// Files confined.
    pub filesystem: bool,
    /// TCP connect confined to the allowed ports.
    pub tcp_connect: bool,
    /// TCP bind confined to an ephemeral port and the configured fixed ones.
    pub tcp_bind: bool,
    /// Signals scoped to the worker's own sandbox.
    pub signals: bool,
    /// Abstract Unix sockets scoped to the worker's own sandbox.
    pub abstract_unix_sockets: bool,
    /// Every capability dropped before the runtime starts.
    pub capabilities: bool,
}

impl SandboxStatus {
    /// Whether `rule` is enforced.
    pub fn enforced(&self, rule: SandboxRule) -> bool {
        match rule {
            SandboxRule::Filesystem => self.filesystem,
            SandboxRule::TcpConnect => self.tcp_connect,
            SandboxRule::TcpBind => self.tcp_bind,
            SandboxRule::Signals => self.signals,
            SandboxRule::AbstractUnixSockets => self.abstract_unix_sockets,
            SandboxRule::Capabilities => self.capabilities,
        }
    }

    /// The rules not enforced.
    pub fn missing(&self) -> Vec<SandboxRule> {
        SandboxRule::ALL
            .into_iter()
            .filter(|r| !self.enforced(*r))
            .collect()
    }

    /// One line: what is and what is not enforced.
    pub fn summary(&self) -> String {
        let list = |rules: Vec<SandboxRule>| {
            if rules.is_empty() {
                "none".to_owned()
            } else {
                rules
                    .iter()
                    .map(|r| r.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        let enforced = SandboxRule::ALL
            .into_iter()
            .filter(|r| self.enforced(*r))
            .collect();
        format!(
            "Landlock ABI {}; enforced: {}; not enforced: {}",
            self.landlock_abi,
            list(enforced),
            list(self.missing())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox() -> Sandbox {
        Sandbox::new("/opt/cp/copilot-pool".into(), vec!["sandbox-exec".into()])
    }

    #[test]
    fn the_wrapper_argv_carries_every_rule_then_the_runtime_argv() {
        let mut s = sandbox();
        s.read_write = vec!["/srv/agents/a1".into()];
        s.read_exec = vec!["/usr".into()];
        s.read_only = vec!["/etc".into()];
        s.devices = vec!["/dev/null".into()];
        s.proc_files = vec!["/proc/stat".into()];
        s.tcp_connect = Some(vec![8080, 443, 8080, 7878]);
        s.never_connect = vec![7878];
        s.required = true;
        let (program, argv) = s.command(
            Path::new("/rt/node_modules/@github/x/prebuilds/copilot-runtime"),
            &["--stdio".into()],
        );
        assert_eq!(program, PathBuf::from("/opt/cp/copilot-pool"));
        let argv: Vec<String> = argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            argv,
            [
                "sandbox-exec",
                "--required",
                "--rw",
                "/srv/agents/a1",
                "--rx",
                "/usr",
                "--rx",
                "/rt",
                "--ro",
                "/etc",
                "--dev",
                "/dev/null",
                "--proc",
                "/proc/stat",
                "--tcp-connect",
                "443",
                "--tcp-connect",
                "8080",
                "--",
                "/rt/node_modules/@github/x/prebuilds/copilot-runtime",
                "--stdio"
            ]
        );
        s.tcp_connect = None;
        let (_, argv) = s.command(Path::new("/bin/rt"), &[]);
        assert!(argv.contains(&OsString::from("--any-tcp")));
        s.tcp_connect = Some(Vec::new());
        let (_, argv) = s.command(Path::new("/bin/rt"), &[]);
        assert!(!argv.iter().any(|a| a.to_string_lossy().contains("tcp")));
    }

    #[test]
    fn an_agent_gets_its_own_directory_temp_home_and_provider_port() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("agents/a1");
        std::fs::create_dir_all(&agent).unwrap();
        let s = sandbox().for_agent(&agent, &[8080]).unwrap();
        assert_eq!(s.read_write, std::slice::from_ref(&agent));
        assert_eq!(s.temp_dir.as_deref(), Some(agent.join("tmp").as_path()));
        assert!(agent.join("tmp").is_dir());
        // A link planted in its place is not followed: nothing is made where it leads.
        let other = dir.path().join("agents/a9");
        std::fs::create_dir_all(&other).unwrap();
        let planted = dir.path().join("agents/a3");
        std::fs::create_dir_all(&planted).unwrap();
        std::os::unix::fs::symlink(&other, planted.join("tmp")).unwrap();
        let refused = sandbox().for_agent(&planted, &[]).unwrap_err().to_string();
        assert!(refused.contains("remove it"), "{refused}");
        assert!(std::fs::read_dir(&other).unwrap().next().is_none());
        assert_eq!(s.home.as_deref(), Some(agent.as_path()));
        assert_eq!(s.allowed_ports(), Some(vec![443, 8080]));
        // Its directory goes to the wrapper as the agent's, to be checked for a planted link;
        // a root the operator shares stays `--rw`.
        let mut shared = s.clone();
        shared.read_write.push("/srv/shared".into());
        let (_, argv) = shared.command(Path::new("/rt/copilot"), &[]);
        let pairs: Vec<(&OsString, &OsString)> = argv.iter().zip(argv.iter().skip(1)).collect();
        assert!(pairs.contains(&(&"--agent-dir".into(), &agent.clone().into_os_string())));
        assert!(!pairs.contains(&(&"--rw".into(), &agent.clone().into_os_string())));
        assert!(pairs.contains(&(&"--rw".into(), &"/srv/shared".into())));
        s.check_working_directory(&agent.join("work")).unwrap();
        let outside = s
            .check_working_directory(&dir.path().join("agents/a2/work"))
            .unwrap_err()
            .to_string();
        assert!(outside.contains("allowed_work_roots"), "{outside}");
        // An unrestricted sandbox stays unrestricted.
        let mut open = sandbox();
        open.tcp_connect = None;
        assert_eq!(open.for_agent(&agent, &[8080]).unwrap().tcp_connect, None);
    }

    #[test]
    fn the_install_root_is_above_node_modules_or_the_program_directory() {
        assert_eq!(
            install_root(Path::new(
                "/c/runtime/1.0.14/node_modules/@github/sdk/prebuilds/linux-x64/copilot-runtime"
            )),
            PathBuf::from("/c/runtime/1.0.14")
        );
        assert_eq!(
            install_root(Path::new("/usr/local/bin/copilot")),
            PathBuf::from("/usr/local/bin")
        );
    }

    #[test]
    fn a_cli_program_found_nowhere_grants_no_root() {
        // Its "directory" would be the empty path, under which every path lies.
        let path = std::env::var_os("PATH");
        let roots = cli_install_roots(Path::new("not-installed-anywhere"), &[], path.as_deref());
        assert!(roots.is_empty(), "{roots:?}");
        let (_, argv) = sandbox().command(Path::new("not-installed-anywhere"), &[]);
        assert!(
            argv.windows(2)
                .all(|w| !(w[0] == "--rx" && w[1].is_empty())),
            "{argv:?}"
        );
        // A launcher whose interpreter is on no entry of the backend's PATH.
        let dir = tempfile::tempdir().unwrap();
        for shebang in [
            "#!/usr/bin/env node-not-anywhere\n",
            "#!/usr/bin/env NODE_OPTIONS=x node-not-anywhere\n",
        ] {
            let launcher = dir.path().join("cli.js");
            std::fs::write(&launcher, shebang).unwrap();
            let roots = cli_install_roots(&launcher, &[], Some(OsStr::new("/nonexistent")));
            assert_eq!(roots, [install_root(&launcher)], "{shebang}");
        }
        // Nor does an empty root hold the daemon's places.
        let mut s = sandbox();
        s.read_exec.push(PathBuf::new());
        s.read_only.push("relative".into());
        assert_eq!(s.shared_root_of(Path::new("/var/lib/copilot-pool")), None);
    }

    #[test]
    fn a_cli_process_reads_its_launcher_interpreter_and_script_installs_and_connects_to_its_model_only()
     {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("cli");
        let bin = prefix.join("node_modules/@x/cli/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let launcher = bin.join("cli.js");
        std::fs::write(
            &launcher,
            "#!/usr/bin/env -S mynode --flag\nconsole.log(1)\n",
        )
        .unwrap();
        let node_dir = dir.path().join("node/bin");
        std::fs::create_dir_all(&node_dir).unwrap();
        let node = node_dir.join("mynode");
        std::fs::write(&node, "").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&node, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path_var = std::env::join_paths([node_dir.clone()]).unwrap();

        let roots = cli_install_roots(&launcher, &[], Some(&path_var));
        assert_eq!(roots, [prefix.clone(), node_dir.clone()]);
        // `node <script>`: the program by name on PATH, the script's install too.
        let roots = cli_install_roots(
            Path::new("mynode"),
            &[launcher.clone().into()],
            Some(&path_var),
        );
        assert_eq!(roots, [node_dir.clone(), prefix.clone()]);

        let agent = dir.path().join("agents/a1");
        std::fs::create_dir_all(&agent).unwrap();
        let mut template = sandbox();
        template.never_connect = vec![7878];
        let s = template.for_cli_agent(&agent, &[41234]).unwrap();
        assert_eq!(s.read_write, std::slice::from_ref(&agent));
        assert_eq!(
            s.allowed_ports(),
            Some(vec![41234]),
            "443 is the runtime's, not a CLI's"
        );
        let configured = [launcher.display().to_string()];
        let (program, argv) = s.cli_command(
            Path::new("mynode"),
            &[launcher.clone().into()],
            &[&configured],
            Some(&path_var),
            &[5555, 7878],
        );
        assert_eq!(program, PathBuf::from("/opt/cp/copilot-pool"));
        let argv: Vec<String> = argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let after = |flag: &str| -> Vec<&str> {
            argv.windows(2)
                .filter(|w| w[0] == flag)
                .map(|w| w[1].as_str())
                .collect()
        };
        assert_eq!(
            after("--tcp-connect"),
            ["5555", "41234"],
            "the bridge's, never the daemon's"
        );
        let exec = after("--rx");
        for root in [&prefix, &node_dir] {
            assert!(
                exec.contains(&root.to_str().unwrap()),
                "{root:?} in {exec:?}"
            );
        }
        let tail = &argv[argv.iter().position(|a| a == "--").unwrap() + 1..];
        assert_eq!(tail, [node.to_str().unwrap(), launcher.to_str().unwrap()]);
    }

    #[test]
    fn a_prompt_or_model_that_names_another_agents_file_grants_nothing_to_read() {
        let dir = tempfile::tempdir().unwrap();
        let bob = dir.path().join("agents/bob");
        std::fs::create_dir_all(bob.join("claude-cli")).unwrap();
        std::fs::create_dir_all(bob.join("node_modules/x")).unwrap();
        let credentials = bob.join("claude-cli/.claude.json");
        let module = bob.join("node_modules/x/index.js");
        for file in [&credentials, &module] {
            std::fs::write(file, "{}").unwrap();
        }
        let agent = dir.path().join("agents/alice");
        let s = sandbox().for_cli_agent(&agent, &[443]).unwrap();
        let exec_of = |args: &[OsString], configured: &[&[String]]| -> Vec<String> {
            let (_, argv) = s.cli_command(Path::new("/bin/sh"), args, configured, None, &[]);
            argv.windows(2)
                .filter(|w| w[0] == "--rx")
                .map(|w| w[1].to_string_lossy().into_owned())
                .collect()
        };
        let plain = exec_of(&[], &[]);
        // A generic backend whose `args` start with `{prompt}` or `{model}`: the caller's
        // text is argv[0], and names a file of bob's (or a module in his directory).
        let prompt_first = [crate::backend::PROMPT_PLACEHOLDER.to_owned()];
        let model_first = [
            crate::backend::MODEL_PLACEHOLDER.to_owned(),
            "-p".to_owned(),
        ];
        for path in [&credentials, &module] {
            for configured in [&prompt_first[..], &model_first[..]] {
                let exec = exec_of(&[path.into()], &[configured, &[]]);
                assert_eq!(exec, plain, "{path:?} as {configured:?}");
                assert!(!exec.iter().any(|p| Path::new(p).starts_with(&bob)));
            }
        }
        // The same file written first in the configuration is a script the program runs.
        let written = [module.display().to_string(), "{prompt}".to_owned()];
        let exec = exec_of(&[module.clone().into()], &[&prompt_first, &written]);
        assert!(exec.contains(&bob.display().to_string()), "{exec:?}");
    }

    #[test]
    fn a_url_port_is_explicit_or_the_scheme_default() {
        assert_eq!(url_port("http://127.0.0.1:41234/v1"), Some(41234));
        assert_eq!(url_port("https://models.example/v1"), Some(443));
        assert_eq!(url_port("http://user:pw@host/x"), Some(80));
        assert_eq!(url_port("http://[::1]:9000/v1"), Some(9000));
        assert_eq!(url_port("http://[::1]/v1"), Some(80));
        assert_eq!(url_port("file:///etc/passwd"), None);
        assert_eq!(url_port("http://host:notaport/"), None);
        // A backslash ends the host as a slash does (WHATWG, as Node's URL and the guard
        // read it): the port after it is part of the path.
        assert_eq!(url_port("https://model.test\\:80/v1"), Some(443));
        assert_eq!(url_port("https://model.test\\@x:80/"), Some(443));
        assert_eq!(url_port("HTTPS://Model.Test:8443/v1"), Some(8443));
    }

    #[test]
    fn what_every_worker_may_read_is_found_above_a_path() {
        let mut s = sandbox();
        s.read_only.push("/srv/shared".into());
        s.read_write.push("/work/roots".into());
        let root = |p: &str| s.shared_root_of(Path::new(p)).map(Path::to_path_buf);
        assert_eq!(root("/opt/copilot-pool/state"), Some("/opt".into()));
        assert_eq!(root("/etc/copilot-pool/token"), Some("/etc".into()));
        assert_eq!(root("/srv/shared/agents"), Some("/srv/shared".into()));
        assert_eq!(root("/work/roots/team/state"), Some("/work/roots".into()));
        assert_eq!(root("/var/lib/copilot-pool"), None);
        assert_eq!(root("/run/copilot-pool/token"), None);
        // Components, not prefixes of names.
        assert_eq!(root("/optional/state"), None);
        assert_eq!(root("/srv/shared-not/x"), None);
    }

    #[test]
    fn a_status_says_what_is_and_is_not_enforced() {
        let status = SandboxStatus {
            mode: Some(SandboxMode::Auto),
            landlock_abi: 3,
            filesystem: true,
            capabilities: true,
            ..Default::default()
        };
        assert_eq!(
            status.missing(),
            [
                SandboxRule::TcpConnect,
                SandboxRule::TcpBind,
                SandboxRule::Signals,
                SandboxRule::AbstractUnixSockets
            ]
        );
        assert_eq!(
            status.summary(),
            "Landlock ABI 3; enforced: filesystem, capabilities; not enforced: tcp_connect, \
             tcp_bind, signals, abstract_unix_sockets"
        );
    }
}
