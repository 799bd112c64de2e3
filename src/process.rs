//! Children in their own process groups: the one guard that signals and kills a group
//! ([`ProcessGroup`]), a long-lived child with its stderr tail and exit watch
//! ([`ChildGroup`]), and a short-lived command run to its end by a deadline ([`GroupLeader`]).
//!
//! A [`ChildGroup`]'s and a [`GroupLeader`]'s leader also die with the daemon: they are
//! started with a parent-death signal (SIGKILL, `PR_SET_PDEATHSIG`), so a `kill -9` of the
//! daemon takes every runtime and installer process it started with it (their own
//! children are not signalled: a runtime's are found by the group ledger after a restart).
//! The kernel sends that signal when the *thread* that forked the child exits, not the
//! process: a tokio worker thread can become a blocking-pool thread (`block_in_place`) and
//! end after its idle keep-alive, so every such child is forked from one spawner thread
//! that lives as long as the process ([`spawn_on_spawner_thread`]).
//!
//! This module does not speak JSON-RPC and does not know what program it runs. Its
//! invariants: a group is never signalled after its leader was reaped (its id could belong to
//! a new group by then); dropping a [`ProcessGroup`] (and so a [`ChildGroup`] or a
//! [`GroupLeader`]) kills the group; a [`ChildGroup`]'s group dies with its leader (when the
//! leader exits, the rest of the group is killed before the leader is reaped, while the group
//! id is still reserved by the zombie leader); the leader is always reaped.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::process::{ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::watch;
use tokio::time::Instant;

/// Bytes of stderr kept per child (the most recent ones).
pub const STDERR_TAIL_BYTES: usize = 64 * 1024;

/// How long a child's stderr is still read after its leader was reaped: what the group wrote
/// is in the pipe by then, and a process that left the group (`setsid`) would otherwise hold
/// the pipe, and its reader, open as long as it lives.
const STDERR_READ_AFTER_EXIT: Duration = Duration::from_secs(1);

/// What to run. Its `Debug` names the environment's variables, never their values (the
/// runtime's token and a CLI's API key are among them).
#[derive(Clone)]
pub struct ChildSpec {
    /// Executable.
    pub program: PathBuf,
    /// Arguments.
    pub args: Vec<OsString>,
    /// The complete environment (nothing is inherited).
    pub env: Vec<(OsString, OsString)>,
    /// Working directory.
    pub cwd: PathBuf,
}

impl std::fmt::Debug for ChildSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<_> = self.env.iter().map(|(name, _)| name).collect();
        f.debug_struct("ChildSpec")
            .field("program", &self.program)
            .field("args", &self.args)
            .field("env (names only)", &names)
            .field("cwd", &self.cwd)
            .finish()
    }
}

/// Why a child could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The OS refused to start the program.
    #[error("cannot start {program}: {source}")]
    Start {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// A pipe was not set up (should not happen with piped stdio).
    #[error("child {0} has no {1} pipe")]
    MissingPipe(u32, &'static str),
}

impl SpawnError {
    /// True when the OS refused for lack of a resource (EMFILE, ENFILE, EAGAIN, ENOMEM),
    /// not because of the program.
    pub fn is_resource_exhaustion(&self) -> bool {
        match self {
            SpawnError::Start { source, .. } => is_resource_exhaustion(source),
            SpawnError::MissingPipe(..) => false,
        }
    }
}

/// True for the OS errors that mean "out of file descriptors, processes or memory".
pub fn is_resource_exhaustion(error: &std::io::Error) -> bool {
    use nix::errno::Errno;
    error.raw_os_error().is_some_and(|code| {
        [Errno::EMFILE, Errno::ENFILE, Errno::EAGAIN, Errno::ENOMEM]
            .iter()
            .any(|e| *e as i32 == code)
    })
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitInfo {
    /// Exited with a status code.
    Code(i32),
    /// Killed by a signal.
    Signal(i32),
    /// The status could not be read.
    Unknown,
}

impl ExitInfo {
    fn from_status(status: ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => ExitInfo::Code(code),
            (None, Some(sig)) => ExitInfo::Signal(sig),
            _ => ExitInfo::Unknown,
        }
    }
}

impl fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitInfo::Code(code) => write!(f, "exit code {code}"),
            ExitInfo::Signal(sig) => match Signal::try_from(*sig) {
                Ok(s) => write!(f, "signal {sig} ({})", s.as_str()),
                Err(_) => write!(f, "signal {sig}"),
            },
            ExitInfo::Unknown => f.write_str("unknown exit status"),
        }
    }
}

/// The last [`STDERR_TAIL_BYTES`] of a child's stderr.
#[derive(Clone, Default)]
pub struct StderrTail {
    buf: Arc<Mutex<VecDeque<u8>>>,
    /// Total bytes ever received; changes on every chunk.
    received: Arc<watch::Sender<usize>>,
    done: Arc<watch::Sender<bool>>,
}

impl fmt::Debug for StderrTail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StderrTail").finish_non_exhaustive()
    }
}

impl StderrTail {
    fn push(&self, bytes: &[u8]) {
        if let Ok(mut buf) = self.buf.lock() {
            buf.extend(bytes);
            let excess = buf.len().saturating_sub(STDERR_TAIL_BYTES);
            buf.drain(..excess);
        }
        self.received.send_modify(|n| *n += bytes.len());
    }

    /// Waits until the kept text contains `needle`, at most `limit`. Returns whether it did.
    pub async fn wait_for_text(&self, needle: &str, limit: Duration) -> bool {
        let mut rx = self.received.subscribe();
        let found = rx.wait_for(|_| self.text().contains(needle));
        matches!(tokio::time::timeout(limit, found).await, Ok(Ok(_)))
    }

    /// The kept bytes as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        match self.buf.lock() {
            Ok(buf) => {
                let (a, b) = buf.as_slices();
                let mut v = Vec::with_capacity(buf.len());
                v.extend_from_slice(a);
                v.extend_from_slice(b);
                String::from_utf8_lossy(&v).into_owned()
            }
            Err(_) => String::new(),
        }
    }

    /// Waits until stderr is read to its end (end of file, or a second after the leader was
    /// reaped), at most `limit`. Returns whether it was.
    pub async fn settled(&self, limit: Duration) -> bool {
        let mut rx = self.done.subscribe();
        matches!(
            tokio::time::timeout(limit, rx.wait_for(|done| *done)).await,
            Ok(Ok(_))
        )
    }
}

