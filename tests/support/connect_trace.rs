//! A `connect()` tracer for a CLI's whole process tree, in the test process itself, with
//! nothing a fresh machine lacks (no strace, no root): a `ptrace` loop on a thread of its
//! own (`nix`'s safe wrappers), which records the socket address of every `connect`, and the
//! destination of every `sendto` / `sendmsg` / `sendmmsg` that names one (an unconnected
//! UDP DNS query), of the traced process and of everything it forks, clones or execs.
//!
//! How the CLI comes under the trace: [`ConnectTrace::start`] writes a `/bin/sh` wrapper to
//! give a runner as its `command`. The wrapper runs a subshell that writes its own pid to a
//! FIFO and waits on a second one; the tracer thread seizes that pid (a grandchild of the
//! test, so the runner's own child, the wrapper, is never reaped here: the loop waits with
//! `__WNOTHREAD`, for the tracer thread's tracees only), then lets it go on, and the
//! subshell execs the real CLI under the trace. x86_64 and aarch64 registers are decoded.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::ptrace::{self, AddressType, Event, Options};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// Where one traced call went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// An IPv4 or IPv6 address and port.
    Inet(SocketAddr),
    /// A Unix socket (its path; `@…` for an abstract one).
    Unix(String),
    /// Another address family (its number).
    Other(u16),
}

/// One traced call: which process, which system call, where to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// The calling thread.
    pub pid: i32,
    /// `connect`, `sendto`, `sendmsg` or `sendmmsg`.
    pub syscall: &'static str,
    /// The address it names.
    pub target: Target,
    /// The program the calling process ran (`/proc/<pid>/exe`, read at the call).
    pub program: String,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match &self.target {
            Target::Inet(addr) if addr.port() == 53 => format!("{addr} (DNS)"),
            Target::Inet(addr) => addr.to_string(),
            Target::Unix(path) => format!("unix:{path}"),
            Target::Other(family) => format!("address family {family}"),
        };
        write!(
            f,
            "{} → {target} (pid {}, {})",
            self.syscall, self.pid, self.program
        )
    }
}

/// What the trace of one CLI process tree found.
#[derive(Debug)]
pub struct Trace {
    /// Every traced call, in order.
    pub attempts: Vec<Attempt>,
    /// How many processes and threads were traced.
    pub tasks: usize,
    /// How many system calls were seen (entries).
    pub syscalls: u64,
}

impl Trace {
    /// Every inet call that does not go to `allowed`.
    pub fn outbound_except(&self, allowed: SocketAddr) -> Vec<&Attempt> {
        self.attempts
            .iter()
            .filter(|a| matches!(a.target, Target::Inet(addr) if addr != allowed))
            .collect()
    }
}

/// A tracer waiting for (or tracing) one CLI started through [`ConnectTrace::wrapper`].
pub struct ConnectTrace {
    wrapper: PathBuf,
    done: mpsc::Receiver<Result<Trace, String>>,
}

/// How long [`ConnectTrace::finish`] waits for the traced processes to be gone (a failure
/// guard: a CLI that leaves a process behind fails the test instead of hanging it).
const FINISH_LIMIT: Duration = Duration::from_secs(60);

