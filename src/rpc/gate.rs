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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// Whether any session is registered: the reader looks no further when none is.
    armed: AtomicBool,
    sessions: Mutex<HashMap<String, Registration>>,
    next_token: AtomicU64,
}

struct Registration {
    /// Tells one registration of a session id from a later one.
    token: u64,
    unread: UnreadEvents,
    dropped: Arc<Dropped>,
}

/// What was dropped of one registration's session: how many, and when the last.
struct Dropped {
    count: AtomicU64,
    /// When the registration was made: [`Dropped::last_ns`] counts from it.
    since: Instant,
    /// Nanoseconds from `since` to the last drop.
    last_ns: AtomicU64,
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
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let dropped = Arc::new(Dropped {
            count: AtomicU64::new(0),
            since: Instant::now(),
            last_ns: AtomicU64::new(0),
        });
        if let Ok(mut sessions) = self.sessions.lock() {
            sessions.insert(
                session_id.to_owned(),
                Registration {
                    token,
                    unread,
                    dropped: dropped.clone(),
                },
            );
            self.armed.store(true, Ordering::Release);
        }
        UnreadGuard {
            gate: Arc::downgrade(self),
            session_id: session_id.to_owned(),
            token,
            dropped,
        }
    }

    /// Drops `frame` (answers `true`, and records the drop's count and time) when it is a
    /// `session.event` of a registered session whose type its caller and the pool leave
    /// unread. A frame whose head is not as
    /// the runtime writes it is never dropped: it is read as any other.
    pub(crate) fn drop_if_unread(&self, frame: &[u8]) -> bool {
        if !self.armed.load(Ordering::Acquire) {
            return false;
        }
        let Some((session_id, event_type)) = runtime_head(frame) else {
            return false;
        };
        if !unread_by_the_pool(event_type) {
            return false;
        }
        // The caller's test runs outside the lock, and a panic in it reads nothing as
        // unread: the reader goes on.
        let Some((unread, dropped)) = self.sessions.lock().ok().and_then(|sessions| {
            let r = sessions.get(session_id)?;
            Some((r.unread.clone(), r.dropped.clone()))
        }) else {
            return false;
        };
        let leave = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unread(event_type)));
        if leave.unwrap_or(false) {
            let ns = u64::try_from(dropped.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
            dropped.last_ns.store(ns, Ordering::Relaxed);
            dropped.count.fetch_add(1, Ordering::Release);
            return true;
        }
        false
    }

    fn release(&self, session_id: &str, token: u64) {
        if let Ok(mut sessions) = self.sessions.lock() {
            if sessions.get(session_id).is_some_and(|r| r.token == token) {
                sessions.remove(session_id);
            }
            self.armed.store(!sessions.is_empty(), Ordering::Release);
        }
    }
}

/// A session's unread types, registered until dropped.
pub(crate) struct UnreadGuard {
    gate: std::sync::Weak<EventGate>,
    session_id: String,
    token: u64,
    dropped: Arc<Dropped>,
}

impl UnreadGuard {
    /// How many of the session's events were dropped unread so far.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.count.load(Ordering::Acquire)
    }

    /// When the last of them was dropped (`None` before the first): the runtime was active
    /// then, although its caller heard nothing.
    pub(crate) fn last_dropped(&self) -> Option<Instant> {
        if self.dropped() == 0 {
            return None;
        }
        let ns = self.dropped.last_ns.load(Ordering::Relaxed);
        Some(self.dropped.since + Duration::from_nanos(ns))
    }
}

impl Drop for UnreadGuard {
    fn drop(&mut self) {
        if let Some(gate) = self.gate.upgrade() {
            gate.release(&self.session_id, self.token);
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
    const EVENT: &[u8] = br#"","event":{"type":""#;
    let rest = frame.strip_prefix(HEAD)?;
    let (session_id, rest) = plain_string(rest)?;
    let rest = rest.strip_prefix(EVENT)?;
    let (event_type, _) = plain_string(rest)?;
    Some((session_id, event_type))
}

/// The text up to the next `"` when it has no escape or control character, and what follows
/// from that quote on.
fn plain_string(text: &[u8]) -> Option<(&str, &[u8])> {
    let end = text
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
    if text[end] != b'"' {
        return None;
    }
    let value = std::str::from_utf8(&text[..end]).ok()?;
    Some((value, &text[end..]))
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
    fn only_types_the_caller_and_the_pool_both_leave_unread_are_dropped_and_counted() {
        let gate = Arc::new(EventGate::default());
        let guard = gate.leave_unread(SESSION, Arc::new(|t: &str| t != "model.call_start"));
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
        assert_eq!(guard.dropped(), 2);
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
        assert!(gate.drop_if_unread(&event(SESSION, "model.call_start")));
        assert_eq!(guard.dropped(), 1);
    }

    #[test]
    fn nothing_is_dropped_once_the_guard_is_gone_and_a_stale_guard_leaves_a_newer_registration() {
        let gate = Arc::new(EventGate::default());
        let frame = event(SESSION, "system.message");
        drop(gate.leave_unread(SESSION, all()));
        assert!(!gate.drop_if_unread(&frame));
        assert!(!gate.armed.load(Ordering::Acquire));

        let old = gate.leave_unread(SESSION, all());
        let new = gate.leave_unread(SESSION, all());
        drop(old);
        assert!(gate.drop_if_unread(&frame), "the newer registration stands");
        assert_eq!(new.dropped(), 1);
        drop(new);
        assert!(!gate.drop_if_unread(&frame));
    }
}
