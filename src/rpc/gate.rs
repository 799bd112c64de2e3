//! Session events nobody reads, dropped where the connection's reader meets them.
//!
//! The runtime writes two kinds of events every turn that the pool never reads on a lease's
//! turn (only a spare's priming, which registers nothing, looks at `model.*`): its
//! internal `model.*` events (among them a snapshot of the whole conversation, tens of KiB,
//! once a turn) and `system.message` (its system prompt, 8-20 KiB by the tools it describes,
//! every turn). Over half of a tool turn's bytes; read, copied and routed, they were a sixth
//! of the daemon's instructions a warm turn, for a gateway that leaves them out of its stream
//! (`omit_events`) anyway. A caller that says which event types it never reads ([`UnreadEvents`]) has those
//! of them the pool does not read either ([`unread_by_the_pool`]) dropped by the reader: the
//! frame's head names the session and the event's type as the runtime writes them
//! ([`runtime_head`]), and the rest of the frame is never parsed, copied or routed (nor
//! checked: a malformed one is dropped unread, not reported as a broken stream).
//!
//! Owns: the per-connection table of sessions whose callers left types unread, and the test of
//! a frame's head. Knows nothing of leases, turns or HTTP; the turn driver registers a lease's
//! types ([`EventGate::leave_unread`]) and takes the time of the last drop as the runtime's
//! activity ([`UnreadGuard::last_dropped`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::events::{leading_type, plain_string};
use crate::panic_guard::call_guarded_now;

/// Which session event types a caller never reads (`true`: leave it unread). Only the types
/// the pool does not read either ([`unread_by_the_pool`]) are ever dropped. It runs on the
/// connection's reader, once for each such frame of the caller's session: it must be cheap
/// and must not block.
pub type UnreadEvents = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Whether the pool itself never reads events of `event_type` on a lease's turn: the
/// runtime's internal `model.*` events (in no schema) and its system prompt
/// (`system.message`). Everything a turn acts on (tool calls, permission prompts, usage,
/// messages for the transcript, idle, errors, compaction) is of other types.
pub fn unread_by_the_pool(event_type: &str) -> bool {
    event_type.starts_with("model.") || event_type == "system.message"
}

/// One connection's sessions whose callers leave some event types unread.
#[derive(Default)]
pub(crate) struct EventGate {
    sessions: Mutex<HashMap<String, Registration>>,
}

/// One session's registration: what its caller leaves unread, and when the last of it was
/// dropped (shared with its guard, which tells its own registration from a later one by it).
struct Registration {
    unread: UnreadEvents,
    last_drop: Arc<LastDrop>,
}

/// When a registration's last event was dropped.
struct LastDrop {
    /// When the registration was made.
    since: Instant,
    /// Nanoseconds from `since` to the last drop, at least 1; 0 before the first.
    ns: AtomicU64,
}

impl EventGate {
    /// Leaves the event types `unread` names (those the pool does not read either) of
    /// `session_id` unread until the returned guard is dropped. A later registration of the
    /// same session replaces this one.
    pub(crate) fn leave_unread(
        self: &Arc<Self>,
        session_id: &str,
        unread: UnreadEvents,
    ) -> UnreadGuard {
        let last_drop = Arc::new(LastDrop {
            since: Instant::now(),
            ns: AtomicU64::new(0),
        });
        if let Ok(mut sessions) = self.sessions.lock() {
            let last_drop = last_drop.clone();
            sessions.insert(session_id.to_owned(), Registration { unread, last_drop });
        }
        UnreadGuard {
            gate: Arc::downgrade(self),
            session_id: session_id.to_owned(),
            last_drop,
        }
    }

    /// Drops `frame` (answers `true`, and records when) when it is a `session.event` of a
    /// registered session whose type its caller and the pool leave unread. A frame whose
    /// head is not as the runtime writes it is never dropped: it is read as any other.
    pub(crate) fn drop_if_unread(&self, frame: &[u8]) -> bool {
        let Some((session_id, event_type)) = runtime_head(frame) else {
            return false;
        };
        if !unread_by_the_pool(event_type) {
            return false;
        }
        // The caller's test runs outside the lock; one that panics leaves the event read.
        let Some((unread, last_drop)) = self.sessions.lock().ok().and_then(|sessions| {
            let r = sessions.get(session_id)?;
            Some((r.unread.clone(), r.last_drop.clone()))
        }) else {
            return false;
        };
        match call_guarded_now(|| unread(event_type)) {
            Ok(true) => {}
            Ok(false) => return false,
            Err(panicked) => {
                tracing::debug!(%panicked, event_type, "A lease's unread-events test panicked; the event is read.");
                return false;
            }
        }
        let ns = u64::try_from(last_drop.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        last_drop.ns.store(ns.max(1), Ordering::Relaxed);
        crate::metrics::session_event_unread();
        true
    }

    fn release(&self, session_id: &str, last_drop: &Arc<LastDrop>) {
        if let Ok(mut sessions) = self.sessions.lock()
            && sessions
                .get(session_id)
                .is_some_and(|r| Arc::ptr_eq(&r.last_drop, last_drop))
        {
            sessions.remove(session_id);
        }
    }
}

/// A session's unread types, registered until dropped.
pub(crate) struct UnreadGuard {
    gate: std::sync::Weak<EventGate>,
    session_id: String,
    last_drop: Arc<LastDrop>,
}

impl UnreadGuard {
    /// When the last of the session's events was dropped unread (`None` before the first):
    /// the runtime was active then, although its caller heard nothing.
    pub(crate) fn last_dropped(&self) -> Option<Instant> {
        match self.last_drop.ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(self.last_drop.since + Duration::from_nanos(ns)),
        }
    }
}

