//! `copilot-pool sandbox-exec` (hidden): the wrapper a sandboxed worker is started through
//! (see `copilot_pool::sandbox`). In one process, before any thread starts: drop every
//! capability (root included: the bounding, inheritable and ambient sets too, so the exec
//! grants none back), apply a Landlock ruleset (files, TCP connect, TCP bind to an ephemeral
//! port or a `--tcp-bind` one, signal and abstract Unix socket scopes; best effort unless
//! `--required`), then exec the runtime. The pid survives
//! the exec, so the ruleset can allow the runtime's own `/proc/<pid>` and nothing else of
//! `/proc` beyond the system-wide files it is given.
//!
//! `--probe` applies the same walls and prints what was enforced (a `SandboxStatus` as one
//! JSON line) instead of exec'ing: the daemon and `doctor` run it once to learn what this
//! kernel enforces.

use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::ServeConfig;
use anyhow::{Context, Result, bail};
use clap::Args;
use copilot_pool::kinds::{SandboxMode, SandboxRule};
use copilot_pool::process::GroupLeader;
use copilot_pool::sandbox::{Sandbox, SandboxStatus, wall_wanted};
use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, LandlockStatus, NetPort, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
};

/// The newest Landlock ABI these rules were written and tested for (6: signal and abstract
/// Unix socket scopes; 7 adds only audit logging).
const RULES_ABI: ABI = ABI::V6;

/// The hidden subcommand's name, as the daemon passes it to the wrapper.
pub const SUBCOMMAND: &str = "sandbox-exec";

/// Exit status of a wrapper that could not set up the walls or exec the runtime.
const SETUP_FAILED: u8 = 126;

/// The wrapper's argv: the rules (see `copilot_pool::sandbox::Sandbox::SANDBOX_ARGS`), then
/// `--` and the runtime's argv.
#[derive(Args, Debug, Default)]
pub struct SandboxExecArgs {
    /// Refuse to exec unless every wall is enforced.
    #[arg(long)]
    pub required: bool,
    /// Read, write, create and remove beneath this directory.
    #[arg(long = "rw", value_name = "PATH")]
    pub read_write: Vec<PathBuf>,
    /// The agent's own directory: as `--rw`, and it must be the very directory the path
    /// names, with no link on the way (the pool resolved it, and the agent's processes may
    /// have planted a link in its place since).
    #[arg(long = "agent-dir", value_name = "PATH")]
    pub agent_dirs: Vec<PathBuf>,
    /// Read and execute beneath this directory.
    #[arg(long = "rx", value_name = "PATH")]
    pub read_exec: Vec<PathBuf>,
    /// Read beneath this directory.
    #[arg(long = "ro", value_name = "PATH")]
    pub read_only: Vec<PathBuf>,
    /// A device file (or directory of them) to read, write and ioctl.
    #[arg(long = "dev", value_name = "PATH")]
    pub devices: Vec<PathBuf>,
    /// A file of /proc to read.
    #[arg(long = "proc", value_name = "PATH")]
    pub proc_files: Vec<PathBuf>,
    /// A TCP port the runtime may connect to (none given: no TCP connect at all).
    #[arg(long = "tcp-connect", value_name = "PORT")]
    pub tcp_connect: Vec<u16>,
    /// Leave TCP connect unrestricted.
    #[arg(long)]
    pub any_tcp: bool,
    /// A fixed TCP port the runtime may bind besides an ephemeral one (port 0).
    #[arg(long = "tcp-bind", value_name = "PORT")]
    pub tcp_bind: Vec<u16>,
    /// Leave TCP bind unrestricted (without it, a bind takes an ephemeral port or a
    /// `--tcp-bind` one).
    #[arg(long)]
    pub any_tcp_bind: bool,
    /// Print what is enforced as JSON and exit instead of exec'ing.
    #[arg(long)]
    pub probe: bool,
    /// The runtime's program and arguments.
    #[arg(last = true, value_name = "PROGRAM")]
    pub command: Vec<OsString>,
}