/// The pipes of a child for the protocol: we write its stdin and read its stdout.
#[derive(Debug)]
pub struct ChildIo {
    /// The child's stdin.
    pub stdin: ChildStdin,
    /// The child's stdout.
    pub stdout: ChildStdout,
}

/// The kill switch of one process group whose leader we spawned (with `process_group(0)`, or `setsid` for a `ChildGroup`,
/// so the group id is the leader's pid).
///
/// Signals reach every member of the group while its leader is unreaped: an exited but
/// unreaped leader (a zombie) keeps the id reserved. Once whoever reaps the leader has said so
/// ([`ProcessGroup::leader_reaped`] or [`GroupReaper::reaped`]), the id may belong to another
/// group and is never signalled again. Dropping the guard SIGKILLs the group.
#[derive(Debug)]
pub struct ProcessGroup {
    /// The group id until the leader is reaped; signalling happens under this lock, so a
    /// reaper that clears it first never races a signal.
    id: Arc<Mutex<Option<Pid>>>,
}

impl ProcessGroup {
    /// The guard of the group led by `leader_pid` (which must not have been reaped yet).
    /// A pid that cannot lead a child's group (0, which would mean our own group, or one out
    /// of range) gives a guard that never signals.
    pub fn of_leader(leader_pid: u32) -> Self {
        let id = i32::try_from(leader_pid)
            .ok()
            .filter(|pid| *pid > 1)
            .map(Pid::from_raw);
        ProcessGroup {
            id: Arc::new(Mutex::new(id)),
        }
    }

    /// Sends `signal` to every process of the group, unless its leader was reaped. Returns
    /// whether the signal was sent; errors (the group is gone) count as not sent.
    pub fn signal(&self, signal: Signal) -> bool {
        signal_group(&self.id, signal)
    }

    /// SIGKILLs the whole group, unless its leader was reaped.
    pub fn kill(&self) {
        self.signal(Signal::SIGKILL);
    }

    /// Records that the leader has been reaped (or may have been): the group is never
    /// signalled again.
    pub fn leader_reaped(&self) {
        forget(&self.id);
    }

    /// The handle for the task that reaps the leader (it does not kill on drop).
    pub fn reaper(&self) -> GroupReaper {
        GroupReaper {
            id: Arc::clone(&self.id),
        }
    }

    /// Ends the group: SIGTERM to the group, up to `grace` for `exited` (the leader's exit)
    /// to complete, then SIGKILL to the group and the rest of `exited`.
    pub async fn terminate<T>(&self, grace: Duration, exited: impl Future<Output = T>) -> T {
        let mut exited = std::pin::pin!(exited);
        self.signal(Signal::SIGTERM);
        match tokio::time::timeout(grace, &mut exited).await {
            Ok(done) => done,
            Err(_) => {
                tracing::debug!(group = ?self.id(), ?grace, "Child ignored SIGTERM; killing its group.");
                self.kill();
                exited.await
            }
        }
    }

    fn id(&self) -> Option<Pid> {
        *self.id.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // Synchronous and cheap: the group dies now; whoever owns the leader reaps it.
        self.kill();
    }
}

/// The side of a [`ProcessGroup`] held by the task that reaps its leader.
#[derive(Debug)]
pub struct GroupReaper {
    id: Arc<Mutex<Option<Pid>>>,
}

impl GroupReaper {
    /// SIGKILLs the group once its leader has exited and before it is reaped (the zombie
    /// still reserves the id), then forgets the id: the group dies with its leader.
    pub fn sweep_exited(&self) {
        let mut id = self.id.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(group) = id.take() {
            let _ = killpg(group, Signal::SIGKILL);
        }
    }

    /// Records that the leader has been reaped: the group is never signalled again.
    pub fn reaped(self) {
        forget(&self.id);
    }
}

fn signal_group(id: &Mutex<Option<Pid>>, signal: Signal) -> bool {
    let id = id.lock().unwrap_or_else(PoisonError::into_inner);
    match *id {
        Some(group) => match killpg(group, signal) {
            Ok(()) => true,
            Err(nix::errno::Errno::ESRCH) => false,
            Err(error) => {
                tracing::warn!(%group, %error, "Could not signal a process group.");
                false
            }
        },
        None => false,
    }
}

fn forget(id: &Mutex<Option<Pid>>) {
    *id.lock().unwrap_or_else(PoisonError::into_inner) = None;
}

/// A short-lived child that leads its own process group (spawned with `process_group(0)`),
/// for commands run to their end, such as an installer. Dropping it kills the group. Like a
/// [`ChildGroup`]'s leader it gets SIGKILL when the daemon dies (forked from the spawner
/// thread with a parent-death signal), so an installer does not run on into a cache that the
/// next daemon's installer then writes too; what the leader itself started is not signalled
/// (npm runs with `--ignore-scripts`).
#[derive(Debug)]
pub struct GroupLeader {
    /// Dropped first (fields drop in order): the group is killed while its leader, if it
    /// exited, is still an unreaped zombie holding the group's id; the `Child`'s drop then
    /// reaps it. The other way round, a leader reaped by that drop freed the id before the
    /// group's kill signalled it.
    group: ProcessGroup,
    child: Child,
    /// Resolves when the leader has exited, before it is reaped.
    exited: Option<tokio::sync::oneshot::Receiver<()>>,
}

/// A [`GroupLeader`] did not finish by its deadline; its group was killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the command did not finish by its deadline; its process group was killed")]
pub struct PastDeadline;