impl ConnectTrace {
    /// Writes the wrapper (and its two FIFOs) into `dir` for `program`, and starts the
    /// tracer thread, which waits for the wrapper's first run.
    pub fn start(dir: &Path, program: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("trace dir");
        let pid_fifo = dir.join("pid.fifo");
        let go_fifo = dir.join("go.fifo");
        for fifo in [&pid_fifo, &go_fifo] {
            nix::unistd::mkfifo(fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))
                .expect("mkfifo");
        }
        let wrapper = dir.join("traced-cli");
        let quote = |p: &Path| format!("'{}'", p.display().to_string().replace('\'', r"'\''"));
        // The subshell reads its own pid (the redirection is its own open of /proc/self),
        // hands it over, waits to be traced, then becomes the CLI. An asynchronous list
        // would read /dev/null: stdin goes over fd 3. The wrapper waits for it and passes
        // on its status and the signals the runner sends.
        let script = format!(
            "#!/bin/sh\n\
             exec 3<&0\n\
             ( read -r pid _ < /proc/self/stat; echo \"$pid\" > {pid}; read -r _ < {go}; \
               exec {program} \"$@\" ) <&3 3<&- &\n\
             child=$!\n\
             exec 3<&-\n\
             trap 'kill -TERM \"$child\" 2>/dev/null' TERM INT HUP\n\
             while :; do\n\
               wait \"$child\"; status=$?\n\
               kill -0 \"$child\" 2>/dev/null || exit \"$status\"\n\
             done\n",
            pid = quote(&pid_fifo),
            go = quote(&go_fifo),
            program = quote(program),
        );
        std::fs::write(&wrapper, script).expect("wrapper");
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))
            .expect("wrapper mode");
        let (tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(trace(&pid_fifo, &go_fifo));
        });
        Self { wrapper, done }
    }

    /// The program to give the runner as its command.
    pub fn wrapper(&self) -> &Path {
        &self.wrapper
    }

    /// Waits for every traced process to end and returns what they did. Call it once the
    /// CLI's run is over (a live CLI closed).
    pub fn finish(self) -> Trace {
        match self.done.recv_timeout(FINISH_LIMIT) {
            Ok(Ok(trace)) => trace,
            Ok(Err(problem)) => panic!("the connect tracer failed: {problem}"),
            Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                "a traced process was still running {FINISH_LIMIT:?} after the CLI's run \
                 ended (the CLI left a process behind, or the wrapper never ran it)"
            ),
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the connect tracer panicked"),
        }
    }
}

const EVENT_STOP: i32 = 128; // PTRACE_EVENT_STOP