/// Runs the wrapper: never returns on success (the runtime replaced it), else the exit
/// status after printing why to stderr (the worker's stderr tail shows it).
pub fn main(args: SandboxExecArgs) -> std::process::ExitCode {
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("copilot-pool sandbox-exec: {e:#}");
            std::process::ExitCode::from(SETUP_FAILED)
        }
    }
}

fn run(args: SandboxExecArgs) -> Result<()> {
    if !args.probe && args.command.is_empty() {
        bail!("no program to run: pass it after `--`");
    }
    let status = confine(&args)?;
    if args.probe {
        println!("{}", serde_json::to_string(&status)?);
        return Ok(());
    }
    let missing = wanted_missing(&args, &status);
    if args.required && !missing.is_empty() {
        bail!(
            "sandbox = \"required\" but this kernel does not enforce {} ({}); run on a kernel \
             with Landlock ABI 6 or newer (Linux 6.12+) and as a user whose capabilities can \
             be dropped, or set sandbox = \"auto\"",
            names(&missing),
            status.summary()
        );
    }
    let program = &args.command[0];
    let error = std::process::Command::new(program)
        .args(&args.command[1..])
        .exec();
    Err(anyhow::Error::new(error).context(format!(
        "exec {} (is the runtime installed and under a --rx directory?)",
        Path::new(program).display()
    )))
}

/// The rules asked for that are not enforced (TCP only when it was to be restricted).
fn wanted_missing(args: &SandboxExecArgs, status: &SandboxStatus) -> Vec<SandboxRule> {
    status
        .missing()
        .into_iter()
        .filter(|r| wall_wanted(*r, !args.any_tcp, !args.any_tcp_bind))
        .collect()
}

/// The rules a sandbox like `template` asks for that `status` does not enforce: TCP connect
/// and bind only when they were to be restricted (`sandbox_tcp_bind = "any"` leaves bind
/// open on purpose). What `required` refuses to start without, and `auto` warns about.
pub fn unmet_by(template: &Sandbox, status: &SandboxStatus) -> Vec<SandboxRule> {
    status
        .missing()
        .into_iter()
        .filter(|r| template.asks_for(*r))
        .collect()
}