impl Drop for UnreadGuard {
    fn drop(&mut self) {
        if let Some(gate) = self.gate.upgrade() {
            gate.release(&self.session_id, &self.last_drop);
        }
    }
}

/// The session id and event type at the head of `frame` when it begins exactly as the
/// runtime writes a `session.event` notification,
/// `{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":"…","event":{"type":"…"`,
/// both plain strings (no escapes), and ends as one, `}}}` (a request, whose `id` would
/// follow its params, is answered, never dropped); `None` for any other frame.
pub(crate) fn runtime_head(frame: &[u8]) -> Option<(&str, &str)> {
    if !frame.trim_ascii_end().ends_with(b"}}}") {
        return None;
    }
    const HEAD: &[u8] = br#"{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":""#;
    let rest = frame.strip_prefix(HEAD)?;
    let (session_id, rest) = plain_string(rest)?;
    let event_type = leading_type(rest.strip_prefix(br#","event":"#)?)?;
    Some((session_id, event_type))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SESSION: &str = "1ab6325f-e147-417d-bd24-347caa60f3cb";

    fn event(session: &str, event_type: &str) -> Vec<u8> {
        format!(
            r#"{{"jsonrpc":"2.0","method":"session.event","params":{{"sessionId":"{session}","event":{{"type":"{event_type}","data":{{"x":1}},"id":"e1"}}}}}}"#
        )
        .into_bytes()
    }

    fn all() -> UnreadEvents {
        Arc::new(|_| true)
    }

    #[test]
    fn the_head_of_a_runtime_event_names_its_session_and_type() {
        let frame = event(SESSION, "model.messages_snapshot");
        assert_eq!(
            runtime_head(&frame),
            Some((SESSION, "model.messages_snapshot"))
        );
    }

    #[test]
    fn a_head_written_otherwise_is_not_read() {
        for frame in [
            // Members in another order, spaces, an escape, another method, a request.
            r#"{"method":"session.event","jsonrpc":"2.0","params":{"sessionId":"s","event":{"type":"model.x"}}}"#,
            r#"{"jsonrpc": "2.0","method":"session.event","params":{"sessionId":"s","event":{"type":"model.x"}}}"#,
            r#"{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":"s\"","event":{"type":"model.x"}}}"#,
            r#"{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":"s","event":{"type":"model\u002ex"}}}"#,
            r#"{"jsonrpc":"2.0","method":"session.event","params":{"event":{"type":"model.x"},"sessionId":"s"}}"#,
            r#"{"jsonrpc":"2.0","method":"session.eventx","params":{"sessionId":"s","event":{"type":"model.x"}}}"#,
            r#"{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":"s","event":{"id":"e","type":"model.x"}}}"#,
            r#"{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":"s"#,
            // A request: its id after its params.
            r#"{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":"s","event":{"type":"model.x"}},"id":7}"#,
        ] {
            assert_eq!(runtime_head(frame.as_bytes()), None, "{frame}");
        }
    }

    #[test]
    fn only_types_the_caller_and_the_pool_both_leave_unread_are_dropped_and_timed() {
        let gate = Arc::new(EventGate::default());
        let guard = gate.leave_unread(SESSION, Arc::new(|t: &str| t != "model.call_start"));
        assert_eq!(guard.last_dropped(), None);
        assert!(gate.drop_if_unread(&event(SESSION, "model.messages_snapshot")));
        assert!(gate.drop_if_unread(&event(SESSION, "system.message")));
        // The caller reads it.
        assert!(!gate.drop_if_unread(&event(SESSION, "model.call_start")));
        // The pool reads them, whatever the caller says.
        for read_by_the_pool in [
            "external_tool.requested",
            "permission.requested",
            "assistant.message",
            "assistant.usage",
            "session.idle",
            "session.error",
            "modelx.y",
        ] {
            assert!(
                !gate.drop_if_unread(&event(SESSION, read_by_the_pool)),
                "{read_by_the_pool}"
            );
        }
        // Another session's.
        assert!(!gate.drop_if_unread(&event("another", "model.messages_snapshot")));
        let last = guard.last_dropped().expect("dropped");
        assert!(last <= Instant::now());
    }

    #[test]
    fn a_caller_test_that_panics_leaves_the_event_read_and_the_gate_working() {
        let gate = Arc::new(EventGate::default());
        let guard = gate.leave_unread(
            SESSION,
            Arc::new(|t: &str| {
                assert_ne!(t, "system.message", "a caller's bug");
                true
            }),
        );
        assert!(!gate.drop_if_unread(&event(SESSION, "system.message")));
        assert_eq!(guard.last_dropped(), None);
        assert!(gate.drop_if_unread(&event(SESSION, "model.call_start")));
        assert!(guard.last_dropped().is_some());
    }

    #[test]
    fn nothing_is_dropped_once_the_guard_is_gone_and_a_stale_guard_leaves_a_newer_registration() {
        let gate = Arc::new(EventGate::default());
        let frame = event(SESSION, "system.message");
        drop(gate.leave_unread(SESSION, all()));
        assert!(!gate.drop_if_unread(&frame));
        assert!(gate.sessions.lock().expect("lock").is_empty());

        let old = gate.leave_unread(SESSION, all());
        let new = gate.leave_unread(SESSION, all());
        drop(old);
        assert!(gate.drop_if_unread(&frame), "the newer registration stands");
        assert!(new.last_dropped().is_some());
        drop(new);
        assert!(!gate.drop_if_unread(&frame));
    }
}
