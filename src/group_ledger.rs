//! The ledger of runtime process groups (`<state_dir>/process-groups.json`): which groups
//! this daemon started and has not reaped yet, so that a daemon that restarts after a crash
//! (`kill -9`, OOM kill) finds and kills the survivors of its previous life
//! ([`GroupLedger::take_over`]) before it resumes a single conversation. A survivor still
//! holds its sessions' locks and could still append to their histories: resuming one of
//! them elsewhere while it lives would attach a session twice.
//!
//! Each entry is a group id (its leader's pid) with the leader's start time (field 22 of
//! `/proc/<pid>/stat`, clock ticks since boot), session id and the boot id
//! (`/proc/sys/kernel/random/boot_id`): a pid reused by another process, or an entry from
//! before a reboot, is never killed. With the leader gone, its group's id may have been
//! handed out again (a restarted container numbers its processes from 1 again), so a member
//! is killed only if it started with the run's marker in its environment
//! ([`crate::process::run_marker`], which every `ChildGroup` gets). The file is rewritten whole (temporary file, then
//! `rename`) on every spawn and reap; without `fsync`, since only a process crash must be
//! survived (after a power loss every process is gone anyway, and the boot id differs). A
//! failed write is logged and counted (`copilot_pool_storage_write_failures_total{store=
//! "process_groups"}`) and never fails a spawn.

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::faults::{SharedDiskFaults, Store};
use crate::process::{processes_where, read_stat};

/// File name of the ledger inside the state directory.
pub const LEDGER_FILE: &str = "process-groups.json";

/// Version of the file format.
const FORMAT_VERSION: u32 = 1;

/// One process group this daemon started.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
pub struct GroupEntry {
    /// The group id, which is the leader's pid.
    pub pgid: u32,
    /// The leader's start time (clock ticks after boot).
    pub start_time: u64,
    /// The leader's session id (a runtime's or CLI's own: `ChildGroup` starts each in a new session).
    pub sid: u32,
    /// The boot the leader ran in.
    pub boot_id: String,
    /// The daemon's run marker its processes started with ([`crate::process::run_marker`]);
    /// empty in entries an earlier version wrote.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct LedgerFile {
    version: u32,
    groups: BTreeSet<GroupEntry>,
}

/// What [`GroupLedger::take_over`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TakeOver {
    /// Entries of the previous run that were read.
    pub recorded: usize,
    /// Processes of those groups that were still there and were SIGKILLed.
    pub killed: Vec<u32>,
    /// Entries left alone: their leader's pid now belongs to another process, or they are
    /// from another boot.
    pub not_ours: usize,
}

/// Why the ledger could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// Another live daemon holds the ledger of this state directory.
    #[error(
        "another copilot-pool daemon is running on the state directory of {path} (it holds \
         the lock on it): stop it first, or give this one its own state_dir"
    )]
    InUse {
        /// The lock file.
        path: PathBuf,
    },
    /// The lock file could not be created or locked.
    #[error("cannot lock {path}: {source}; check that the state directory is writable")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Why a takeover could not finish.
#[derive(Debug, thiserror::Error)]
pub enum TakeOverError {
    /// Processes of the previous run were SIGKILLed but are still there.
    #[error(
        "processes of the previous run ({pids:?}) are still alive {waited:?} after SIGKILL; \
         they may still hold conversations, so none is resumed: find out what blocks them \
         (`cat /proc/<pid>/stack`, uninterruptible I/O), kill them, and start again"
    )]
    Survivors {
        /// The pids still alive.
        pids: Vec<u32>,
        /// How long they were waited for.
        waited: Duration,
    },
    /// The scan for them did not finish (the async runtime is shutting down).
    #[error(
        "the search for processes of the previous run did not finish (the daemon is \
         stopping); start it again"
    )]
    Interrupted,
}

/// The ledger; shared by every worker of a daemon (`WorkerConfig::group_ledger`).
#[derive(Debug)]
pub struct GroupLedger {
    path: PathBuf,
    /// Held for the ledger's life: one daemon per state directory, so no daemon ever takes
    /// over the groups of another one that is alive.
    _lock: nix::fcntl::Flock<std::fs::File>,
    boot_id: Option<String>,
    faults: Option<SharedDiskFaults>,
    /// Groups of the previous run, until [`GroupLedger::take_over`] handles them.
    previous: Mutex<BTreeSet<GroupEntry>>,
    /// Groups of this run (the file's content after the takeover).
    live: Mutex<BTreeSet<GroupEntry>>,
}