fn names(rules: &[SandboxRule]) -> String {
    rules
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Drops every capability, then applies the Landlock ruleset to this (single-threaded)
/// process; returns what is enforced.
fn confine(args: &SandboxExecArgs) -> Result<SandboxStatus> {
    let capabilities = drop_capabilities()?;
    let abi = RULES_ABI;
    let mut ruleset = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .context("handling file access")?;
    if !args.any_tcp {
        ruleset = ruleset
            .handle_access(AccessNet::ConnectTcp)
            .context("handling TCP connect")?;
    }
    if !args.any_tcp_bind {
        ruleset = ruleset
            .handle_access(AccessNet::BindTcp)
            .context("handling TCP bind")?;
    }
    let mut created = ruleset
        .scope(Scope::from_all(abi))
        .context("scoping signals and abstract Unix sockets")?
        .create()
        .context("creating the Landlock ruleset")?;
    let all = AccessFs::from_all(abi);
    let read = AccessFs::ReadFile | AccessFs::ReadDir;
    let read_exec = AccessFs::from_read(abi);
    let device = AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::IoctlDev | AccessFs::ReadDir;
    let own_proc = PathBuf::from(format!("/proc/{}", std::process::id()));
    let groups: [(&[PathBuf], BitFlags<AccessFs>); 5] = [
        (&args.read_write, all),
        (&args.read_exec, read_exec),
        (&args.read_only, read),
        (&args.devices, device),
        (&args.proc_files, read),
    ];
    for (paths, access) in groups {
        for path in paths {
            created = add_path(created, path, access)?;
        }
    }
    for dir in &args.agent_dirs {
        created = add_agent_dir(created, dir, all)?;
    }
    created = add_path(created, &own_proc, read)?;
    if !args.any_tcp_bind {
        // Port 0 is the kernel's choice of a free ephemeral port: servers a tool starts on
        // port 0 work, a fixed port (another agent's, a service's on this host) is refused
        // unless listed.
        for port in std::iter::once(&0).chain(&args.tcp_bind) {
            created = created
                .add_rule(NetPort::new(*port, AccessNet::BindTcp))
                .with_context(|| format!("allowing TCP bind to port {port}"))?;
        }
    }
    if !args.any_tcp {
        for port in &args.tcp_connect {
            created = created
                .add_rule(NetPort::new(*port, AccessNet::ConnectTcp))
                .with_context(|| format!("allowing TCP connect to port {port}"))?;
        }
    }
    let restricted = created
        .restrict_self()
        .context("applying the Landlock ruleset")?;
    let landlock_abi = match restricted.landlock {
        LandlockStatus::Available { effective_abi, .. } => effective_abi as u32,
        _ => 0,
    };
    let applied = restricted.ruleset != RulesetStatus::NotEnforced;
    // Without no_new_privs a setuid or file-capability program the runtime execs gets
    // privileges back, whatever was dropped above.
    let capabilities = capabilities && restricted.no_new_privs;
    Ok(status_of(
        applied,
        landlock_abi,
        Tcp {
            any_connect: args.any_tcp,
            any_bind: args.any_tcp_bind,
        },
        capabilities,
    ))
}

/// Which TCP walls were left open on purpose.
#[derive(Clone, Copy, Default)]
struct Tcp {
    any_connect: bool,
    any_bind: bool,
}

/// What a ruleset `applied` (or not) at `landlock_abi` enforces.
fn status_of(applied: bool, landlock_abi: u32, tcp: Tcp, capabilities: bool) -> SandboxStatus {
    let files = applied && landlock_abi >= 1;
    let mut status = SandboxStatus::default();
    status.landlock_abi = landlock_abi;
    // Below ABI 3 (Linux 6.2) truncating a file is not a right Landlock controls: any file
    // the worker may read could be emptied. The walls are up, but not all of them.
    status.filesystem = files && landlock_abi >= 3;
    status.tcp_connect = files && !tcp.any_connect && landlock_abi >= 4;
    status.tcp_bind = files && !tcp.any_bind && landlock_abi >= 4;
    status.signals = files && landlock_abi >= 6;
    status.abstract_unix_sockets = files && landlock_abi >= 6;
    status.capabilities = capabilities;
    status
}

/// Adds `path` with `access` (only the rights a file can have when it is not a directory);
/// a path that does not exist is skipped, and one that cannot be read (permissions, a link
/// loop) is skipped saying so on stderr (the worker's log), since a skipped root is a wall
/// the process will run into.
fn add_path(
    created: landlock::RulesetCreated,
    path: &Path,
    access: BitFlags<AccessFs>,
) -> Result<landlock::RulesetCreated> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(created),
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr().lock(),
                "copilot-pool sandbox-exec: not granting {} ({e}): the process cannot reach it",
                path.display()
            );
            return Ok(created);
        }
    };
    let access = if meta.is_dir() {
        access
    } else {
        access & AccessFs::from_file(RULES_ABI)
    };
    let fd = PathFd::new(path).with_context(|| format!("opening {}", path.display()))?;
    created
        .add_rule(PathBeneath::new(fd, access))
        .with_context(|| format!("allowing {}", path.display()))
}

