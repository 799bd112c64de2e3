//! Faults injected on purpose, for chaos runs: a [`DiskFaults`] plan that the pool consults
//! before each durable write (a conversation's binding, a transcript line), so a run can make
//! those writes fail with `ENOSPC` or `EIO` the way a full or failing disk would, and check that
//! nothing is lost or torn. The library never makes one itself: without a plan (the default)
//! every write goes to the disk as it is.
//!
//! A plan only decides; the store it is handed to fails its write with the returned error on
//! the path a real failure takes (a binding write answers the lease with `state_unwritable`,
//! a transcript write is rolled back and, in best-effort mode, skipped), and counts it in
//! [`crate::metrics::STORAGE_WRITE_FAILURES_TOTAL`] like a real one.

use std::fmt;
use std::io;
use std::sync::Arc;

/// A store whose writes a [`DiskFaults`] plan may fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Store {
    /// A conversation's binding (`<state_dir>/bindings`).
    Bindings,
    /// A transcript line (`copilot-<sessionId>.jsonl`).
    Transcript,
    /// The ledger of runtime process groups (`<state_dir>/process-groups.json`).
    ProcessGroups,
}

impl Store {
    /// `bindings`, `transcript` or `process_groups`: the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Store::Bindings => "bindings",
            Store::Transcript => "transcript",
            Store::ProcessGroups => "process_groups",
        }
    }
}

/// Decides, write by write, whether a durable write fails. Called on the thread doing the
/// write, just before it; must be cheap and must not block.
pub trait DiskFaults: Send + Sync + fmt::Debug {
    /// The error to fail this write of `store` with, or `None` to write.
    fn before_write(&self, store: Store) -> Option<io::Error>;
}

/// A shared plan, as configs carry it.
pub type SharedDiskFaults = Arc<dyn DiskFaults>;

/// Asks `plan` (if any) about a write of `store`: `Err` with its error if the write must fail.
pub(crate) fn check(plan: Option<&SharedDiskFaults>, store: Store) -> io::Result<()> {
    match plan.and_then(|p| p.before_write(store)) {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct NoSpace;

    impl DiskFaults for NoSpace {
        fn before_write(&self, store: Store) -> Option<io::Error> {
            (store == Store::Transcript).then(|| io::Error::from_raw_os_error(nix::libc::ENOSPC))
        }
    }

    #[test]
    fn without_a_plan_every_write_goes_ahead() {
        assert!(check(None, Store::Bindings).is_ok());
    }

    #[test]
    fn a_plan_fails_only_the_writes_it_names() {
        let plan: SharedDiskFaults = Arc::new(NoSpace);
        assert!(check(Some(&plan), Store::Bindings).is_ok());
        let error = check(Some(&plan), Store::Transcript).expect_err("no space");
        assert_eq!(error.raw_os_error(), Some(nix::libc::ENOSPC));
    }
}