impl GroupLedger {
    /// Opens the ledger at `path` and locks it (`<path>.lock`, for as long as the ledger
    /// lives), reading the groups of the previous run. A missing file is an empty ledger; an
    /// unreadable or corrupt one is logged as a warning and started fresh (survivors it
    /// named, if any, are then not known). Fails only if another live daemon holds the lock
    /// or the lock file cannot be made.
    pub fn open(path: impl Into<PathBuf>) -> Result<Arc<Self>, LedgerError> {
        Self::open_inner(path.into(), None).map(Arc::new)
    }

    /// Opens the ledger with injected write faults (tests, chaos).
    pub fn open_with_faults(
        path: impl Into<PathBuf>,
        faults: SharedDiskFaults,
    ) -> Result<Arc<Self>, LedgerError> {
        Self::open_inner(path.into(), Some(faults)).map(Arc::new)
    }

    fn open_inner(path: PathBuf, faults: Option<SharedDiskFaults>) -> Result<Self, LedgerError> {
        let mut lock_path = path.clone().into_os_string();
        lock_path.push(".lock");
        let lock_path = PathBuf::from(lock_path);
        let lock_error = |source| LedgerError::Lock {
            path: lock_path.clone(),
            source,
        };
        // The state directory, private as the bindings store makes it (mode 0700).
        if let Some(dir) = lock_path.parent().filter(|d| !d.as_os_str().is_empty()) {
            crate::home::ensure_private_dir(dir).map_err(lock_error)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(lock_error)?;
        let lock = match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        {
            Ok(lock) => lock,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                return Err(LedgerError::InUse { path: lock_path });
            }
            Err((_, errno)) => return Err(lock_error(io::Error::from(errno))),
        };
        let previous = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<LedgerFile>(&bytes) {
                Ok(file) if file.version == FORMAT_VERSION => file.groups,
                Ok(file) => {
                    tracing::warn!(path = %path.display(), version = file.version, "The process-group ledger has an unknown format version; starting a fresh one. Processes of the previous run, if any, are not known: check for leftover copilot runtimes.");
                    BTreeSet::new()
                }
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "The process-group ledger is corrupt; starting a fresh one. Processes of the previous run, if any, are not known: check for leftover copilot runtimes.");
                    BTreeSet::new()
                }
            },
            Err(error) if error.kind() == io::ErrorKind::NotFound => BTreeSet::new(),
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "The process-group ledger cannot be read; starting a fresh one. Fix its permissions; processes of the previous run, if any, are not known.");
                BTreeSet::new()
            }
        };
        remove_leftover_temp_files(&path);
        Ok(GroupLedger {
            path,
            _lock: lock,
            boot_id: boot_id(),
            faults,
            previous: Mutex::new(previous),
            live: Mutex::new(BTreeSet::new()),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The groups of the previous run not yet taken over.
    pub fn previous(&self) -> Vec<GroupEntry> {
        lock(&self.previous).iter().cloned().collect()
    }

    /// The groups of this run.
    pub fn live(&self) -> Vec<GroupEntry> {
        lock(&self.live).iter().cloned().collect()
    }

    /// SIGKILLs every group of the previous run that is still the same: its leader there
    /// with the recorded start time and boot (the whole group), or, when the leader is gone
    /// (killed by its parent-death signal and reaped), the members left in its group that
    /// belong to the recorded session and started after it. Waits up to `limit` for all of
    /// them, and for recorded leaders that are zombies, to be reaped (the runtime's in-use
    /// lock takes any existing pid for a live owner); then rewrites the ledger with this
    /// run's groups only. Fails if a killed process is still alive (not a zombie) at the
    /// limit; zombies left at the limit (an init that does not reap) are logged.
    pub async fn take_over(&self, limit: Duration) -> Result<TakeOver, TakeOverError> {
        let previous = std::mem::take(&mut *lock(&self.previous));
        // Reading /proc (every process, again after each kill) is file work: off the async
        // threads.
        let boot_id = self.boot_id.clone();
        let entries = previous.clone();
        let scanned =
            tokio::task::spawn_blocking(move || kill_previous(&entries, boot_id.as_deref())).await;
        let (mut report, mut must_vanish) = match scanned {
            Ok(found) => found,
            Err(error) => {
                // Kept for the next try.
                lock(&self.previous).extend(previous);
                if error.is_panic() {
                    std::panic::resume_unwind(error.into_panic());
                }
                return Err(TakeOverError::Interrupted);
            }
        };
        report.recorded = previous.len();
        report.killed.sort_unstable();
        report.killed.dedup();
        must_vanish.extend(report.killed.iter().copied());
        let waited = tokio::time::Instant::now();
        loop {
            must_vanish.retain(|p| read_stat(*p).is_some());
            if must_vanish.is_empty() {
                break;
            }
            if waited.elapsed() >= limit {
                let alive: Vec<u32> = must_vanish
                    .iter()
                    .copied()
                    .filter(|p| is_alive(*p))
                    .collect();
                if !alive.is_empty() {
                    // Kept for the next try.
                    lock(&self.previous).extend(previous);
                    return Err(TakeOverError::Survivors {
                        pids: alive,
                        waited: limit,
                    });
                }
                tracing::warn!(zombies = ?must_vanish, ?limit, "Runtimes of the previous run are dead but not reaped: their sessions may be reported in use (`alreadyInUse`) when resumed. Run the daemon under an init that reaps orphans (tini, `docker run --init`, systemd).");
                break;
            }
            // Processes we did not start give no exit event: /proc is read (bounded).
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if report.recorded > 0 {
            tracing::info!(
                recorded = report.recorded,
                killed = report.killed.len(),
                not_ours = report.not_ours,
                "Took over from the previous run: its surviving runtime processes are gone."
            );
        }
        self.write(&lock(&self.live));
        Ok(report)
    }

    /// Records a group just started (its leader is `pgid`, not reaped yet). Returns the
    /// entry to pass to [`GroupLedger::reaped`], `None` if the leader could not be read.
    pub fn started(&self, pgid: u32) -> Option<GroupEntry> {
        let Some(stat) = read_stat(pgid) else {
            tracing::warn!(
                pgid,
                "A new child's /proc entry cannot be read (it ended at once?); it is not in the process-group ledger."
            );
            return None;
        };
        let entry = GroupEntry {
            pgid,
            start_time: stat.start_time,
            sid: stat.sid,
            boot_id: self.boot_id.clone().unwrap_or_default(),
            run: crate::process::run_marker().to_owned(),
        };
        let mut live = lock(&self.live);
        live.insert(entry.clone());
        self.write(&live);
        Some(entry)
    }

    /// Keeps `child`'s group in the ledger from now until its leader is reaped (a task
    /// waits for the reap), so a daemon restarted after a crash finds it if it survived:
    /// a runtime's, and a CLI backend's (whose tools may outlive a leader that the
    /// parent-death signal reached). Call it in a tokio runtime.
    pub fn track(self: &Arc<Self>, child: &crate::process::ChildGroup) {
        let Some(entry) = self.started(child.pid()) else {
            return;
        };
        let ledger = Arc::clone(self);
        let mut exit = child.exit_watch();
        tokio::spawn(async move {
            // Reaped, or the reaper is gone with the child (its group was killed on drop).
            let _ = exit.wait_for(|e| e.is_some()).await;
            ledger.reaped(&entry);
        });
    }

    /// Removes a group whose leader was reaped.
    pub fn reaped(&self, entry: &GroupEntry) {
        let mut live = lock(&self.live);
        if live.remove(entry) {
            self.write(&live);
        }
    }

    /// Writes the previous run's groups not yet taken over and `live` (the caller holds the
    /// `live` lock, so writes happen one at a time and in order).
    fn write(&self, live: &BTreeSet<GroupEntry>) {
        let mut groups = live.clone();
        groups.extend(lock(&self.previous).iter().cloned());
        let file = LedgerFile {
            version: FORMAT_VERSION,
            groups,
        };
        if let Err(error) = self.write_file(&file) {
            crate::metrics::storage_write_failed(Store::ProcessGroups);
            tracing::warn!(path = %self.path.display(), %error, "Could not write the process-group ledger; a restart after a crash may not find every leftover runtime. Check the state directory's disk and permissions.");
        }
    }

    fn write_file(&self, file: &LedgerFile) -> io::Result<()> {
        crate::faults::check(self.faults.as_ref(), Store::ProcessGroups)?;
        let mut json = serde_json::to_vec(file).map_err(io::Error::other)?;
        json.push(b'\n');
        let Some(dir) = self.path.parent() else {
            return Err(io::Error::other("the ledger path has no directory"));
        };
        crate::home::ensure_private_dir(dir)?;
        // One writer (the lock), so one temp name: a write a kill cut short is overwritten.
        let temp = dir.join(format!(".{LEDGER_FILE}.tmp"));
        let written =
            std::fs::write(&temp, &json).and_then(|()| std::fs::rename(&temp, &self.path));
        if written.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        written
    }
}

/// Removes the temp files of writes cut short beside the ledger at `path` (`.<name>.tmp`,
/// and `.<name>.<pid>.tmp` of earlier versions, which named them by process): called under
/// the lock, when no other writer runs.
fn remove_leftover_temp_files(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!(".{name}.");
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let is_temp = file_name
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".tmp"));
        if is_temp {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// What became of a recorded leader.
enum LeaderState {
    /// Alive (or a zombie) with the recorded start time.
    Same,
    /// Its pid belongs to another process now.
    Reused,
    /// No process has its pid.
    Gone,
}

impl LeaderState {
    fn of(entry: &GroupEntry) -> Self {
        match read_stat(entry.pgid) {
            Some(stat) if stat.start_time == entry.start_time => LeaderState::Same,
            Some(_) => LeaderState::Reused,
            None => LeaderState::Gone,
        }
    }
}

/// SIGKILLs what is left of the `previous` run's groups ([`GroupLedger::take_over`]):
/// returns the report (without `recorded`) and every pid that must vanish. Reads all of
/// `/proc`, more than once: on a blocking thread.
fn kill_previous(previous: &BTreeSet<GroupEntry>, boot_id: Option<&str>) -> (TakeOver, Vec<u32>) {
    let mut report = TakeOver::default();
    // Every process of the previous run that must be gone, zombies included: the
    // runtime's in-use lock (`session-state/<id>/inuse.<pid>.lock`) takes a pid that
    // exists for a live owner, so a leader that is only a zombie (killed by its
    // parent-death signal, not yet reaped by init) would make its sessions look attached.
    let mut must_vanish = Vec::new();
    for entry in previous {
        if boot_id != Some(entry.boot_id.as_str()) {
            report.not_ours += 1;
            continue;
        }
        match LeaderState::of(entry) {
            LeaderState::Same => {
                let killed = kill_until_none_left(
                    || {
                        leftovers(entry)
                            .into_iter()
                            .filter(|p| is_alive(*p))
                            .collect()
                    },
                    |live| {
                        if let Err(error) = killpg(pid(entry.pgid), Signal::SIGKILL) {
                            tracing::warn!(pgid = entry.pgid, %error, "Could not kill a process group of the previous run.");
                        }
                        // What left the group but not the session the leader made.
                        for member in live {
                            if read_stat(*member).is_some_and(|stat| stat.pgrp != entry.pgid) {
                                let _ = kill(pid(*member), Signal::SIGKILL);
                            }
                        }
                    },
                );
                report.killed.extend(killed);
                must_vanish.push(entry.pgid);
            }
            LeaderState::Reused => report.not_ours += 1,
            LeaderState::Gone => {
                // With the leader gone the group may have emptied and its id, or its
                // session's, been handed out again (a restarted container numbers its
                // processes from 1 again): a member is killed only if it started with the
                // run's marker in its environment, besides the session and start time.
                // (An entry of an earlier version has none: judged by those two alone.)
                let members = || -> Vec<u32> {
                    leftovers(entry)
                        .into_iter()
                        .filter(|member| {
                            read_stat(*member).is_some_and(|stat| {
                                stat.sid == entry.sid
                                    && stat.start_time >= entry.start_time
                                    && (entry.run.is_empty()
                                        || stat.state == 'Z'
                                        || crate::process::carries_run_marker(*member, &entry.run))
                            })
                        })
                        .collect()
                };
                // Zombies among them must vanish too (be reaped), not be killed.
                must_vanish.extend(members());
                let killed = kill_until_none_left(
                    || members().into_iter().filter(|p| is_alive(*p)).collect(),
                    |live| {
                        for member in live {
                            let _ = kill(pid(*member), Signal::SIGKILL);
                        }
                    },
                );
                report.killed.extend(killed);
                // What is left in the group's session without the marker: said, not killed
                // (another process at a reused id, or a survivor whose tool cleared its
                // environment, which an operator can tell apart).
                let unmarked: Vec<u32> = leftovers(entry)
                    .into_iter()
                    .filter(|member| !report.killed.contains(member))
                    .filter(|member| {
                        read_stat(*member).is_some_and(|stat| {
                            stat.sid == entry.sid
                                && stat.start_time >= entry.start_time
                                && stat.state != 'Z'
                        })
                    })
                    .collect();
                if !unmarked.is_empty() {
                    tracing::warn!(
                        pgid = entry.pgid,
                        pids = ?unmarked,
                        "Processes in the session of a process group the previous run recorded did not start with that run's marker (COPILOT_POOL_RUN) and were left running: another program given the same ids, or a survivor whose tool cleared its environment; check them (ps -o pid,lstart,args -p ...) and kill the previous run's by hand."
                    );
                }
            }
        }
    }
    (report, must_vanish)
}

/// The most scans [`kill_until_none_left`] makes.
const KILL_ROUNDS: usize = 16;

/// Kills what `live` finds with `kill`, and scans again until a scan finds nothing alive it
/// has not killed already: a process may fork between one scan and its kill (its child,
/// unseen, would be left; once a SIGKILL is pending it forks no more). Returns every pid
/// killed. At most [`KILL_ROUNDS`] scans: what is left after them is still waited for, and
/// reported, by the caller.
fn kill_until_none_left(
    mut live: impl FnMut() -> Vec<u32>,
    mut kill: impl FnMut(&[u32]),
) -> Vec<u32> {
    let mut killed: Vec<u32> = Vec::new();
    for _ in 0..KILL_ROUNDS {
        // One killed and not yet dead is still found alive: not new.
        let mut found = live();
        found.retain(|pid| !killed.contains(pid));
        if found.is_empty() {
            break;
        }
        kill(&found);
        killed.extend(found);
    }
    killed
}

/// A process that is there and not a zombie (a zombie holds no session and runs nothing).
fn is_alive(pid: u32) -> bool {
    read_stat(pid).is_some_and(|stat| stat.state != 'Z' && stat.state != 'X')
}

/// Pids of the processes now in `entry`'s group, and, when its leader made a session of its
/// own (its session id is its group id, as every `ChildGroup` does), in that session: a tool
/// that left the group (`setpgid`, as GNU `timeout` does) but not the session. Never this
/// process.
fn leftovers(entry: &GroupEntry) -> Vec<u32> {
    let own_session = entry.sid == entry.pgid;
    processes_where(|stat| stat.pgrp == entry.pgid || (own_session && stat.sid == entry.sid))
}

/// This boot's id, `None` if it cannot be read (then no recorded group is ever killed).
fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty())
}