/// Adds the agent's directory `path` with `access`, granted through the one descriptor
/// that was checked: opened (links followed, as a path would be), then refused unless the
/// kernel's name of what was opened is `path` itself. A link planted in its place, or on the
/// way to it, would name another directory (another agent's): the worker is not started.
fn add_agent_dir(
    created: landlock::RulesetCreated,
    path: &Path,
    access: BitFlags<AccessFs>,
) -> Result<landlock::RulesetCreated> {
    use nix::fcntl::{OFlag, open};
    use nix::sys::stat::Mode;
    let fd = open(
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| {
        format!(
            "opening the agent's directory {}: it must be a directory",
            path.display()
        )
    })?;
    let named = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .with_context(|| format!("reading back the agent's directory {}", path.display()))?;
    if named != path {
        bail!(
            "the agent's directory {} is not the directory the pool checked: it leads to {} \
             (a link in its place or on the way to it, which the agent's processes may \
             have planted); refusing to start the process. Remove the link and let the \
             directory be a plain one",
            path.display(),
            named.display()
        );
    }
    created
        .add_rule(PathBeneath::new(fd, access))
        .with_context(|| format!("allowing {}", path.display()))
}

/// Clears every capability set (the bounding set too when this process may, which root
/// may), so nothing the runtime execs gets a capability back. True when none is left that
/// an exec could grant.
fn drop_capabilities() -> Result<bool> {
    use caps::{CapSet, Capability};
    let effective = caps::read(None, CapSet::Effective).context("reading capabilities")?;
    if effective.contains(&Capability::CAP_SETPCAP) {
        caps::clear(None, CapSet::Bounding).context("clearing the bounding set")?;
    }
    // Ambient capabilities need Linux 4.3; without them there is nothing to clear.
    let _ = caps::clear(None, CapSet::Ambient);
    for set in [CapSet::Inheritable, CapSet::Effective, CapSet::Permitted] {
        caps::clear(None, set).with_context(|| format!("clearing the {set:?} set"))?;
    }
    let permitted = caps::read(None, CapSet::Permitted).context("reading capabilities")?;
    let root = nix::unistd::getuid().is_root() || nix::unistd::geteuid().is_root();
    // A root exec would refill the permitted set from the bounding set (without no_new_privs
    // file capabilities do the same for anyone; Landlock sets no_new_privs).
    let bounding = caps::read(None, CapSet::Bounding).context("reading capabilities")?;
    Ok(permitted.is_empty() && (!root || bounding.is_empty()))
}

