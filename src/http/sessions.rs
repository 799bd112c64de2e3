//! One conversation outside its turns: abort its running turn, compact it, reset it. Compact
//! and reset only ever reach an existing conversation (never open a new session, never
//! create the agent's working directory).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AppState;
use super::body::{conversation_body, lease_request, read_body};
use super::error::{error, pool_error};
use crate::pool::{ConversationId, Lease};

pub(super) async fn post_abort(
    State(state): State<Arc<AppState>>,
    Path((agent_id, session_key)): Path<(String, String)>,
) -> Response {
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
    body: Body,
) -> Result<Lease, Response> {
    let body = read_body(state, body).await?;
    let conv = conversation_body(&body)?;
    let mut req = lease_request(state, agent_id, session_key, conv).await?;
    req.existing_only = true;
    state.pool.lease(req).await.map_err(|e| pool_error(&e))
}

pub(super) async fn post_compact(
    State(state): State<Arc<AppState>>,
    Path((agent_id, session_key)): Path<(String, String)>,
    body: Body,
) -> Response {
    let mut lease = match existing_lease(&state, &agent_id, &session_key, body).await {
        Ok(l) => l,
        Err(r) => return r,
    };
    match lease.compact(None).await {
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
    let lease = match existing_lease(&state, &agent_id, &session_key, body).await {
        Ok(l) => l,
        Err(r) => return r,
    };
    match lease.reset().await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => pool_error(&e),
    }
}
