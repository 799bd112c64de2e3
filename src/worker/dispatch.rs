//! Dispatching what the child sends: `session.event`s (split off by the reader) to the
//! session they name
//! (recording pending tool calls and permission prompts in the ledger on the way), other
//! notifications naming a session (`session.lifecycle`, …) to it as they are, server requests
//! (`userInput.request`, `hooks.invoke` typed; `llmInference.*` to the tunnel; any other
//! request naming a session, e.g. `exitPlanMode.request` or `providerToken.getToken`, to that
//! session by method name), and a refusal for anything nobody can answer, so the runtime
//! never waits forever.

use ractor::ActorRef;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::rpc::IncomingRequest;
use crate::rpc::SessionEvent;
use crate::rpc::connection::{ErrorObject, INVALID_PARAMS};
use crate::rpc::events::EventKind;
use crate::rpc::messages::{
    HandlePendingPermission, HandlePendingToolCall, HookInvocation, HttpRequestChunk,
    HttpRequestStart, PermissionAnswer, ToolCallAnswer, UserInputRequest,
};

use super::actor::{WorkerMsg, WorkerState};
use super::error::WorkerError;
use super::handle::PendingKind;
use super::session::{ClientCall, ServerRequest, SessionUpdate};

impl WorkerState {
    pub(super) fn on_notification(&mut self, method: &str, params: &RawValue) {
        if method != "session.event" {
            // session.lifecycle and anything newer that names a session: to that session as
            // it is; the rest (host.event, …) is not ours to act on.
            let weight = params.get().len();
            let params: Value = serde_json::from_str(params.get()).unwrap_or(Value::Null);
            match session_of(&params) {
                Some(session_id) => {
                    let call = ClientCall {
                        method: method.to_owned(),
                        params,
                    };
                    self.route(&session_id, SessionUpdate::Notification(call), weight);
                }
                None => tracing::trace!(method, "Ignored notification."),
            }
            return;
        }
        // The reader (`ConnectionOptions::split_session_events`, set by the worker) hands on
        // every session.event whose params are an event's as `Incoming::SessionEvent`; what
        // still comes as a notification is not one.
        tracing::debug!("Ignored a session.event whose params are not an event's.");
    }

    /// A `session.event` of `session_id`: to that session, the ledger of pending tool calls
    /// and permission prompts kept on the way; a request in it nobody will answer is refused.
    pub(super) fn on_session_event(&mut self, session_id: String, event: SessionEvent) {
        match &event.kind {
            EventKind::ExternalToolRequested(req) => {
                self.pending.insert((
                    PendingKind::ToolCall,
                    session_id.clone(),
                    req.request_id.clone(),
                ));
            }
            EventKind::ExternalToolCompleted(done) => {
                self.pending.remove(&(
                    PendingKind::ToolCall,
                    session_id.clone(),
                    done.request_id.clone(),
                ));
            }
            EventKind::PermissionRequested(req) if req.resolved_by_hook != Some(true) => {
                self.pending.insert((
                    PendingKind::Permission,
                    session_id.clone(),
                    req.request_id.clone(),
                ));
            }
            EventKind::PermissionCompleted(done) => {
                self.pending.remove(&(
                    PendingKind::Permission,
                    session_id.clone(),
                    done.request_id.clone(),
                ));
            }
            _ => {}
        }
        let unrouted = match &event.kind {
            EventKind::ExternalToolRequested(req) => {
                Some((PendingKind::ToolCall, req.request_id.clone()))
            }
            EventKind::PermissionRequested(req) if req.resolved_by_hook != Some(true) => {
                Some((PendingKind::Permission, req.request_id.clone()))
            }
            _ => None,
        };
        let delivered = self.routes.get(&session_id).is_some_and(|route| {
            let weight = event.raw().get().len();
            route.send(SessionUpdate::Event(event), weight)
        });
        if delivered {
            self.check_flood(&session_id);
        } else {
            self.routes.remove(&session_id);
            // A request nobody will answer would block the session forever: refuse it.
            if let Some((kind, request_id)) = unrouted {
                self.pending
                    .remove(&(kind, session_id.clone(), request_id.clone()));
                self.refuse_unrouted(kind, session_id, request_id);
            }
        }
    }

    /// Answers a tool call or permission prompt of a session nobody holds.
    fn refuse_unrouted(&self, kind: PendingKind, session_id: String, request_id: String) {
        let conn = self.conn.clone();
        tokio::spawn(async move {
            let result = match kind {
                PendingKind::ToolCall => conn
                    .call::<HandlePendingToolCall>(&ToolCallAnswer {
                        session_id,
                        request_id,
                        result: None,
                        error: Some("no client is attached to this session".to_owned()),
                    })
                    .await
                    .map(|_| ()),
                PendingKind::Permission => conn
                    .call::<HandlePendingPermission>(&PermissionAnswer {
                        session_id,
                        request_id,
                        result: json!({"kind": "user-not-available"}),
                    })
                    .await
                    .map(|_| ()),
            };
            if let Err(error) = result {
                tracing::debug!(%error, "Could not refuse a request of an unattached session.");
            }
        });
    }

