//! Room for connections that have not authenticated yet: at most
//! [`super::SdkConfig::max_unauthenticated_connections`] at once. A new connection past that
//! takes the slot of the oldest, which is closed: a real client sends `connect` within
//! milliseconds of connecting, so the oldest is the likeliest to be one that never will, and
//! clients that open connections and send nothing cannot keep the agents' clients out (a
//! refusal instead would let 64 idle sockets, reopened every `connect_timeout`, shut out
//! every new client). A slot is given back when its connection authenticates or closes.

use std::collections::VecDeque;
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
