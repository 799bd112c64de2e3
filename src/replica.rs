//! Which replica serves an agent when a gateway runs several `copilot-pool serve` daemons.
//!
//! One daemon keeps an agent's state on its own disk: the agent's home
//! (`<agents_dir>/agents/<agent_id>/copilot`, where the runtime keeps each conversation's
//! `session-state`) and the bindings (`session_key` → CLI session id) in its `state_dir`.
//! Run N daemons as a Kubernetes StatefulSet with one volume per replica, and every agent
//! must keep going to the same replica, or its conversations would be started afresh on a
//! volume that has never seen them.
//!
//! The gateway therefore picks the replica with *rendezvous* (highest random weight)
//! hashing of the agent id over the replicas' names, e.g. the StatefulSet's pod names
//! `copilot-pool-0` … `copilot-pool-{N-1}` (reachable through the headless Service as
//! `copilot-pool-0.<headless-service>.<namespace>.svc`):
//!
//! * every (replica, agent) pair gets a weight, [`replica_weight`]: the first 8 bytes,
//!   big-endian, of `sha256(replica + "\0" + agent_id)` (UTF-8 bytes; `"\0"` is one zero byte);
//! * the agent goes to the replica with the highest weight; equal weights (practically
//!   never) go to the replica whose name sorts first.
//!
//! No state, no ring and no coordination: every gateway instance, in any language, computes
//! the same answer from the same list. Adding a replica moves only the agents for which the
//! new replica now has the highest weight — about 1/N of them, and all of them *to* the new
//! replica; removing one moves only the agents it served. (Hashing `agent_id mod N` would
//! move nearly all of them.) An agent that moves starts its conversations anew on its new
//! replica (its bindings stay on the old volume), so change the replica count rarely.
//!
//! Route over the replicas that *should* exist (the StatefulSet's `replicas`), not over the
//! ones that are ready right now: a replica that restarts is briefly not ready, and sending
//! its agents elsewhere meanwhile would split their state over two volumes. Retry or fail
//! the turn instead.
//!
//! ```
//! use copilot_pool::replica::pick_replica;
//!
//! let pods: Vec<String> = (0..4).map(|i| format!("copilot-pool-{i}")).collect();
//! let pod = pick_replica("agent-1", &pods).unwrap();
//! assert!(pods.iter().any(|p| p == pod));
//! // Same input, same answer, on every gateway instance.
//! assert_eq!(pick_replica("agent-1", &pods), Some(pod));
//! assert_eq!(pick_replica("agent-1", &[]), None);
//! ```

use sha2::{Digest, Sha256};

/// The replica that serves `agent_id`: the one with the highest [`replica_weight`], ties
/// going to the name that sorts first. `None` when `replicas` is empty.
///
/// The order of `replicas` does not matter, and a name listed twice counts once.
pub fn pick_replica<'a>(agent_id: &str, replicas: &'a [String]) -> Option<&'a str> {
    pick_by(replicas, |replica| replica_weight(agent_id, replica))
}

/// The highest-weight replica under `weight`, ties to the name that sorts first.
fn pick_by(replicas: &[String], weight: impl Fn(&str) -> u64) -> Option<&str> {
    replicas
        .iter()
        .map(|replica| (weight(replica), replica.as_str()))
        .max_by(|(wa, na), (wb, nb)| wa.cmp(wb).then_with(|| nb.cmp(na)))
        .map(|(_, replica)| replica)
}

