//! The chaos run's faults: a schedule drawn from one seed (the same seed gives the same
//! sequence of fault kinds and target picks), and the disk plan that fails the pool's durable
//! writes when a disk fault is armed.

use std::collections::BTreeMap;
use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use copilot_pool::faults::{DiskFaults, Store};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// One kind of fault the injector makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL of a runtime process.
    Kill,
    /// SIGSTOP of a runtime process (it must be found hung, killed and replaced).
    Stop,
    /// The pipe carrying a runtime's output closes while the runtime lives on.
    ClosePipe,
    /// The next binding writes fail (ENOSPC or EIO).
    BindingWrite,
    /// The next transcript writes fail (ENOSPC or EIO).
    TranscriptWrite,
    /// An agent's BYOK key changes (a new key: its old process drains).
    RotateKey,
    /// An HTTP agent's GitHub token changes, with a new profile version (its old process
    /// drains).
    RotateToken,
    /// A client aborts its turn in flight.
    ClientAbort,
    /// A client drops its connection mid-stream.
    ClientDrop,
}

impl FaultKind {
    pub const ALL: [FaultKind; 9] = [
        FaultKind::Kill,
        FaultKind::Stop,
        FaultKind::ClosePipe,
        FaultKind::BindingWrite,
        FaultKind::TranscriptWrite,
        FaultKind::RotateKey,
        FaultKind::RotateToken,
        FaultKind::ClientAbort,
        FaultKind::ClientDrop,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Stop => "stop",
            FaultKind::ClosePipe => "close_pipe",
            FaultKind::BindingWrite => "binding_write",
            FaultKind::TranscriptWrite => "transcript_write",
            FaultKind::RotateKey => "rotate_key",
            FaultKind::RotateToken => "rotate_token",
            FaultKind::ClientAbort => "client_abort",
            FaultKind::ClientDrop => "client_drop",
        }
    }
}

/// The seeded source of every random choice the injector makes.
pub struct Schedule {
    rng: ChaCha8Rng,
}

impl Schedule {
    pub fn new(seed: u64) -> Self {
        Schedule {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The next fault's kind.
    pub fn next_kind(&mut self) -> FaultKind {
        FaultKind::ALL[self.rng.random_range(0..FaultKind::ALL.len())]
    }

    /// A pick among `n` targets (`n > 0`).
    pub fn pick(&mut self, n: usize) -> usize {
        self.rng.random_range(0..n.max(1))
    }

    /// The error an armed disk fault fails writes with: a full disk or a failing one.
    pub fn disk_error(&mut self) -> i32 {
        if self.rng.random_bool(0.5) {
            nix::libc::ENOSPC
        } else {
            nix::libc::EIO
        }
    }
}

/// The shim every chaos worker runs through: the runtime (exec'd, so it keeps the worker's
/// pid and leads its group) with its output going through a FIFO to a `cat` in its group,
/// whose output is the pipe the pool reads. Killing the `cat` closes that pipe while the
/// runtime lives on: a fault the real runtime cannot be told to make. The FIFOs live in
/// `dir` (the run's scratch directory).
pub fn runtime_shim(runtime: &std::path::Path, dir: &std::path::Path) -> String {
    let quote = |p: &std::path::Path| p.display().to_string().replace('\'', "'\\''");
    format!(
        "#!/bin/sh\nfifo='{dir}'/fifo.$$\n/usr/bin/mkfifo \"$fifo\" || exit 1\n/bin/cat \"$fifo\" &\nexec '{runtime}' \"$@\" > \"$fifo\"\n",
        dir = quote(dir),
        runtime = quote(runtime),
    )
}

/// The members of the process group `leader` leads (zombies left out), with their names.
pub fn group_members(leader: u32) -> Vec<(u32, String)> {
    crate::procfs::all()
        .into_iter()
        .filter(|p| p.pgid == leader && p.state != 'Z')
        .map(|p| (p.pid, p.name))
        .collect()
}

/// Fails the next armed writes of each store, and counts every failure it caused.
#[derive(Debug, Default)]
pub struct ChaosDisk {
    armed_bindings: AtomicU32,
    armed_transcript: AtomicU32,
    errno: AtomicU32,
    failed_bindings: AtomicU64,
    failed_transcript: AtomicU64,
}

impl ChaosDisk {
    /// The next `writes` writes of `store` fail with `errno`.
    pub fn arm(&self, store: Store, writes: u32, errno: i32) {
        self.errno.store(errno as u32, Ordering::SeqCst);
        self.armed(store).fetch_add(writes, Ordering::SeqCst);
    }

    /// Failures caused, by store.
    pub fn failed(&self, store: Store) -> u64 {
        match store {
            Store::Bindings => self.failed_bindings.load(Ordering::SeqCst),
            _ => self.failed_transcript.load(Ordering::SeqCst),
        }
    }

    fn armed(&self, store: Store) -> &AtomicU32 {
        match store {
            Store::Bindings => &self.armed_bindings,
            _ => &self.armed_transcript,
        }
    }
}

impl DiskFaults for ChaosDisk {
    fn before_write(&self, store: Store) -> Option<io::Error> {
        let armed = self.armed(store);
        armed
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .ok()?;
        match store {
            Store::Bindings => self.failed_bindings.fetch_add(1, Ordering::SeqCst),
            _ => self.failed_transcript.fetch_add(1, Ordering::SeqCst),
        };
        Some(io::Error::from_raw_os_error(
            self.errno.load(Ordering::SeqCst) as i32,
        ))
    }
}

/// How many faults of each kind took effect.
#[derive(Debug, Default)]
pub struct Injected(Mutex<BTreeMap<FaultKind, u64>>);

impl Injected {
    pub fn add(&self, kind: FaultKind) {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *counts.entry(kind).or_default() += 1;
    }

    pub fn get(&self, kind: FaultKind) -> u64 {
        let counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        counts.get(&kind).copied().unwrap_or(0)
    }

    pub fn snapshot(&self) -> BTreeMap<&'static str, u64> {
        FaultKind::ALL
            .iter()
            .map(|k| (k.as_str(), self.get(*k)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_schedule() {
        let draw = |seed| {
            let mut s = Schedule::new(seed);
            (0..32)
                .map(|_| (s.next_kind(), s.pick(7), s.disk_error()))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn an_armed_disk_fails_exactly_the_writes_it_was_armed_for() {
        let disk = ChaosDisk::default();
        assert!(disk.before_write(Store::Bindings).is_none());
        disk.arm(Store::Bindings, 2, nix::libc::ENOSPC);
        assert!(disk.before_write(Store::Transcript).is_none());
        let error = disk.before_write(Store::Bindings).expect("armed");
        assert_eq!(error.raw_os_error(), Some(nix::libc::ENOSPC));
        assert!(disk.before_write(Store::Bindings).is_some());
        assert!(disk.before_write(Store::Bindings).is_none());
        assert_eq!(disk.failed(Store::Bindings), 2);
        assert_eq!(disk.failed(Store::Transcript), 0);
    }
}