    pub(super) fn on_request(&mut self, request: IncomingRequest, myself: &ActorRef<WorkerMsg>) {
        let IncomingRequest {
            method,
            params,
            responder,
            frame_bytes,
        } = request;
        match method.as_str() {
            "userInput.request" => match serde_json::from_value::<UserInputRequest>(params) {
                Ok(p) => {
                    let session_id = p.session_id.clone();
                    let request = ServerRequest::new(p, responder, None);
                    self.route(&session_id, SessionUpdate::UserInput(request), frame_bytes);
                }
                Err(e) => responder.err(invalid_params(&method, e)),
            },
            "hooks.invoke" => match serde_json::from_value::<HookInvocation>(params) {
                Ok(p) => {
                    let session_id = p.session_id.clone();
                    // Unanswered hooks get the SDK's default: no output.
                    let request = ServerRequest::new(p, responder, Some(json!({})));
                    self.route(&session_id, SessionUpdate::Hook(request), frame_bytes);
                }
                Err(e) => responder.err(invalid_params(&method, e)),
            },
            "llmInference.httpRequestStart" if self.config.model_tunnel.is_some() => {
                match serde_json::from_value::<HttpRequestStart>(params) {
                    Ok(head) => match self.tunnel.start(head) {
                        Ok(()) => responder.ok(json!({})),
                        Err(refused) => {
                            tracing::warn!(%refused, "Refused a model request of a runtime.");
                            responder.err(ErrorObject::new(INVALID_PARAMS, refused.to_string()));
                        }
                    },
                    Err(e) => responder.err(invalid_params(&method, e)),
                }
            }
            "llmInference.httpRequestChunk" => {
                let Some(tunnel) = self.config.model_tunnel.clone() else {
                    return responder.method_not_found();
                };
                match serde_json::from_value::<HttpRequestChunk>(params) {
                    Ok(chunk) => {
                        let target = myself.clone();
                        let known = self.tunnel.chunk(chunk, &self.conn, &tunnel, move |ended| {
                            let _ = target.cast(WorkerMsg::TunnelDone(ended));
                        });
                        if known {
                            responder.ok(json!({}));
                        } else {
                            responder.err(ErrorObject::new(
                                INVALID_PARAMS,
                                "unknown llmInference requestId",
                            ));
                        }
                    }
                    Err(e) => responder.err(invalid_params(&method, e)),
                }
            }
            _ => match session_of(&params) {
                // A request for the session's client (exitPlanMode.request,
                // providerToken.getToken, …): its session answers it, or its drop answers
                // method-not-found, as before.
                Some(session_id) if self.routes.contains_key(&session_id) => {
                    let call = ClientCall { method, params };
                    let request = ServerRequest::unhandled_on_drop(call, responder);
                    self.route(&session_id, SessionUpdate::Request(request), frame_bytes);
                }
                _ => {
                    tracing::debug!(%method, "Unknown request from the runtime; answered method-not-found.");
                    responder.method_not_found();
                }
            },
        }
    }

    /// Delivers a server request to its session; with no session attached, the update is
    /// dropped and its request answered by the drop (error, or the default).
    pub(super) fn route(&mut self, session_id: &str, update: SessionUpdate, weight: usize) {
        let Some(route) = self.routes.get(session_id) else {
            return;
        };
        if route.send(update, weight) {
            self.check_flood(session_id);
        } else {
            self.routes.remove(session_id);
        }
    }

    /// Notes a route that holds more unread than `max_unread_route_bytes`, or routes that
    /// hold more than four times that together (the actor kills the runtime once the batch
    /// is handled): no reader falls that far behind, since a turn's own backlog limit aborts
    /// it long before.
    fn check_flood(&mut self, session_id: &str) {
        if self.flooded.is_some() {
            return;
        }
        let limit = self.config.max_unread_route_bytes;
        let unread = self.routes.get(session_id).map_or(0, |r| r.unread_bytes());
        if unread > limit {
            self.flooded = Some(format!(
                "it left {unread} bytes unread for session {session_id:?}, over the limit of \
                 {limit} (max_unread_route_bytes): no reader falls that far behind, so the \
                 runtime was stopped"
            ));
            return;
        }
        let total_limit = limit.saturating_mul(WORKER_UNREAD_ROUTES);
        let total: usize = self.routes.values().map(|r| r.unread_bytes()).sum();
        if total > total_limit {
            self.flooded = Some(format!(
                "it left {total} bytes unread over its {} sessions, over the limit of \
                 {total_limit} ({WORKER_UNREAD_ROUTES} times max_unread_route_bytes): no \
                 readers fall that far behind, so the runtime was stopped",
                self.routes.len()
            ));
        }
    }

    pub(super) fn fail_routes(&mut self, error: WorkerError) {
        for (_, route) in self.routes.drain() {
            let _ = route.send(SessionUpdate::Ended(error.clone()), 0);
        }
        self.pending.clear();
    }
}

/// How many times `max_unread_route_bytes` a runtime's routes may hold unread together.
const WORKER_UNREAD_ROUTES: usize = 4;

/// The session a request or notification names (`sessionId`), if any.
fn session_of(params: &Value) -> Option<String> {
    params
        .get("sessionId")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

fn invalid_params(method: &str, error: serde_json::Error) -> ErrorObject {
    ErrorObject::new(
        INVALID_PARAMS,
        format!("invalid params for {method}: {error}"),
    )
}