/// The rendezvous weight of `replica` for `agent_id`: the first 8 bytes, big-endian, of
/// SHA-256 over `replica`, one zero byte, then `agent_id`.
pub fn replica_weight(agent_id: &str, replica: &str) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(replica.as_bytes());
    hasher.update([0u8]);
    hasher.update(agent_id.as_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const AGENTS: usize = 10_000;

    fn pods(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("copilot-pool-{i}")).collect()
    }

    fn agents() -> Vec<String> {
        (0..AGENTS).map(|i| format!("agent-{i}")).collect()
    }

    fn assignment<'a>(agents: &[String], replicas: &'a [String]) -> Vec<&'a str> {
        agents
            .iter()
            .map(|a| pick_replica(a, replicas).expect("a replica"))
            .collect()
    }

    #[test]
    fn weight_matches_the_documented_formula() {
        // Computed independently: int.from_bytes(hashlib.sha256(
        //   (replica + "\0" + agent).encode()).digest()[:8], "big") in Python.
        assert_eq!(
            replica_weight("agent-1", "copilot-pool-0"),
            17_840_261_309_948_248_785
        );
        assert_eq!(
            replica_weight("agent-1", "copilot-pool-1"),
            11_287_919_522_220_308_837
        );
        assert_eq!(
            replica_weight("agent-1", "copilot-pool-2"),
            12_099_650_878_928_165_111
        );
        assert_eq!(pick_replica("agent-1", &pods(3)), Some("copilot-pool-0"));
        // The separator matters: ("ab", "c") and ("a", "bc") are different pairs.
        assert_ne!(replica_weight("c", "ab"), replica_weight("bc", "a"));
    }

    #[test]
    fn deterministic_and_independent_of_order() {
        let replicas = pods(5);
        let mut reversed = replicas.clone();
        reversed.reverse();
        for agent in agents().iter().take(500) {
            let first = pick_replica(agent, &replicas);
            assert_eq!(first, pick_replica(agent, &replicas));
            assert_eq!(first, pick_replica(agent, &reversed));
        }
        assert_eq!(
            replica_weight("agent-7", "copilot-pool-3"),
            replica_weight("agent-7", "copilot-pool-3")
        );
    }

    #[test]
    fn empty_and_single_replica() {
        assert_eq!(pick_replica("agent-1", &[]), None);
        let one = pods(1);
        assert_eq!(pick_replica("agent-1", &one), Some("copilot-pool-0"));
        assert_eq!(pick_replica("", &one), Some("copilot-pool-0"));
    }

    #[test]
    fn ties_go_to_the_name_that_sorts_first() {
        // SHA-256 gives no two names one weight on purpose, so tie with a constant weight.
        let mut replicas = vec![
            "copilot-pool-2".to_owned(),
            "copilot-pool-0".to_owned(),
            "copilot-pool-1".to_owned(),
        ];
        assert_eq!(pick_by(&replicas, |_| 7), Some("copilot-pool-0"));
        replicas.reverse();
        assert_eq!(pick_by(&replicas, |_| 7), Some("copilot-pool-0"));
        // A higher weight still wins over a name that sorts first.
        let weight = |r: &str| u64::from(r == "copilot-pool-2");
        assert_eq!(pick_by(&replicas, weight), Some("copilot-pool-2"));
        // A name listed twice is the same answer either way.
        let twice = vec!["copilot-pool-1".to_owned(), "copilot-pool-1".to_owned()];
        assert_eq!(pick_replica("agent-1", &twice), Some("copilot-pool-1"));
    }

    #[test]
    fn every_agent_maps_to_a_listed_replica_and_the_spread_is_even() {
        let replicas = pods(4);
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for replica in assignment(&agents(), &replicas) {
            assert!(replicas.iter().any(|r| r == replica), "{replica}");
            *counts.entry(replica).or_default() += 1;
        }
        assert_eq!(counts.len(), 4, "{counts:?}");
        for (replica, count) in &counts {
            let share = *count as f64 / AGENTS as f64;
            assert!(
                (0.20..=0.30).contains(&share),
                "{replica} has {share:.3} of the agents: {counts:?}"
            );
        }
    }

    #[test]
    fn adding_a_replica_moves_about_one_in_n_and_only_to_it() {
        let agents = agents();
        let before_replicas = pods(4);
        let after_replicas = pods(5);
        let before = assignment(&agents, &before_replicas);
        let after = assignment(&agents, &after_replicas);
        let mut moved = 0;
        for ((agent, from), to) in agents.iter().zip(&before).zip(&after) {
            if from != to {
                moved += 1;
                assert_eq!(*to, "copilot-pool-4", "{agent} moved from {from} to {to}");
            }
        }
        let share = moved as f64 / AGENTS as f64;
        assert!(
            (0.15..=0.25).contains(&share),
            "adding a 5th replica moved {share:.3} of the agents"
        );
    }

    #[test]
    fn removing_a_replica_moves_only_its_agents() {
        let agents = agents();
        let all = pods(5);
        let without: Vec<String> = all
            .iter()
            .filter(|r| *r != "copilot-pool-2")
            .cloned()
            .collect();
        let before = assignment(&agents, &all);
        let after = assignment(&agents, &without);
        let mut moved = 0;
        for ((agent, from), to) in agents.iter().zip(&before).zip(&after) {
            if *from == "copilot-pool-2" {
                moved += 1;
                assert_ne!(*to, "copilot-pool-2");
            } else {
                assert_eq!(from, to, "{agent} moved from {from} to {to}");
            }
        }
        assert!(moved > 0);
    }
}
