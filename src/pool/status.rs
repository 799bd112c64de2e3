//! A point-in-time snapshot of the pool, for the daemon, the demo and tests.

use serde::{Deserialize, Serialize};

/// A worker's state as the pool sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Takes new conversations.
    #[default]
    Live,
    /// Rotated away or recycled: takes nothing new, ends when its leases end.
    Draining,
    /// A warm spare: started and empty, or holding only conversations the pool resumed
    /// ahead of their return; kept for its key (traffic within `warm_spare_window`); the
    /// next lease of the key that finds no room takes it at once.
    Spare,
}

/// One worker in the snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[serde(default)]
#[non_exhaustive]
pub struct WorkerStatus {
    /// Short hash of the worker's key (no secret, no path).
    pub key_hash: String,
    /// The child's pid.
    pub pid: u32,
    /// Live, draining or spare.
    pub state: WorkerState,
    /// Conversations attached.
    pub conversations: usize,
    /// Conversations leased right now.
    pub leases: usize,
    /// Turns served.
    pub turns: u64,
    /// Crash restarts of its key so far.
    pub restarts: u64,
    /// Resident memory at the last maintenance tick.
    pub rss_bytes: u64,
    /// How it was primed, when it started ahead of demand (a warm spare, one more process
    /// for a busy key); absent for a start a lease waited for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primed: Option<crate::kinds::Priming>,
}

/// Counters since the pool started.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[serde(default)]
#[non_exhaustive]
pub struct PoolTotals {
    /// Processes started (first starts and restarts).
    pub processes_spawned: u64,
    /// Processes started to replace a crashed one.
    pub restarts: u64,
    /// Workers that died (crash, kill, hang, protocol violation).
    pub crashes: u64,
    /// Conversations resumed from a stored session.
    pub resumed: u64,
    /// Conversations that started a new CLI session.
    pub created: u64,
    /// Workers stopped by the pool (idle, full, drained, recycled).
    pub evicted: u64,
    /// Turns completed through leases.
    pub turns: u64,
}

impl WorkerState {
    /// As on the wire (`live`, `draining`, `spare`).
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Live => "live",
            WorkerState::Draining => "draining",
            WorkerState::Spare => "spare",
        }
    }
}

/// The process budget (`max_processes`) every backend shares, at one moment.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[serde(default)]
#[non_exhaustive]
pub struct ProcessBudget {
    /// The pool's cap on processes of every backend together.
    pub max_processes: usize,
    /// Processes counted against it now (the sum of `by_backend`).
    pub used: usize,
    /// Processes counted per backend id: `copilot` (workers, and starts in flight), and
    /// each CLI backend (its conversations holding a process slot, parked or leased).
    pub by_backend: std::collections::BTreeMap<String, usize>,
}

/// The pool at one moment. Serialized once for every reader: `GET /v1/pool` sends it as it
/// is and `copilot-pool status` reads it back.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "http", derive(utoipa::ToSchema))]
#[serde(default)]
#[non_exhaustive]
pub struct PoolStatus {
    /// Every worker (`processes` on the wire).
    #[serde(rename = "processes")]
    pub workers: Vec<WorkerStatus>,
    /// Leases waiting for capacity, of every backend (Copilot workers and CLI backends).
    pub waiters: usize,
    /// Conversations attached to workers.
    pub conversations: usize,
    /// Conversations leased right now.
    pub leased: usize,
    /// Keys in their restart cool-down.
    pub quarantined_keys: Vec<String>,
    /// No new leases are accepted: the pool (or the daemon around it) is shutting down
    /// (`draining` on the wire).
    #[serde(rename = "draining")]
    pub closed: bool,
    /// Counters.
    pub totals: PoolTotals,
    /// The process budget shared by every backend.
    pub budget: ProcessBudget,
}

/// Something the pool did, as it happens (for the demo, the daemon and tests).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
#[non_exhaustive]
pub enum PoolEvent {
    /// A worker process started (`restart`: it replaces a crashed one).
    WorkerStarted {
        /// The key's short hash.
        key_hash: String,
        /// The child's pid.
        pid: u32,
        /// Replaces a crashed worker.
        restart: bool,
        /// How it was primed, when it started ahead of demand (a warm spare, one more
        /// process for a busy key); `None` for a start a lease waited for.
        primed: Option<crate::kinds::Priming>,
    },
    /// A worker died (crash, kill, hang, protocol violation).
    WorkerCrashed {
        /// The key's short hash.
        key_hash: String,
        /// The child's pid.
        pid: u32,
    },
    /// The pool stopped a worker (idle, full, drained after rotation or recycling).
    WorkerEvicted {
        /// The key's short hash.
        key_hash: String,
        /// The child's pid.
        pid: u32,
        /// Why (`reason.describe()` in words).
        reason: crate::kinds::Eviction,
    },
    /// A key crashed too often and is in its cool-down.
    KeyQuarantined {
        /// The key's short hash.
        key_hash: String,
    },
    /// A lease opened its conversation.
    ConversationOpened {
        /// The worker's pid.
        pid: u32,
        /// How.
        reason: super::lease::OpenReason,
    },
}