impl GroupLeader {
    /// Starts `command` as the leader of a new process group (killed with it on drop, and
    /// when this process dies). Must be called inside a tokio runtime.
    pub fn spawn(mut command: Command) -> std::io::Result<Self> {
        command.process_group(0).kill_on_drop(true);
        dying_with_parent(&mut command);
        let child = spawn_on_spawner_thread(command)?;
        // `id` is `None` only once the child was reaped (then there is no group to signal).
        let pid = child.id().unwrap_or(0);
        // A group of its own, in our session: nothing of its session to sweep.
        let exited = watched_or_killed(pid, exited_unreaped(pid, false))?;
        let group = ProcessGroup::of_leader(pid);
        Ok(GroupLeader {
            child,
            group,
            exited: Some(exited),
        })
    }

    /// The leader's pid (its group id), until it is reaped.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The group's guard.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Takes the leader's piped standard input (`None` if it was not piped or is taken).
    pub fn take_stdin(&mut self) -> Option<tokio::process::ChildStdin> {
        self.child.stdin.take()
    }

    /// Takes the leader's piped standard output (`None` if it was not piped or is taken).
    pub fn take_stdout(&mut self) -> Option<tokio::process::ChildStdout> {
        self.child.stdout.take()
    }

    /// Waits for the leader to exit, kills what is left of its group (a leftover would keep
    /// the output pipes open and outlive the command), and reaps it (cancel-safe). After
    /// this returns, the group is never signalled.
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(exited) = self.exited.as_mut() {
            let _ = exited.await;
            self.exited = None;
            // The leader is a zombie: its group id cannot have been reused yet.
            self.group.kill();
        }
        let status = self.child.wait().await;
        // On success the leader was reaped; on error it cannot be known not to have been, so
        // the id is given up either way.
        self.group.leader_reaped();
        status
    }

    /// Reads stdout and stderr (when piped) to their ends while waiting for the exit, until
    /// `deadline`. Past it, kills the group, waits up to `reap` for the leader, and returns
    /// [`PastDeadline`].
    pub async fn output_until(
        mut self,
        deadline: Instant,
        reap: Duration,
    ) -> Result<std::io::Result<Output>, PastDeadline> {
        let stdout = self.child.stdout.take();
        let stderr = self.child.stderr.take();
        // Reading both pipes while waiting keeps the child from blocking on a full pipe.
        let finished = tokio::time::timeout_at(deadline, async {
            tokio::join!(self.wait(), read_all(stdout), read_all(stderr))
        })
        .await;
        match finished {
            Ok((status, stdout, stderr)) => Ok(status.map(|status| Output {
                status,
                stdout,
                stderr,
            })),
            Err(_) => {
                self.group.kill();
                let _ = tokio::time::timeout(reap, self.wait()).await;
                Err(PastDeadline)
            }
        }
    }
}

/// The fields of `/proc/<pid>/stat` the pool reads (the group ledger, the session sweep).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    pub(crate) state: char,
    pub(crate) pgrp: u32,
    pub(crate) sid: u32,
    pub(crate) start_time: u64,
}

pub(crate) fn parse_stat(text: &str) -> Option<Stat> {
    // The command name is in parentheses and may hold spaces: fields count from the last ')'.
    let rest = text.get(text.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state): field n is fields[n - 3].
    Some(Stat {
        state: fields.first()?.chars().next()?,
        pgrp: fields.get(2)?.parse().ok()?,
        sid: fields.get(3)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

pub(crate) fn read_stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Pids of the processes whose `/proc/<pid>/stat` `matches` (never this process). Reads
/// all of `/proc`: on a blocking or dedicated thread, never on an async one.
pub(crate) fn processes_where(matches: impl Fn(&Stat) -> bool) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id();
    dir.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me && read_stat(*pid).is_some_and(|stat| matches(&stat)))
        .collect()
}

/// SIGKILLs the processes of session `sid` (the session a [`ChildGroup`]'s leader made,
/// whose id is the leader's pid) that left its process group (a tool that ran `setpgid`,
/// as GNU `timeout` does): the group kill does not reach them. Called while the leader is
/// exited but not reaped, so the session id cannot have been handed out again; on the
/// exit-watch thread.
fn kill_session_leftovers(sid: u32) {
    for pid in processes_where(|stat| stat.sid == sid && stat.pgrp != sid) {
        if let Ok(raw) = i32::try_from(pid) {
            let _ = nix::sys::signal::kill(Pid::from_raw(raw), Signal::SIGKILL);
        }
    }
}

/// Resolves once `pid` (our child) has exited, without reaping it (`waitid` with WNOWAIT on
/// a small thread): the zombie keeps its process group id reserved, so the rest of the group
/// can be killed before the leader is reaped; with `own_session` (it made a session of its
/// own, as a [`ChildGroup`] does) what left its group but not its session is killed first
/// ([`kill_session_leftovers`]: a walk of `/proc`, so only where such a session exists).
/// `None` if no thread could be started ([`watched_or_killed`] then fails the spawn).
fn exited_unreaped(pid: u32, own_session: bool) -> Option<tokio::sync::oneshot::Receiver<()>> {
    let (exited_tx, exited_rx) = tokio::sync::oneshot::channel::<()>();
    let watch_pid = Pid::from_raw(i32::try_from(pid).ok()?);
    let watcher = std::thread::Builder::new()
        .name("copilot-pool-exit-watch".to_owned())
        .stack_size(64 * 1024)
        .spawn(move || {
            while let Err(nix::errno::Errno::EINTR) = waitid(
                Id::Pid(watch_pid),
                WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT,
            ) {}
            // The leader is a zombie (reaped only after this thread says so): what left its
            // group but not its session dies here; the group itself is swept next.
            if own_session {
                kill_session_leftovers(pid);
            }
            let _ = exited_tx.send(());
        });
    match watcher {
        Ok(_) => Some(exited_rx),
        Err(error) => {
            tracing::warn!(pid, %error, "No thread could be started to watch a new child's exit; the child is killed with its group and its start fails.");
            None
        }
    }
}

/// The watch of a new child's exit (`pid`, leading its group), or, when none could be
/// started (`None`: the host is out of threads), the group killed at once and an error
/// (`EAGAIN`, resource exhaustion): a child whose exit nobody watches would leave what its
/// group still ran unswept once it was reaped.
fn watched_or_killed(
    pid: u32,
    watched: Option<tokio::sync::oneshot::Receiver<()>>,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    if let Some(watched) = watched {
        return Ok(watched);
    }
    if let Ok(raw) = i32::try_from(pid)
        && raw > 1
    {
        let _ = killpg(Pid::from_raw(raw), Signal::SIGKILL);
    }
    Err(std::io::Error::from_raw_os_error(nix::libc::EAGAIN))
}

/// Reads a pipe to its end (what could be read, if reading fails).
async fn read_all(pipe: Option<impl AsyncRead + Unpin>) -> Vec<u8> {
    let mut bytes = Vec::new();
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_end(&mut bytes).await;
    }
    bytes
}

