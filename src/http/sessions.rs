//! One conversation outside its turns: abort its running turn, compact it (with optional
//! `custom_instructions` for the summary), reset it. Compact and reset only ever reach an
//! existing conversation (never open a new session, never create the agent's working
//! directory).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::AppState;
use super::body::{conversation_body, lease_request, parse, read_body};
use super::error::{error, pool_error};
use crate::pool::{ConversationId, Lease};

pub(super) async fn post_abort(
    State(state): State<Arc<AppState>>,
    Path((agent_id, session_key)): Path<(String, String)>,
) -> Response {
    if let Err(refused) = super::body::refuse_sdk_session(&session_key) {
        return refused;
    }
    let conversation = ConversationId::new(agent_id, session_key);
    match state.pool.abort(&conversation).await {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no running turn for this conversation",
        ),
        Err(e) => pool_error(&e),
    }
}

/// The lease of an existing conversation for compact and reset (never a new session).
async fn existing_lease(
    state: &AppState,
    agent_id: &str,
    session_key: &str,
    body: &Bytes,
) -> Result<Lease, Response> {
    let conv = conversation_body(body)?;
    let mut req = lease_request(state, agent_id, session_key, conv).await?;
    req.existing_only = true;
    state.pool.lease(req).await.map_err(|e| pool_error(&e))
}

pub(super) async fn post_compact(
    State(state): State<Arc<AppState>>,
    Path((agent_id, session_key)): Path<(String, String)>,
    body: Body,
) -> Response {
    let body = match read_body(&state, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let (custom_instructions, body) = match take_custom_instructions(body) {
        Ok(split) => split,
        Err(r) => return r,
    };
    let mut lease = match existing_lease(&state, &agent_id, &session_key, &body).await {
        Ok(l) => l,
        Err(r) => return r,
    };
    match lease.compact(custom_instructions).await {
        Ok(r) => axum::Json(json!({
            "success": r.success,
            "tokens_removed": r.tokens_removed,
            "messages_removed": r.messages_removed,
        }))
        .into_response(),
        Err(e) => pool_error(&e),
    }
}

pub(super) async fn delete_session(
    State(state): State<Arc<AppState>>,
    Path((agent_id, session_key)): Path<(String, String)>,
    body: Body,
) -> Response {
    let body = match read_body(&state, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let lease = match existing_lease(&state, &agent_id, &session_key, &body).await {
        Ok(l) => l,
        Err(r) => return r,
    };
    match lease.reset().await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => pool_error(&e),
    }
}

/// Splits compact's `custom_instructions` (a string that focuses the summary) from the
/// conversation's settings, which are read like reset's.
fn take_custom_instructions(body: Bytes) -> Result<(Option<String>, Bytes), Response> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok((None, body));
    }
    let mut value: Value = parse(&body)?;
    let Some(obj) = value.as_object_mut() else {
        // Not an object: the settings' parser says what is wrong.
        return Ok((None, body));
    };
    let instructions = match obj.remove("custom_instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text),
        Some(_) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "custom_instructions must be a string (what the summary should keep)",
            ));
        }
    };
    let rest = serde_json::to_vec(&value)
        .map(Bytes::from)
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    Ok((instructions, rest))
}
