//! The output-limit checks every CLI backend's end-to-end test shares (issue 17, item 5): a
//! turn past its retained-output limit ends `error` with the typed
//! [`TurnFailure::OutputLimit`] naming the key and limit, counts what it retained, and takes
//! its process (group) with it.

use std::time::Duration;

use copilot_pool::TurnEnd;
use copilot_pool::backend::{CliTurnOutcome, TurnFailure};

use super::procs::wait_group_gone;

/// `outcome` is a turn that passed `maxTurnLines` = `limit`, having retained `retained`
/// lines (the one that passed it included), and the process group `pid` is gone.
pub async fn assert_past_line_limit(outcome: &CliTurnOutcome, limit: u64, retained: u64, pid: u32) {
    assert_eq!(outcome.end, Some(TurnEnd::Error), "{outcome:?}");
    assert!(
        matches!(
            outcome.failure,
            Some(TurnFailure::OutputLimit { key: "maxTurnLines", limit: l, .. }) if l == limit
        ),
        "a typed line-limit failure at {limit}: {outcome:?}"
    );
    assert_eq!(outcome.retained_lines, retained, "{outcome:?}");
    let left = wait_group_gone(pid, Duration::from_secs(10)).await;
    assert!(left.is_empty(), "the turn's process is left: {left:?}");
}