/// A running child that leads its own process group.
#[derive(Debug)]
pub struct ChildGroup {
    pid: u32,
    exit: watch::Receiver<Option<ExitInfo>>,
    stderr: StderrTail,
    /// Dropped with the `ChildGroup`: kills the group.
    group: ProcessGroup,
}

impl ChildGroup {
    /// Starts `spec` as the leader of a new process group, with piped stdio and exactly the
    /// given environment. Must be called inside a tokio runtime.
    pub fn spawn(spec: &ChildSpec) -> Result<(Self, ChildIo), SpawnError> {
        let (group, stdin, stdout) = Self::spawn_inner(spec, true)?;
        let stdin = stdin.ok_or(SpawnError::MissingPipe(group.pid, "stdin"))?;
        Ok((group, ChildIo { stdin, stdout }))
    }

    /// [`ChildGroup::spawn`] with stdin from `/dev/null` (for programs that block on an
    /// open stdin); only stdout is returned.
    pub fn spawn_null_stdin(spec: &ChildSpec) -> Result<(Self, ChildStdout), SpawnError> {
        let (group, _, stdout) = Self::spawn_inner(spec, false)?;
        Ok((group, stdout))
    }

    fn spawn_inner(
        spec: &ChildSpec,
        piped_stdin: bool,
    ) -> Result<(Self, Option<ChildStdin>, ChildStdout), SpawnError> {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env_clear()
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .env(RUN_MARKER_VAR, run_marker())
            .current_dir(&spec.cwd)
            .stdin(if piped_stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // Its own session (so its own group too): no controlling terminal, so nothing it
        // runs can open the daemon's `/dev/tty` (read it, or type into it with TIOCSTI).
        own_session_dying_with_parent(&mut cmd);
        let mut child = spawn_on_spawner_thread(cmd).map_err(|source| SpawnError::Start {
            program: spec.program.display().to_string(),
            source,
        })?;
        let Some(pid) = child.id() else {
            // Already reaped: cannot happen right after spawn.
            return Err(SpawnError::MissingPipe(0, "pid"));
        };
        let exited = watched_or_killed(pid, exited_unreaped(pid, true)).map_err(|source| {
            SpawnError::Start {
                program: spec.program.display().to_string(),
                source,
            }
        })?;
        let stdin = child.stdin.take();
        if piped_stdin && stdin.is_none() {
            return Err(SpawnError::MissingPipe(pid, "stdin"));
        }
        let stdout = child
            .stdout
            .take()
            .ok_or(SpawnError::MissingPipe(pid, "stdout"))?;
        let stderr_pipe = child
            .stderr
            .take()
            .ok_or(SpawnError::MissingPipe(pid, "stderr"))?;

        // From here on the group exists: the guard below kills it on any early return.
        let (exit_tx, exit_rx) = watch::channel(None);
        let group = ChildGroup {
            pid,
            exit: exit_rx,
            stderr: StderrTail::default(),
            group: ProcessGroup::of_leader(pid),
        };
        let reaper = group.group.reaper();

        let tail = group.stderr.clone();
        let mut reaped = group.exit.clone();
        tokio::spawn(async move {
            let mut pipe = stderr_pipe;
            let mut chunk = vec![0u8; 8192];
            let read_no_more = async {
                let _ = reaped.wait_for(|e| e.is_some()).await;
                tokio::time::sleep(STDERR_READ_AFTER_EXIT).await;
            };
            tokio::pin!(read_no_more);
            loop {
                tokio::select! {
                    read = pipe.read(&mut chunk) => match read {
                        Ok(0) | Err(_) => break,
                        Ok(n) => tail.push(&chunk[..n]),
                    },
                    () = &mut read_no_more => break,
                }
            }
            tail.done.send_replace(true);
        });

        // The reaper task, which owns the `Child`, sweeps the group once the leader has
        // exited (still unreaped), then reaps it and publishes the status once.
        tokio::spawn(async move {
            let _ = exited.await;
            // The leader is a zombie: the id cannot have been reused yet.
            reaper.sweep_exited();
            let info = match child.wait().await {
                Ok(status) => ExitInfo::from_status(status),
                Err(_) => ExitInfo::Unknown,
            };
            reaper.reaped();
            tracing::debug!(pid, exit = %info, "Child exited.");
            exit_tx.send_replace(Some(info));
        });

        Ok((group, stdin, stdout))
    }

    /// The leader's pid, which is also the process group id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The exit status, if the leader has exited and been reaped.
    pub fn exit_info(&self) -> Option<ExitInfo> {
        *self.exit.borrow()
    }

    /// A receiver that changes once, when the leader has been reaped.
    pub fn exit_watch(&self) -> watch::Receiver<Option<ExitInfo>> {
        self.exit.clone()
    }

    /// Waits for the leader to exit.
    pub async fn wait(&self) -> ExitInfo {
        let mut rx = self.exit.clone();
        match rx.wait_for(|e| e.is_some()).await {
            Ok(info) => info.unwrap_or(ExitInfo::Unknown),
            // The reaper task is gone (runtime shutting down): nothing more to learn.
            Err(_) => ExitInfo::Unknown,
        }
    }

    /// The kept tail of stderr.
    pub fn stderr(&self) -> &StderrTail {
        &self.stderr
    }

    /// Sends `signal` to every process of the group, unless the leader has already exited
    /// (the group was swept then, and once the leader is reaped its id may belong to someone
    /// else). Errors (the group is gone) are ignored.
    pub fn signal_group(&self, signal: Signal) {
        self.group.signal(signal);
    }

    /// Ends the group: SIGTERM to the group, up to `grace` for the leader to exit, then
    /// SIGKILL to the group. Members that outlive the leader are killed when it exits.
    /// Returns how the leader ended.
    pub async fn terminate(&self, grace: Duration) -> ExitInfo {
        self.group.terminate(grace, self.wait()).await
    }
}

/// Starts the child in a session of its own (`setsid`: the leader of a new session and
/// process group, with no controlling terminal) and makes it get SIGKILL when the thread that
/// forks it exits (`PR_SET_PDEATHSIG`; it survives `execve`, also through the sandbox
/// wrapper, which execs in place). Fork it with [`spawn_on_spawner_thread`], whose thread
/// lives as long as the process, so the signal means "the daemon is gone". A child whose
/// parent died before the `prctl` (the signal would never come) is not started.
fn own_session_dying_with_parent(cmd: &mut Command) {
    before_exec(cmd, true);
}

/// Makes the child get SIGKILL when the thread that forks it exits, as
/// [`own_session_dying_with_parent`] does, without a session of its own (for a
/// [`GroupLeader`], whose `process_group(0)` makes its group).
fn dying_with_parent(cmd: &mut Command) {
    before_exec(cmd, false);
}

#[allow(unsafe_code)]
fn before_exec(cmd: &mut Command, new_session: bool) {
    let parent = std::process::id();
    let set = move || -> std::io::Result<()> {
        if new_session {
            nix::unistd::setsid()
                .map_err(|errno| std::io::Error::from_raw_os_error(errno as i32))?;
        }
        nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)
            .map_err(|errno| std::io::Error::from_raw_os_error(errno as i32))?;
        // Reparented already: the parent died between the fork and the prctl.
        if nix::unistd::getppid().as_raw() as u32 != parent {
            return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe calls are allowed. It makes at most three system calls (setsid,
    // prctl, getppid) and builds an `io::Error` from a raw code (no allocation); it takes no
    // lock, touches no shared state and allocates nothing.
    unsafe {
        cmd.pre_exec(set);
    }
}

type SpawnJob = Box<dyn FnOnce() + Send>;

/// Runs `command.spawn()` on the process's spawner thread, which never exits, inside the
/// caller's tokio runtime (the child is reaped by that runtime). See the module docs for why.
/// Falls back to the calling thread only if the spawner thread cannot be started.
pub fn spawn_on_spawner_thread(mut command: Command) -> std::io::Result<Child> {
    static SPAWNER: std::sync::OnceLock<Option<Mutex<std::sync::mpsc::Sender<SpawnJob>>>> =
        std::sync::OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<SpawnJob>();
        let started = std::thread::Builder::new()
            .name("copilot-pool-spawner".to_owned())
            .spawn(move || {
                // Lives as long as the process: the senders sit in a static.
                while let Ok(job) = rx.recv() {
                    job();
                }
            });
        match started {
            Ok(_) => Some(Mutex::new(tx)),
            Err(error) => {
                tracing::warn!(%error, "No spawner thread; children are forked from the calling thread and may die when it exits.");
                None
            }
        }
    });
    let Some(spawner) = spawner else {
        return command.spawn();
    };
    let handle = tokio::runtime::Handle::try_current().map_err(|e| {
        std::io::Error::other(format!("spawning a child needs a tokio runtime: {e}"))
    })?;
    let (done_tx, done_rx) = std::sync::mpsc::sync_channel(1);
    let job: SpawnJob = Box::new(move || {
        let _runtime = handle.enter();
        let _ = done_tx.send(spawn_in_runtime(&mut command));
    });
    let sent = spawner
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .send(job);
    if sent.is_err() {
        return Err(std::io::Error::other("the spawner thread is gone"));
    }
    done_rx
        .recv()
        .map_err(|_| std::io::Error::other("the spawner thread dropped a spawn"))?
}

/// `command.spawn()` in the runtime entered, a panic turned into an error: the spawner thread
/// must never end (every child forked from it would die with it, and no spawn would work
/// after). Tokio panics when the runtime has no IO driver, once the child is forked, so that
/// is asked first, before anything is forked.
fn spawn_in_runtime(command: &mut Command) -> std::io::Result<Child> {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let no_io = || {
        std::io::Error::other(
            "spawning a child needs a tokio runtime with its IO driver: build the runtime \
             with `enable_all()` (or `enable_io()`), as `#[tokio::main]` does",
        )
    };
    // Registering a socket with the runtime is what the child's pipes will do.
    match catch_unwind(tokio::net::UnixStream::pair) {
        Ok(_) => {}
        Err(_) => return Err(no_io()),
    }
    catch_unwind(AssertUnwindSafe(|| command.spawn())).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(std::io::Error::other(format!(
            "spawning a child panicked: {what}"
        )))
    })
}