/// The tracer thread: seize the subshell, release it, follow its tree until it is gone.
fn trace(pid_fifo: &Path, go_fifo: &Path) -> Result<Trace, String> {
    let text = std::fs::read_to_string(pid_fifo).map_err(|e| format!("reading the pid: {e}"))?;
    let root = Pid::from_raw(
        text.trim()
            .parse()
            .map_err(|e| format!("the wrapper sent {text:?} as its pid: {e}"))?,
    );
    let options = Options::PTRACE_O_TRACESYSGOOD
        | Options::PTRACE_O_TRACEFORK
        | Options::PTRACE_O_TRACEVFORK
        | Options::PTRACE_O_TRACECLONE
        | Options::PTRACE_O_TRACEEXEC
        | Options::PTRACE_O_EXITKILL;
    ptrace::seize(root, options).map_err(|e| format!("PTRACE_SEIZE {root}: {e}"))?;
    ptrace::interrupt(root).map_err(|e| format!("PTRACE_INTERRUPT {root}: {e}"))?;
    let flags = Some(WaitPidFlag::__WALL | WaitPidFlag::__WNOTHREAD);
    loop {
        match waitpid(root, flags) {
            Ok(WaitStatus::PtraceEvent(_, _, EVENT_STOP)) => break,
            Ok(WaitStatus::PtraceSyscall(_)) | Ok(WaitStatus::PtraceEvent(..)) => {}
            Ok(WaitStatus::Stopped(_, sig)) => {
                ptrace::cont(root, sig).map_err(|e| format!("PTRACE_CONT: {e}"))?;
                continue;
            }
            Ok(other) => return Err(format!("the subshell ended before it ran: {other:?}")),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(format!("waitpid: {e}")),
        }
    }
    ptrace::syscall(root, None).map_err(|e| format!("PTRACE_SYSCALL: {e}"))?;
    // Read-write: the open never blocks (the subshell may be stopped by the trace), and
    // the "go" stays in the pipe until the subshell reads it; kept open until its exec.
    let mut go = Some(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(go_fifo)
            .map_err(|e| format!("opening the go fifo: {e}"))?,
    );
    if let Some(fifo) = go.as_mut() {
        fifo.write_all(b"go\n")
            .map_err(|e| format!("writing go: {e}"))?;
    }

    let mut live: HashSet<Pid> = HashSet::from([root]);
    let mut seen: HashSet<Pid> = HashSet::from([root]);
    // Whether each task is inside a system call (its next syscall stop is the exit).
    let mut inside: HashMap<Pid, bool> = HashMap::new();
    let mut attempts = Vec::new();
    let mut syscalls = 0u64;
    while !live.is_empty() {
        let status = match waitpid(None::<Pid>, flags) {
            Ok(status) => status,
            Err(Errno::EINTR) => continue,
            Err(Errno::ECHILD) => break,
            Err(e) => return Err(format!("waitpid: {e}")),
        };
        let resume = |pid: Pid, sig: Option<nix::sys::signal::Signal>| {
            // A task may die (SIGKILL of its group) between its stop and this.
            let _ = ptrace::syscall(pid, sig);
        };
        match status {
            WaitStatus::PtraceSyscall(pid) => {
                live.insert(pid);
                seen.insert(pid);
                let entering = !inside.get(&pid).copied().unwrap_or(false);
                inside.insert(pid, entering);
                if entering {
                    syscalls += 1;
                    attempts.extend(inspect(pid));
                }
                resume(pid, None);
            }
            WaitStatus::PtraceEvent(pid, _, event) => {
                live.insert(pid);
                seen.insert(pid);
                if event == Event::PTRACE_EVENT_FORK as i32
                    || event == Event::PTRACE_EVENT_VFORK as i32
                    || event == Event::PTRACE_EVENT_CLONE as i32
                {
                    if let Ok(child) = ptrace::getevent(pid) {
                        let child = Pid::from_raw(child as i32);
                        live.insert(child);
                        seen.insert(child);
                    }
                } else if event == Event::PTRACE_EVENT_EXEC as i32 {
                    // The next stop is execve's exit; a thread that exec'd took the
                    // leader's pid and its old id is gone.
                    if let Ok(former) = ptrace::getevent(pid) {
                        let former = Pid::from_raw(former as i32);
                        if former != pid {
                            live.remove(&former);
                            inside.remove(&former);
                        }
                    }
                    inside.insert(pid, true);
                    go = None;
                }
                resume(pid, None);
            }
            WaitStatus::Stopped(pid, sig) => {
                live.insert(pid);
                seen.insert(pid);
                resume(pid, Some(sig));
            }
            WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _) => {
                live.remove(&pid);
                inside.remove(&pid);
            }
            _ => {}
        }
    }
    drop(go);
    Ok(Trace {
        attempts,
        tasks: seen.len(),
        syscalls,
    })
}

/// The system call numbers traced, and the argument holding the address (or message).
#[cfg(target_arch = "x86_64")]
mod nr {
    pub const CONNECT: u64 = 42;
    pub const SENDTO: u64 = 44;
    pub const SENDMSG: u64 = 46;
    pub const SENDMMSG: u64 = 307;
}
#[cfg(target_arch = "aarch64")]
mod nr {
    pub const CONNECT: u64 = 203;
    pub const SENDTO: u64 = 206;
    pub const SENDMSG: u64 = 211;
    pub const SENDMMSG: u64 = 269;
}

/// The system call number and its six arguments at a syscall-entry stop.
#[cfg(target_arch = "x86_64")]
fn syscall_args(pid: Pid) -> Option<(u64, [u64; 6])> {
    let r = ptrace::getregs(pid).ok()?;
    Some((r.orig_rax, [r.rdi, r.rsi, r.rdx, r.r10, r.r8, r.r9]))
}
#[cfg(target_arch = "aarch64")]
fn syscall_args(pid: Pid) -> Option<(u64, [u64; 6])> {
    let r = ptrace::getregs(pid).ok()?;
    Some((
        r.regs[8],
        [
            r.regs[0], r.regs[1], r.regs[2], r.regs[3], r.regs[4], r.regs[5],
        ],
    ))
}