/// Runs `<exe> sandbox-exec --probe <rules of template> -- /bin/true` (the wrapper as the
/// workers run it, with the template's rules) and returns what it enforced, within 10 s.
pub async fn probe(template: &Sandbox) -> Result<SandboxStatus> {
    let (program, mut argv) = template.command(Path::new("/bin/true"), &[]);
    // `--probe` goes before the rules' `--`.
    let at = argv
        .iter()
        .position(|a| a == SUBCOMMAND)
        .map(|i| i + 1)
        .unwrap_or(0);
    argv.insert(at, "--probe".into());
    let mut command = tokio::process::Command::new(&program);
    command
        .args(&argv)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let leader = GroupLeader::spawn(command)
        .with_context(|| format!("starting the sandbox probe {}", program.display()))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let output = leader
        .output_until(deadline, Duration::from_secs(2))
        .await
        .context("the sandbox probe did not finish within 10 s")?
        .context("running the sandbox probe")?;
    if !output.status.success() {
        bail!(
            "the sandbox probe failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "reading the sandbox probe's answer {:?}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// The sandbox a daemon's workers run in, in `mode`: `None` when off. The wrapper is this
/// executable (`/proc/self/exe`, resolved now: the daemon's file may be replaced later).
pub fn template(
    mode: SandboxMode,
    read_write: &[PathBuf],
    read_only: &[PathBuf],
    tcp_connect: &[u16],
    tcp_bind: Option<&[u16]>,
    never_connect: &[u16],
) -> Result<Option<Sandbox>> {
    if mode == SandboxMode::Off {
        return Ok(None);
    }
    let exe = std::env::current_exe().context("finding this executable for sandbox-exec")?;
    let mut sandbox = Sandbox::new(exe, vec![SUBCOMMAND.into()]);
    sandbox.required = mode == SandboxMode::Required;
    sandbox.read_write.extend(read_write.iter().cloned());
    sandbox.read_only.extend(read_only.iter().cloned());
    sandbox.tcp_connect = Some(tcp_connect.to_vec());
    sandbox.tcp_bind = tcp_bind.map(<[u16]>::to_vec);
    sandbox.never_connect = never_connect.to_vec();
    Ok(Some(sandbox))
}

/// Refuses to start when the daemon's state, the agents' homes, the transcripts, the API
/// token's file, or a config file holding the token (`config_file`, judged by its own text:
/// loading it also fills the token from the environment) lie where every sandboxed agent
/// may read them, the `runtime`'s install and the configured CLI backends' included (added
/// to their processes at each spawn). `serve` and `doctor` run it; a place whose default
/// cannot be found (no home) is left to the checks that report that.
pub fn refuse_shared_daemon_places(
    template: &Sandbox,
    runtime: Option<&Path>,
    config: &ServeConfig,
    config_file: Option<&Path>,
    api_token_file: Option<&Path>,
) -> Result<()> {
    let state_dir = config.state_dir().ok();
    let agents_dir = config.agents_dir().ok();
    let mut places: Vec<(&str, &Path)> = Vec::new();
    if let Some(dir) = &state_dir {
        places.push(("state_dir", dir));
    }
    if let Some(dir) = &agents_dir {
        places.push(("agents_dir", dir));
    }
    if let Some(dir) = &config.turns.transcript_dir {
        places.push(("turns.transcript_dir", dir));
    }
    if let Some(file) = api_token_file {
        places.push(("api_token_file", file));
    }
    let token_in_file = config_file.is_some_and(|path| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| toml::from_str::<ServeConfig>(&text).ok())
            .and_then(|file| file.api_token)
            .is_some_and(|token| !token.expose().is_empty())
    });
    if token_in_file && let Some(file) = config_file {
        places.push(("the config file (it holds api_token)", file));
    }
    let mut template = template.clone();
    if let Some(runtime) = runtime {
        template
            .read_exec
            .push(copilot_pool::sandbox::install_root(runtime));
    }
    let path_var = std::env::var_os("PATH");
    for (id, table) in &config.backends {
        let Ok(backend) = crate::config::cli_backend(id, table) else {
            continue;
        };
        // What a run may be granted (`Sandbox::cli_command`): the first of `args`, or of
        // `resumeArgs` on a resume, as a script.
        let child_path = backend.child_path_var(path_var.as_deref());
        let resume = backend.resume_args.as_deref().unwrap_or_default();
        for list in [&backend.args[..], resume] {
            let args: Vec<OsString> = list.iter().map(OsString::from).collect();
            template
                .read_exec
                .extend(copilot_pool::sandbox::cli_install_roots(
                    Path::new(&backend.command),
                    &args,
                    child_path.as_deref(),
                ));
        }
    }
    refuse_shared_places(&template, &places)
}

/// Refuses what the daemon keeps from its agents when it lies where every sandboxed worker
/// may read it: `places` (a name for the message, and the path) under a system directory,
/// `sandbox_read_paths` or `allowed_work_roots` of `template`, both sides resolved.
pub fn refuse_shared_places(template: &Sandbox, places: &[(&str, &Path)]) -> Result<()> {
    let mut resolved = template.clone();
    for list in [
        &mut resolved.read_exec,
        &mut resolved.read_only,
        &mut resolved.devices,
        &mut resolved.read_write,
    ] {
        for root in list.iter_mut() {
            *root = resolve_existing_part(root);
        }
    }
    for (name, path) in places {
        let place = resolve_existing_part(path);
        if let Some(root) = resolved.shared_root_of(&place) {
            bail!(
                "{name} {} lies under {}, which every sandboxed agent may read (a system \
                 directory, an install of the runtime or a CLI backend, sandbox_read_paths or \
                 allowed_work_roots): put it outside that root (the defaults live under \
                 $COPILOT_POOL_HOME; the API token belongs in a file such as \
                 /run/copilot-pool/api-token given with --api-token-file), or take the root out \
                 of sandbox_read_paths or allowed_work_roots",
                place.display(),
                root.display()
            );
        }
    }
    Ok(())
}

/// `path` made absolute with its longest existing part resolved (links, `..`), the rest
/// appended with its `..` taken back lexically (as creating it would): a place not created
/// yet is judged by where it will be.
fn resolve_existing_part(path: &Path) -> PathBuf {
    use std::path::Component;
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let components: Vec<Component> = absolute.components().collect();
    for split in (1..=components.len()).rev() {
        let existing: PathBuf = components[..split].iter().collect();
        let Ok(mut resolved) = existing.canonicalize() else {
            continue;
        };
        for component in &components[split..] {
            match component {
                Component::ParentDir => {
                    resolved.pop();
                }
                Component::Normal(name) => resolved.push(name),
                _ => {}
            }
        }
        return resolved;
    }
    absolute
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SandboxExecArgs,
    }

    #[test]
    fn what_each_landlock_abi_enforces_and_file_walls_need_truncation_rights() {
        let at = |abi| status_of(true, abi, Tcp::default(), true);
        // ABI 1-2: files written, created and removed are confined, truncation is not.
        assert!(!at(1).filesystem && !at(2).filesystem);
        assert!(at(3).filesystem && !at(3).tcp_connect);
        assert!(at(4).tcp_connect && at(4).tcp_bind && !at(4).signals);
        assert!(!at(3).tcp_bind);
        assert!(at(6).signals && at(6).abstract_unix_sockets);
        let any = |any_connect, any_bind| {
            status_of(
                true,
                6,
                Tcp {
                    any_connect,
                    any_bind,
                },
                true,
            )
        };
        assert!(!any(true, false).tcp_connect && any(true, false).tcp_bind);
        assert!(any(false, true).tcp_connect && !any(false, true).tcp_bind);
        let none = status_of(false, 6, Tcp::default(), false);
        assert!(!none.filesystem && !none.tcp_connect && !none.signals && !none.capabilities);
    }

    #[test]
    fn a_place_not_made_yet_is_judged_by_where_it_will_be() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().canonicalize().expect("resolve");
        std::fs::create_dir(root.join("real")).expect("mkdir");
        std::os::unix::fs::symlink(root.join("real"), root.join("link")).expect("link");
        assert_eq!(
            resolve_existing_part(&root.join("link/new/state")),
            root.join("real/new/state")
        );
        assert_eq!(
            resolve_existing_part(&root.join("missing/a/../../opt/x")),
            root.join("opt/x")
        );
        assert_eq!(resolve_existing_part(&root.join("link")), root.join("real"));
    }

    #[test]
    fn the_wrapper_reads_the_argv_the_library_writes() {
        let mut sandbox = Sandbox::new("/x/copilot-pool".into(), vec![SUBCOMMAND.into()]);
        sandbox.read_write = vec!["/a/agent".into()];
        sandbox.tcp_connect = Some(vec![443, 9000]);
        sandbox.tcp_bind = Some(vec![5173]);
        sandbox.required = true;
        let (_, argv) = sandbox.command(Path::new("/rt/copilot"), &["--stdio".into()]);
        let cli = Cli::try_parse_from(argv).expect("the wrapper parses the library's argv");
        let args = cli.args;
        assert!(args.required && !args.any_tcp && !args.probe);
        assert_eq!(args.read_write, [PathBuf::from("/a/agent")]);
        assert!(args.agent_dirs.is_empty());
        sandbox.home = Some("/a/agent".into());
        let (_, argv) = sandbox.command(Path::new("/rt/copilot"), &["--stdio".into()]);
        let args = Cli::try_parse_from(argv).expect("parsed").args;
        assert_eq!(args.agent_dirs, [PathBuf::from("/a/agent")]);
        assert!(args.read_write.is_empty());
        assert!(args.read_exec.contains(&PathBuf::from("/usr")));
        assert!(args.read_exec.contains(&PathBuf::from("/rt")));
        assert!(args.read_only.contains(&PathBuf::from("/etc")));
        assert!(args.devices.contains(&PathBuf::from("/dev/null")));
        assert!(args.proc_files.contains(&PathBuf::from("/proc/stat")));
        assert_eq!(args.tcp_connect, [443, 9000]);
        assert_eq!(args.tcp_bind, [5173]);
        assert!(!args.any_tcp_bind);
        assert_eq!(args.command, ["/rt/copilot", "--stdio"].map(OsString::from));
        for flag in Sandbox::SANDBOX_ARGS {
            assert!(
                Cli::try_parse_from(["sandbox-exec", flag, "1", "--", "/bin/true"]).is_ok()
                    || Cli::try_parse_from(["sandbox-exec", flag, "--", "/bin/true"]).is_ok(),
                "{flag}"
            );
        }
    }

    #[test]
    fn a_required_sandbox_counts_tcp_only_when_it_was_to_be_restricted() {
        let mut status = SandboxStatus::default();
        status.landlock_abi = 3;
        status.filesystem = true;
        status.capabilities = true;
        let mut args = SandboxExecArgs::default();
        assert_eq!(
            wanted_missing(&args, &status),
            [
                SandboxRule::TcpConnect,
                SandboxRule::TcpBind,
                SandboxRule::Signals,
                SandboxRule::AbstractUnixSockets
            ]
        );
        args.any_tcp = true;
        assert_eq!(
            wanted_missing(&args, &status),
            [
                SandboxRule::TcpBind,
                SandboxRule::Signals,
                SandboxRule::AbstractUnixSockets
            ]
        );
        args.any_tcp_bind = true;
        assert_eq!(
            wanted_missing(&args, &status),
            [SandboxRule::Signals, SandboxRule::AbstractUnixSockets]
        );
        // The daemon's view of the same: `sandbox_tcp_bind = "any"` is asked for, not missing
        // (else `required` refused to start with it).
        let mut template = Sandbox::new("/x/copilot-pool".into(), vec![SUBCOMMAND.into()]);
        status.landlock_abi = 6;
        status.tcp_connect = true;
        status.signals = true;
        status.abstract_unix_sockets = true;
        assert_eq!(unmet_by(&template, &status), [SandboxRule::TcpBind]);
        template.tcp_bind = None;
        assert!(unmet_by(&template, &status).is_empty());
    }
}