/// The variable every [`ChildGroup`] starts with, holding [`run_marker`]: what its tools
/// inherit too, so the group ledger of a later run can tell a survivor of this one from a
/// process that merely got a reused id.
pub const RUN_MARKER_VAR: &str = "COPILOT_POOL_RUN";

/// This process's marker (a random id made once), in every child's [`RUN_MARKER_VAR`].
pub fn run_marker() -> &'static str {
    static MARKER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MARKER.get_or_init(|| uuid::Uuid::new_v4().simple().to_string())
}

/// How much of a process's environment [`carries_run_marker`] reads.
const ENVIRON_READ_LIMIT: u64 = 1024 * 1024;

/// Whether process `pid` started with `RUN_MARKER_VAR=marker` in its environment (the first
/// MiB of `/proc/<pid>/environ`, which needs the process's own user or root). `false` when it
/// cannot be read, or for a zombie (whose environment reads empty).
pub(crate) fn carries_run_marker(pid: u32, marker: &str) -> bool {
    use std::io::Read;
    let mut environ = Vec::new();
    let read = std::fs::File::open(format!("/proc/{pid}/environ"))
        .and_then(|file| file.take(ENVIRON_READ_LIMIT).read_to_end(&mut environ));
    if read.is_err() || marker.is_empty() {
        return false;
    }
    let wanted = format!("{RUN_MARKER_VAR}={marker}");
    environ
        .split(|b| *b == 0)
        .any(|entry| entry == wanted.as_bytes())
}