/// The traced calls a syscall-entry stop makes (none for other system calls).
fn inspect(pid: Pid) -> Vec<Attempt> {
    let Some((number, args)) = syscall_args(pid) else {
        return Vec::new();
    };
    let mut found: Vec<(&'static str, Target)> = Vec::new();
    match number {
        nr::CONNECT => found.extend(sockaddr(pid, args[1], args[2]).map(|t| ("connect", t))),
        nr::SENDTO if args[4] != 0 => {
            found.extend(sockaddr(pid, args[4], args[5]).map(|t| ("sendto", t)))
        }
        nr::SENDMSG => found.extend(msghdr_name(pid, args[1]).map(|t| ("sendmsg", t))),
        nr::SENDMMSG => {
            // struct mmsghdr: a 56-byte msghdr, then msg_len (padded to 64 bytes).
            for i in 0..args[2].min(64) {
                found.extend(msghdr_name(pid, args[1] + i * 64).map(|t| ("sendmmsg", t)));
            }
        }
        _ => {}
    }
    if found.is_empty() {
        return Vec::new();
    }
    let program = std::fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "?".to_owned());
    found
        .into_iter()
        .filter(|(_, t)| !matches!(t, Target::Other(0)))
        .map(|(syscall, target)| Attempt {
            pid: pid.as_raw(),
            syscall,
            target,
            program: program.clone(),
        })
        .collect()
}

/// `len` bytes of the tracee's memory at `addr`.
fn peek(pid: Pid, addr: u64, len: usize) -> Option<Vec<u8>> {
    let word = std::mem::size_of::<std::ffi::c_long>();
    let mut bytes = Vec::with_capacity(len + word);
    let mut at = addr;
    while bytes.len() < len {
        let value = ptrace::read(pid, at as usize as AddressType).ok()?;
        bytes.extend_from_slice(&value.to_ne_bytes());
        at += word as u64;
    }
    bytes.truncate(len);
    Some(bytes)
}

/// The `msg_name` of the `struct msghdr` at `addr` (none when it names no address).
fn msghdr_name(pid: Pid, addr: u64) -> Option<Target> {
    let head = peek(pid, addr, 12)?;
    let name = u64::from_ne_bytes(head[0..8].try_into().ok()?);
    let len = u32::from_ne_bytes(head[8..12].try_into().ok()?);
    if name == 0 || len == 0 {
        return None;
    }
    sockaddr(pid, name, u64::from(len))
}

/// The socket address of `len` bytes at `addr`.
fn sockaddr(pid: Pid, addr: u64, len: u64) -> Option<Target> {
    if addr == 0 || len < 2 {
        return None;
    }
    let bytes = peek(pid, addr, len.min(128) as usize)?;
    let family = u16::from_ne_bytes([bytes[0], bytes[1]]);
    let port = |b: &[u8]| u16::from_be_bytes([b[2], b[3]]);
    Some(match family {
        2 if bytes.len() >= 8 => {
            let ip = Ipv4Addr::new(bytes[4], bytes[5], bytes[6], bytes[7]);
            Target::Inet(SocketAddr::new(IpAddr::V4(ip), port(&bytes)))
        }
        10 if bytes.len() >= 24 => {
            let octets: [u8; 16] = bytes[8..24].try_into().ok()?;
            Target::Inet(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(octets)),
                port(&bytes),
            ))
        }
        1 => {
            let path = &bytes[2..];
            let text = match path.first() {
                Some(0) => format!(
                    "@{}",
                    String::from_utf8_lossy(&path[1..]).trim_end_matches('\0')
                ),
                _ => String::from_utf8_lossy(path.split(|b| *b == 0).next().unwrap_or(&[]))
                    .into_owned(),
            };
            Target::Unix(text)
        }
        other => Target::Other(other),
    })
}
