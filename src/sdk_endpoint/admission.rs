//! Room for connections. Those that have not authenticated yet ([`Admission`]): at most
//! [`super::SdkConfig::max_unauthenticated_connections`] at once. A new connection past that
//! takes the slot of the oldest, which is closed: a real client sends `connect` within
//! milliseconds of connecting, so the oldest is the likeliest to be one that never will, and
//! clients that open connections and send nothing cannot keep the agents' clients out (a
//! refusal instead would let 64 idle sockets, reopened every `connect_timeout`, shut out
//! every new client). A slot is given back when its connection authenticates or closes.
//!
//! Those of one agent ([`AgentSeats`]): at most
//! [`super::SdkConfig::max_connections_per_agent`] authenticated at once, so one agent's
//! clients cannot take every connection the endpoint allows from the others. Past it the
//! agent's `connect` is refused (its open connections go on); a seat is given back when its
//! connection closes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

/// The connections waiting to authenticate, oldest first.
#[derive(Debug)]
pub(super) struct Admission {
    max: usize,
    state: Mutex<Waiting>,
}

#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    /// Each waiting connection's ticket and the sender that closes it.
    queue: VecDeque<(u64, watch::Sender<bool>)>,
}

/// One connection's slot among those waiting to authenticate: `displaced` turns `true` when
/// a newer connection took it; dropping the slot (at `connect`, or as the connection closes)
/// gives it back.
#[derive(Debug)]
pub(super) struct Slot {
    admission: Arc<Admission>,
    ticket: u64,
    /// Turns `true` when a newer connection took this slot: close the connection.
    pub(super) displaced: watch::Receiver<bool>,
}

impl Admission {
    /// Room for `max` waiting connections (at least one).
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(Admission {
            max: max.max(1),
            state: Mutex::new(Waiting::default()),
        })
    }

    /// A slot for a new connection; when every slot is taken, the oldest waiting connection
    /// is told to close (returns whether one was).
    pub(super) fn admit(self: &Arc<Self>) -> (Slot, bool) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut displaced_one = false;
        while state.queue.len() >= self.max {
            if let Some((_, oldest)) = state.queue.pop_front() {
                oldest.send_replace(true);
                displaced_one = true;
            }
        }
        let ticket = state.next;
        state.next += 1;
        let (tx, rx) = watch::channel(false);
        state.queue.push_back((ticket, tx));
        let slot = Slot {
            admission: self.clone(),
            ticket,
            displaced: rx,
        };
        (slot, displaced_one)
    }

    /// How many connections wait to authenticate.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .queue
            .len()
    }
}

/// Authenticated connections per agent.
#[derive(Debug)]
pub(super) struct AgentSeats {
    max: usize,
    taken: Mutex<HashMap<String, usize>>,
}

/// One authenticated connection's seat among its agent's; dropping it gives it back.
#[derive(Debug)]
pub(super) struct Seat {
    seats: Arc<AgentSeats>,
    agent: String,
}

impl AgentSeats {
    /// Room for `max` connections of each agent (at least one).
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(AgentSeats {
            max: max.max(1),
            taken: Mutex::new(HashMap::new()),
        })
    }

    /// The most connections one agent may hold.
    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// A seat for one more connection of `agent`; `None` when it holds `max` already.
    pub(super) fn take(self: &Arc<Self>, agent: &str) -> Option<Seat> {
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        let held = taken.entry(agent.to_owned()).or_insert(0);
        if *held >= self.max {
            return None;
        }
        *held += 1;
        Some(Seat {
            seats: self.clone(),
            agent: agent.to_owned(),
        })
    }

    /// How many connections `agent` holds.
    #[cfg(test)]
    fn held(&self, agent: &str) -> usize {
        self.taken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(agent)
            .copied()
            .unwrap_or(0)
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut taken = self
            .seats
            .taken
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = taken.get_mut(&self.agent) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                taken.remove(&self.agent);
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = self
            .admission
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        state.queue.retain(|(ticket, _)| *ticket != self.ticket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_agent_holds_at_most_its_seats_and_a_closed_connection_gives_its_seat_back() {
        let seats = AgentSeats::new(2);
        let first = seats.take("agent-a").expect("a first seat");
        let _second = seats.take("agent-a").expect("a second seat");
        assert!(seats.take("agent-a").is_none(), "past the cap");
        let _other = seats
            .take("agent-b")
            .expect("another agent has seats of its own");
        drop(first);
        assert_eq!(seats.held("agent-a"), 1);
        let _third = seats.take("agent-a").expect("the seat given back");
        assert!(seats.take("agent-a").is_none());
        assert_eq!(AgentSeats::new(0).max(), 1, "0 counts as 1");
    }

    #[test]
    fn a_new_connection_past_the_cap_takes_the_oldest_waiting_ones_slot() {
        let admission = Admission::new(2);
        let (first, displaced) = admission.admit();
        assert!(!displaced);
        let (second, _) = admission.admit();
        let (third, displaced) = admission.admit();
        assert!(displaced, "the oldest was told to close");
        assert!(*first.displaced.borrow());
        assert!(!*second.displaced.borrow() && !*third.displaced.borrow());
        assert_eq!(admission.waiting(), 2);
        // A connection that authenticates (or closes) gives its slot back: the next one
        // displaces nobody.
        drop(second);
        let (_fourth, displaced) = admission.admit();
        assert!(!displaced);
        assert!(!*third.displaced.borrow());
        // The displaced connection's own drop finds its slot already taken.
        drop(first);
        assert_eq!(admission.waiting(), 2);
    }
}
