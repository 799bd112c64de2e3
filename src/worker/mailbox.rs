//! What the connection's reader has handed the worker actor and the actor has not handled
//! yet, in bytes: the reader only checks a frame's text and hands it on without waiting,
//! while the actor decodes and routes it, so a runtime writing faster than the actor routes
//! would grow the actor's mailbox without bound, unweighed by the routes' flood limits
//! (which see an update only once the actor routes it).
//!
//! [`MailboxBytes::admit`] counts a batch in as the reader hands it on; past the limit the
//! batch is dropped (an incoming request's responder answers it with an error as it drops)
//! and the first such batch says so, for the actor to end the runtime as a protocol
//! violation once it gets there. [`MailboxBytes::handled`] counts a batch out.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::session::LEAST_UNREAD_WEIGHT;
use crate::rpc::Incoming;

/// What becomes of a batch the reader hands on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// Within the limit: pass it on.
    Pass,
    /// The first batch past the limit (with what was waiting then): drop it, and tell the
    /// actor the runtime flooded it.
    FirstOver(usize),
    /// Past the limit already: drop it.
    Drop,
}

/// The bytes waiting in a worker actor's mailbox, and its limit.
#[derive(Debug)]
pub(super) struct MailboxBytes {
    waiting: AtomicUsize,
    max: usize,
    over: AtomicBool,
}

impl MailboxBytes {
    /// An empty mailbox that holds at most `max` bytes.
    pub(super) fn new(max: usize) -> Self {
        Self {
            waiting: AtomicUsize::new(0),
            max,
            over: AtomicBool::new(false),
        }
    }

    /// The most bytes it holds.
    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// Counts in a batch of `weight` bytes the reader is about to hand on. A batch finding
    /// the mailbox empty always passes (one batch is at most 64 frames, each within the
    /// frame limit): the limit is on what piles up.
    pub(super) fn admit(&self, weight: usize) -> Admit {
        if self.over.load(Ordering::Acquire) {
            return Admit::Drop;
        }
        let before = self.waiting.fetch_add(weight, Ordering::AcqRel);
        if weight == 0 || before == 0 || before.saturating_add(weight) <= self.max {
            return Admit::Pass;
        }
        self.waiting.fetch_sub(weight, Ordering::AcqRel);
        if self.over.swap(true, Ordering::AcqRel) {
            Admit::Drop
        } else {
            Admit::FirstOver(before)
        }
    }

    /// Counts out a batch of `weight` bytes the actor has handled.
    pub(super) fn handled(&self, weight: usize) {
        // Never below zero, whatever the order of the updates.
        let _ = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |waiting| {
                Some(waiting.saturating_sub(weight))
            });
    }
}

/// What a batch weighs while it waits: the text of each event, notification and request it
/// holds (a request as its frame was charged: `IncomingRequest::frame_bytes`), each at least
/// [`LEAST_UNREAD_WEIGHT`], as the routes weigh an update (what holds it takes that much
/// however short its text). The end of the stream weighs nothing: it always passes.
pub(super) fn batch_weight(batch: &[Incoming]) -> usize {
    batch
        .iter()
        .map(|incoming| {
            match incoming {
                Incoming::SessionEvent { session_id, event } => {
                    session_id.len() + event.get().len()
                }
                Incoming::Notification { method, params } => method.len() + params.get().len(),
                Incoming::Request(request) => request.frame_bytes,
                Incoming::Closed(_) => return 0,
            }
            .max(LEAST_UNREAD_WEIGHT)
        })
        .fold(0, usize::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_pass_within_the_limit_and_the_first_past_it_says_so_once() {
        let mailbox = MailboxBytes::new(100);
        assert_eq!(mailbox.admit(60), Admit::Pass);
        assert_eq!(mailbox.admit(40), Admit::Pass);
        // Handled, room comes back.
        mailbox.handled(60);
        assert_eq!(mailbox.admit(50), Admit::Pass);
        // 90 waiting: 20 more is past the limit, and only the first says so.
        assert_eq!(mailbox.admit(20), Admit::FirstOver(90));
        assert_eq!(mailbox.admit(1), Admit::Drop);
        // Once over, nothing passes again (the runtime is being ended).
        mailbox.handled(90);
        assert_eq!(mailbox.admit(1), Admit::Drop);
    }

    #[test]
    fn handled_never_counts_below_zero() {
        let mailbox = MailboxBytes::new(10);
        mailbox.handled(5);
        assert_eq!(mailbox.admit(10), Admit::Pass);
    }

    #[test]
    fn a_batch_larger_than_the_limit_passes_into_an_empty_mailbox_only() {
        let mailbox = MailboxBytes::new(10);
        assert_eq!(mailbox.admit(50), Admit::Pass);
        // The end of the stream (weight 0) always passes: a runtime that wrote one large
        // batch and exited is reported as exited.
        assert_eq!(mailbox.admit(0), Admit::Pass);
        assert_eq!(mailbox.admit(50), Admit::FirstOver(50));
    }

    #[test]
    fn each_item_weighs_at_least_what_holding_it_takes_and_the_end_weighs_nothing() {
        let note = Incoming::Notification {
            method: "x".to_owned(),
            params: serde_json::value::RawValue::from_string("{}".to_owned()).unwrap(),
        };
        assert_eq!(batch_weight(&[note]), LEAST_UNREAD_WEIGHT);
        let end = Incoming::Closed(crate::rpc::CloseCause::Eof);
        assert_eq!(batch_weight(&[end]), 0);
    }
}