fn pid(raw: u32) -> Pid {
    Pid::from_raw(i32::try_from(raw).unwrap_or(i32::MAX))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::{Stat, parse_stat};

    #[test]
    fn a_child_forked_while_its_parent_is_killed_is_found_by_the_next_scan_and_killed() {
        // The world: 10 alive; killing 10 reveals 11, forked just before the kill.
        let world = Mutex::new(vec![10_u32]);
        let kills = Mutex::new(Vec::new());
        let killed = kill_until_none_left(
            || lock(&world).clone(),
            |pids| {
                lock(&kills).push(pids.to_vec());
                let mut world = lock(&world);
                if pids.contains(&10) {
                    // 10 is dying but still listed for a while; its child appears.
                    world.push(11);
                }
            },
        );
        assert_eq!(killed, vec![10, 11]);
        // 10 was killed once, though still listed alive after its kill.
        assert_eq!(*lock(&kills), vec![vec![10], vec![11]]);
        // Nothing found: nothing killed, one scan.
        let scans = Mutex::new(0);
        let none = kill_until_none_left(
            || {
                *lock(&scans) += 1;
                Vec::new()
            },
            |_| panic!("nothing to kill"),
        );
        assert!(none.is_empty());
        assert_eq!(*lock(&scans), 1);
    }

    #[test]
    fn the_stat_fields_are_read_after_a_command_name_with_spaces_and_parentheses() {
        let line =
            "4242 (a (b) c) S 1 4242 4000 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                state: 'S',
                pgrp: 4242,
                sid: 4000,
                start_time: 987654
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn a_corrupt_ledger_is_started_fresh_and_rewritten_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEDGER_FILE);
        std::fs::write(&path, b"{\"version\":1,\"groups\":[{\"pgid\":").unwrap();
        let ledger = GroupLedger::open(&path).unwrap();
        assert!(ledger.previous().is_empty());
        let me = std::process::id();
        let entry = ledger.started(me).expect("our own stat is readable");
        let file: LedgerFile = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            file.groups.into_iter().collect::<Vec<_>>(),
            vec![entry.clone()]
        );
        ledger.reaped(&entry);
        let file: LedgerFile = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert!(file.groups.is_empty());
    }

    #[test]
    fn temp_files_of_writes_a_kill_cut_short_are_removed_when_the_ledger_opens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEDGER_FILE);
        let leftovers = [
            dir.path().join(format!(".{LEDGER_FILE}.tmp")),
            dir.path().join(format!(".{LEDGER_FILE}.4242.tmp")),
        ];
        for leftover in &leftovers {
            std::fs::write(leftover, b"{\"version\":1,\"gro").unwrap();
        }
        let other = dir.path().join(".bindings.tmp");
        std::fs::write(&other, b"not the ledger's").unwrap();
        let _ledger = GroupLedger::open(&path).unwrap();
        for leftover in &leftovers {
            assert!(!leftover.exists(), "{} is left", leftover.display());
        }
        assert!(other.exists(), "only the ledger's temp files go");
    }

    #[test]
    fn the_state_directory_the_ledger_makes_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("home").join("state");
        let _ledger = GroupLedger::open(state.join(LEDGER_FILE)).unwrap();
        for made in [state.clone(), dir.path().join("home")] {
            let mode = std::fs::metadata(&made).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{}", made.display());
        }
    }

    #[test]
    fn an_entry_records_the_start_time_session_and_boot_and_is_read_back_by_the_next_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join(LEDGER_FILE);
        let ledger = GroupLedger::open(&path).unwrap();
        let me = std::process::id();
        let entry = ledger.started(me).unwrap();
        let stat = read_stat(me).unwrap();
        assert_eq!(entry.start_time, stat.start_time);
        assert_eq!(entry.sid, stat.sid);
        assert_eq!(Some(entry.boot_id.clone()), boot_id());
        let second = GroupLedger::open(&path).expect_err("one daemon per state directory");
        assert!(
            second.to_string().contains("another copilot-pool daemon"),
            "{second}"
        );
        drop(ledger);
        let next = GroupLedger::open(&path).unwrap();
        assert_eq!(next.previous(), vec![entry]);
    }

    #[derive(Debug)]
    struct FailAll;

    impl crate::faults::DiskFaults for FailAll {
        fn before_write(&self, _: Store) -> Option<io::Error> {
            Some(io::Error::from_raw_os_error(nix::libc::ENOSPC))
        }
    }

    #[test]
    fn a_failed_write_is_counted_and_does_not_fail_the_caller() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEDGER_FILE);
        let ledger = GroupLedger::open_with_faults(&path, Arc::new(FailAll)).unwrap();
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let entry = metrics::with_local_recorder(&recorder, || ledger.started(std::process::id()));
        assert!(
            entry.is_some(),
            "the spawn is recorded in memory all the same"
        );
        assert!(!path.exists());
        let failures: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| {
                key.key().name() == crate::metrics::STORAGE_WRITE_FAILURES_TOTAL
                    && key
                        .key()
                        .labels()
                        .any(|l| l.key() == "store" && l.value() == "process_groups")
            })
            .map(|(.., value)| value)
            .collect();
        assert_eq!(failures, vec![DebugValue::Counter(1)]);
    }
}