/// Resident memory of a process (VmRSS), from /proc.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_specs_debug_names_its_variables_but_never_their_values() {
        let spec = ChildSpec {
            program: "/bin/rt".into(),
            args: vec!["--stdio".into()],
            env: vec![("COPILOT_POOL_MODEL_KEY".into(), "sk-do-not-print".into())],
            cwd: "/w".into(),
        };
        let shown = format!("{spec:?}");
        assert!(shown.contains("COPILOT_POOL_MODEL_KEY"), "{shown}");
        assert!(!shown.contains("sk-do-not-print"), "{shown}");
    }

    #[test]
    fn a_spawn_from_a_runtime_without_its_io_driver_is_refused_with_the_fix_and_spawns_go_on() {
        let no_io = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let refused = no_io.block_on(async {
            let mut command = Command::new("/bin/true");
            command.kill_on_drop(true);
            spawn_on_spawner_thread(command).map(|_| ())
        });
        let error = refused.expect_err("no IO driver");
        assert!(error.to_string().contains("enable_all()"), "{error}");
        // The spawner thread lives on: the next spawn works.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let status = runtime.block_on(async {
            spawn_on_spawner_thread(Command::new("/bin/true"))
                .expect("spawned")
                .wait()
                .await
        });
        assert!(status.unwrap().success());
    }

    #[tokio::test]
    async fn a_child_whose_exit_no_thread_can_watch_is_killed_with_its_group_and_fails_its_start() {
        let mut child = Command::new("/bin/sh")
            .args(["-c", "sleep 300 & echo $!; wait"])
            .process_group(0)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn");
        let pid = child.id().expect("pid");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        use tokio::io::AsyncBufReadExt;
        tokio::io::BufReader::new(stdout)
            .read_line(&mut line)
            .await
            .expect("the member's pid");
        let member: i32 = line.trim().parse().expect("a pid");
        let error = watched_or_killed(pid, None).expect_err("no watch");
        assert!(is_resource_exhaustion(&error), "{error}");
        use std::os::unix::process::ExitStatusExt;
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("the leader lives on")
            .expect("reaped");
        assert_eq!(status.signal(), Some(9), "the leader was killed");
        // The member went with the group (not our child: gone, or a zombie of init).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while read_stat(member as u32).is_some_and(|s| s.state != 'Z') {
            assert!(std::time::Instant::now() < deadline, "the member lives on");
            tokio::task::yield_now().await;
        }
    }

    fn sh(script: &str) -> ChildSpec {
        ChildSpec {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            cwd: std::env::temp_dir(),
        }
    }

    #[test]
    fn running_out_of_descriptors_processes_or_memory_is_resource_exhaustion_and_nothing_else_is() {
        use nix::errno::Errno;
        for errno in [Errno::EMFILE, Errno::ENFILE, Errno::EAGAIN, Errno::ENOMEM] {
            let error = SpawnError::Start {
                program: "copilot".into(),
                source: std::io::Error::from_raw_os_error(errno as i32),
            };
            assert!(error.is_resource_exhaustion(), "{errno}");
        }
        for errno in [Errno::ENOENT, Errno::EACCES, Errno::ENOEXEC] {
            let error = SpawnError::Start {
                program: "copilot".into(),
                source: std::io::Error::from_raw_os_error(errno as i32),
            };
            assert!(!error.is_resource_exhaustion(), "{errno}");
        }
        assert!(!SpawnError::MissingPipe(1, "stdin").is_resource_exhaustion());
    }

    /// Pids of the processes in process group `pgid` (a zombie not yet reaped included).
    pub(crate) fn group_members(pgid: u32) -> Vec<u32> {
        processes_where(|stat| stat.pgrp == pgid)
    }

    #[tokio::test]
    async fn a_child_leads_a_session_of_its_own_with_no_controlling_terminal() {
        let (child, _io) = ChildGroup::spawn(&sh("read line")).unwrap();
        let pid = child.pid();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        let rest = stat.rsplit_once(')').map(|(_, r)| r).expect("fields");
        // After the name: state, ppid, pgrp, session, tty_nr.
        let fields: Vec<&str> = rest.split_whitespace().collect();
        assert_eq!(fields[2], pid.to_string(), "its own group: {stat}");
        assert_eq!(fields[3], pid.to_string(), "its own session: {stat}");
        assert_eq!(fields[4], "0", "no controlling terminal: {stat}");
        child.signal_group(Signal::SIGKILL);
        let _ = child.wait().await;
    }

    #[tokio::test]
    async fn reports_exit_code_and_stderr_tail() {
        let (child, _io) = ChildGroup::spawn(&sh("echo oops >&2; exit 3")).unwrap();
        assert_eq!(child.wait().await, ExitInfo::Code(3));
        child.stderr().settled(Duration::from_secs(5)).await;
        assert_eq!(child.stderr().text(), "oops\n");
    }

    #[tokio::test]
    async fn a_process_that_left_the_group_does_not_keep_its_stderr_reader_open() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("escapee");
        // The escapee keeps the stderr pipe it inherited, in a session of its own; the
        // leader exits once it is there (before, the group's sweep would take it).
        let script = format!(
            "setsid sh -c 'echo $$ > {0}; exec sleep 60' & \
             until [ -s {0} ]; do sleep 0.01; done; echo left >&2; exit 0",
            pidfile.display()
        );
        let (child, _io) = ChildGroup::spawn(&sh(&script)).unwrap();
        assert_eq!(child.wait().await, ExitInfo::Code(0));
        let settled = child.stderr().settled(Duration::from_secs(20)).await;
        let escapee = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        if let Some(pid) = escapee {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        assert!(escapee.is_some(), "the escapee started");
        assert!(settled, "the reader ended while the escapee lived");
        assert_eq!(child.stderr().text(), "left\n");
    }

    #[tokio::test]
    async fn a_child_spawned_with_a_null_stdin_reads_end_of_file_at_once() {
        // `cat` on an open pipe would wait forever; on /dev/null it ends with nothing read.
        let (child, mut stdout) = ChildGroup::spawn_null_stdin(&sh("cat; echo read-all")).unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("cat saw end of file");
        assert_eq!(exit, ExitInfo::Code(0));
        let mut out = String::new();
        stdout.read_to_string(&mut out).await.unwrap();
        assert_eq!(out, "read-all\n");
    }

    #[tokio::test]
    async fn environment_is_exactly_the_given_one_and_the_run_marker() {
        let mut spec = sh("env >&2");
        spec.env.push(("ONLY_THIS".into(), "1".into()));
        let (child, _io) = ChildGroup::spawn(&spec).unwrap();
        child.wait().await;
        child.stderr().settled(Duration::from_secs(5)).await;
        let env = child.stderr().text();
        let mut names: Vec<&str> = env
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(n, _)| n)
            .collect();
        names.sort_unstable();
        // What `sh` sets itself besides.
        names.retain(|n| !matches!(*n, "PWD" | "SHLVL" | "_" | "OLDPWD"));
        assert_eq!(names, ["COPILOT_POOL_RUN", "ONLY_THIS", "PATH"], "{env}");
        assert!(
            env.contains(&format!("{RUN_MARKER_VAR}={}", run_marker())),
            "{env}"
        );
    }

    #[tokio::test]
    async fn stderr_tail_is_bounded() {
        let (child, _io) = ChildGroup::spawn(&sh(
            "head -c 200000 /dev/zero | tr '\\0' x >&2; echo END >&2",
        ))
        .unwrap();
        child.wait().await;
        child.stderr().settled(Duration::from_secs(5)).await;
        let text = child.stderr().text();
        assert_eq!(text.len(), STDERR_TAIL_BYTES);
        assert!(text.ends_with("xEND\n"));
    }

    #[tokio::test]
    async fn terminate_kills_the_whole_group_even_when_term_is_ignored() {
        // The leader ignores TERM; a grandchild sleeps in the same group.
        let (child, _io) = ChildGroup::spawn(&sh(
            "trap '' TERM; sleep 300 & echo started >&2; while :; do sleep 1; done",
        ))
        .unwrap();
        let pgid = child.pid();
        // Wait until the grandchild exists (the script reports it).
        assert!(
            child
                .stderr()
                .wait_for_text("started", Duration::from_secs(10))
                .await
        );
        assert!(group_members(pgid).len() >= 2);
        let info = child.terminate(Duration::from_millis(200)).await;
        assert_eq!(info, ExitInfo::Signal(9));
        assert_eq!(info.to_string(), "signal 9 (SIGKILL)");
        // The group is gone: no member left (zombies of the grandchild are init's to reap).
        let left = group_left_after(pgid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "left behind: {left:?}");
        // The leader itself was reaped by us: not even a zombie remains.
        assert!(!std::path::Path::new(&format!("/proc/{pgid}")).exists());
    }

    #[tokio::test]
    async fn what_left_the_group_but_not_the_session_dies_with_the_leader() {
        // GNU timeout puts itself (and the command it runs) in a process group of its own,
        // in the leader's session: the group kill does not reach it.
        let (child, _io) = ChildGroup::spawn(&sh(
            "timeout 300 sleep 300 & echo \"escaped $!\" >&2; while :; do sleep 1; done",
        ))
        .unwrap();
        let sid = child.pid();
        assert!(
            child
                .stderr()
                .wait_for_text("escaped", Duration::from_secs(10))
                .await
        );
        let escaped: u32 = child
            .stderr()
            .text()
            .split_whitespace()
            .nth(1)
            .and_then(|pid| pid.parse().ok())
            .expect("the escaped pid");
        let in_session = |pid: u32| read_stat(pid).is_some_and(|s| s.sid == sid && s.state != 'Z');
        // Its own group (timeout's setpgid), once it ran that far.
        let deadline = Instant::now() + Duration::from_secs(10);
        while read_stat(escaped).is_none_or(|s| s.pgrp != escaped) {
            assert!(Instant::now() < deadline, "timeout never left the group");
            tokio::task::yield_now().await;
        }
        child.terminate(Duration::from_millis(200)).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        while in_session(escaped) {
            assert!(
                Instant::now() < deadline,
                "a process that left the group outlived its session's leader"
            );
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn the_group_dies_with_its_leader() {
        let (child, _io) = ChildGroup::spawn(&sh("sleep 300 & exit 0")).unwrap();
        let pgid = child.pid();
        assert_eq!(child.wait().await, ExitInfo::Code(0));
        let left = group_left_after(pgid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "outlived the leader: {left:?}");
    }

    #[tokio::test]
    async fn drop_kills_the_group() {
        let (child, io) = ChildGroup::spawn(&sh("sleep 300 & sleep 300")).unwrap();
        let pgid = child.pid();
        let exit = child.exit_watch();
        drop(io);
        drop(child);
        let mut exit = exit;
        let info = exit.wait_for(|e| e.is_some()).await.unwrap().unwrap();
        assert_eq!(info, ExitInfo::Signal(9));
        let left = group_left_after(pgid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "left behind: {left:?}");
    }

    #[tokio::test]
    async fn a_child_outlives_the_thread_that_asked_for_it() {
        // PR_SET_PDEATHSIG fires when the forking thread exits: a child started from a thread
        // that ends (a blocking-pool thread, say) must not die with it, only with the process.
        let handle = tokio::runtime::Handle::current();
        let (child, tid) = std::thread::spawn(move || {
            let _runtime = handle.enter();
            let (child, io) = ChildGroup::spawn(&sh("exec sleep 300")).unwrap();
            (child, io, nix::unistd::gettid())
        })
        .join()
        .map(|(child, _io, tid)| (child, tid))
        .unwrap();
        // Once the thread's /proc entry is gone, its exit (and any parent-death signal) is done.
        let task = format!("/proc/self/task/{tid}");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::path::Path::new(&task).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "thread {tid} did not end"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let early = tokio::time::timeout(Duration::from_millis(300), child.wait()).await;
        assert!(early.is_err(), "the child died with its thread: {early:?}");
        child.signal_group(Signal::SIGKILL);
        assert_eq!(child.wait().await, ExitInfo::Signal(9));
    }

    /// The environment variable that makes [`a_group_leaders_helper_process`] run.
    const LEADER_HELPER: &str = "COPILOT_POOL_TEST_GROUP_LEADER_HELPER";

    /// Run by the test below in a process of its own (this test binary again): starts a
    /// [`GroupLeader`], prints its pid, then waits to be killed.
    #[test]
    #[ignore = "a helper that a_group_leader_dies_with_the_process_that_started_it runs"]
    fn a_group_leaders_helper_process() {
        if std::env::var_os(LEADER_HELPER).is_none() {
            return;
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let leader = GroupLeader::spawn(sh_command("exec sleep 300")).unwrap();
            println!("leader-pid={}", leader.pid().unwrap());
            std::future::pending::<()>().await;
        });
    }

    #[tokio::test]
    async fn a_group_leader_dies_with_the_process_that_started_it() {
        use tokio::io::AsyncBufReadExt;
        let mut helper = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "process::tests::a_group_leaders_helper_process",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(LEADER_HELPER, "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(helper.stdout.take().unwrap()).lines();
        let pid = loop {
            let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
                .await
                .expect("the helper prints its leader's pid")
                .unwrap()
                .expect("the helper prints its leader's pid before it ends");
            // After the test harness's own words on the same line.
            if let Some(pid) = line
                .split_once("leader-pid=")
                .and_then(|(_, pid)| pid.trim().parse::<u32>().ok())
            {
                break pid;
            }
        };
        assert!(!is_zombie(pid), "the leader runs while the helper does");
        helper.kill().await.unwrap();
        let left = group_left_after(pid, Duration::from_secs(5)).await;
        if !left.is_empty() {
            let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
        assert!(
            left.is_empty(),
            "outlived the process that started it: {left:?}"
        );
    }

    fn sh_command(script: &str) -> Command {
        let mut command = Command::new("/bin/sh");
        command
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    #[test]
    fn a_guard_without_a_child_group_id_never_signals_our_own_group() {
        // 0 would mean the caller's own group to killpg(2); SIGWINCH is harmless if sent.
        for pid in [0, 1, u32::MAX] {
            let group = ProcessGroup::of_leader(pid);
            assert!(!group.signal(Signal::SIGWINCH), "{pid}");
            group.leader_reaped();
        }
    }

    #[tokio::test]
    async fn a_group_leader_reports_its_status_and_both_outputs() {
        let leader = GroupLeader::spawn(sh_command("echo out; echo err >&2; exit 3")).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let output = leader
            .output_until(deadline, Duration::from_secs(5))
            .await
            .expect("finished before the deadline")
            .expect("reaped");
        assert_eq!(output.status.code(), Some(3));
        assert_eq!(output.stdout, b"out\n");
        assert_eq!(output.stderr, b"err\n");
    }

    #[tokio::test]
    async fn a_group_leader_past_its_deadline_is_killed_with_its_whole_group() {
        let mut command = sh_command("trap '' TERM; sleep 300 & echo started; sleep 300");
        command.stdout(Stdio::null());
        let leader = GroupLeader::spawn(command).unwrap();
        let pgid = leader.pid().unwrap();
        let started = std::time::Instant::now();
        let deadline = Instant::now() + Duration::from_millis(300);
        let ended = leader.output_until(deadline, Duration::from_secs(5)).await;
        assert_eq!(ended.err(), Some(PastDeadline));
        assert!(started.elapsed() < Duration::from_secs(5));
        let left = group_left_after(pgid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "left behind: {left:?}");
    }

    #[tokio::test]
    async fn a_leader_that_exits_takes_the_rest_of_its_group_with_it() {
        // The leader exits at once; a leftover keeps the output pipe open.
        let mut command = sh_command("sleep 300 & echo started; exit 0");
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        let leader = GroupLeader::spawn(command).unwrap();
        let pgid = leader.pid().unwrap();
        let started = std::time::Instant::now();
        let deadline = Instant::now() + Duration::from_secs(20);
        let output = leader
            .output_until(deadline, Duration::from_secs(5))
            .await
            .expect("finished before the deadline")
            .expect("output");
        assert!(output.status.success());
        assert_eq!(output.stdout, b"started\n");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        let left = group_left_after(pgid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "left behind: {left:?}");
    }

    #[tokio::test]
    async fn dropping_a_group_leader_kills_its_whole_group() {
        let command = sh_command("sleep 300 & echo started; sleep 300");
        let mut leader = GroupLeader::spawn(command).unwrap();
        let pgid = leader.pid().unwrap();
        // Wait until the background sleep exists (the script reports it).
        let mut stdout = leader.child.stdout.take().unwrap();
        let mut line = [0u8; 8];
        stdout.read_exact(&mut line).await.unwrap();
        assert_eq!(&line, b"started\n");
        assert!(group_members(pgid).len() >= 2);
        drop(leader);
        let left = group_left_after(pgid, Duration::from_secs(5)).await;
        assert!(left.is_empty(), "left behind: {left:?}");
    }

    #[tokio::test]
    async fn a_group_whose_leader_was_reaped_is_never_signalled_again() {
        // `cat` runs until its stdin closes.
        let mut command = sh_command("cat");
        command.stdin(Stdio::piped());
        let mut leader = GroupLeader::spawn(command).unwrap();
        let stdin = leader.child.stdin.take();
        assert!(
            leader.group().signal(Signal::SIGCONT),
            "the live group takes signals"
        );
        drop(stdin);
        assert!(leader.wait().await.unwrap().success());
        assert!(!leader.group().signal(Signal::SIGCONT));
        // The same rule for a long-lived child: once its exit is known, its id is forgotten.
        let (child, _io) = ChildGroup::spawn(&sh("exit 0")).unwrap();
        child.wait().await;
        assert!(!child.group.signal(Signal::SIGCONT));
    }

    /// Live members of group `pgid` still there after `limit`. Processes we did not spawn
    /// directly give no exit event, so this polls /proc (SIGKILL delivery is asynchronous).
    async fn group_left_after(pgid: u32, limit: Duration) -> Vec<u32> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let left: Vec<u32> = group_members(pgid)
                .into_iter()
                .filter(|pid| !is_zombie(*pid))
                .collect();
            if left.is_empty() || tokio::time::Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn is_zombie(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true)
    }
}