#[cfg(test)]
mod shared_places_tests {
    use super::*;

    #[test]
    fn a_script_first_in_a_backends_resume_args_counts_as_an_install_every_agent_reads() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        // The daemon's state lies beside a script a backend runs on a resume only.
        let tools = root.join("tools");
        std::fs::create_dir_all(tools.join("state")).unwrap();
        std::fs::write(tools.join("resume.js"), "").unwrap();
        let config = |resume: &str| -> ServeConfig {
            toml::from_str(&format!(
                "state_dir = {:?}\nagents_dir = {:?}\n[backends.my-cli]\nkind = \"cli-oneshot\"\n\
                 command = \"/bin/sh\"\nargs = [\"-c\", \"true\"]\n\
                 resumeArgs = [{resume:?}, \"{{sessionId}}\"]\n",
                tools.join("state").display().to_string(),
                root.join("agents").display().to_string(),
            ))
            .unwrap()
        };
        for (id, table) in &config("/x").backends {
            crate::config::cli_backend(id, table).expect("a valid backend");
        }
        let template = Sandbox::new("/x/copilot-pool".into(), vec![SUBCOMMAND.into()]);
        let refused = refuse_shared_daemon_places(
            &template,
            None,
            &config(&tools.join("resume.js").display().to_string()),
            None,
            None,
        )
        .expect_err("the state lies in the resume script's install");
        assert!(refused.to_string().contains("state_dir"), "{refused:#}");
        refuse_shared_daemon_places(&template, None, &config("-c"), None, None)
            .expect("no script: nothing granted there");
    }
}
