//! One conversation outside its turns: abort its current turn (running, or still waiting
//! for room), compact it (with optional
//! `custom_instructions` for the summary), reset it, or with `?backend=` delete it on a CLI
//! backend (its process, its CLI's files of the session, its binding). Compact and reset
//! only ever reach an existing conversation (never open a new session, never create the
//! agent's working directory or home).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::attachments::remove_conversation_files;
use super::body::{CompactBody, ConversationBody, lease_request, optional_body, read_body};
use super::error::{ErrorBody, error, pool_error, rejection};
use crate::pool::{COPILOT_BACKEND, ConversationId, Lease, PoolError};

/// A conversation's place in the URL of the routes below.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub(super) struct ConversationPath {
    /// The conversation's agent: lowercase letters, digits, `_` and `-`, starting with a letter or digit
    #[param(pattern = "^[a-z0-9][a-z0-9_-]*$", min_length = 1, max_length = 64)]
    agent_id: String,
    /// The gateway's key of the conversation (1 to 512 bytes)
    #[param(min_length = 1, max_length = 512)]
    session_key: String,
}

/// Aborts the conversation's current turn, on Copilot or a CLI backend: the one running, or
/// the one still waiting for room or between fallback backends (its prompt is then never
/// sent). Turns asked for after it are not aborted.
///
/// The turn's stream ends with `turn.end` `aborted`; the conversation continues.
#[utoipa::path(
    post,
    path = "/v1/sessions/{agent_id}/{session_key}/abort",
    tag = "sessions",
    params(ConversationPath),
    responses(
        (status = 204, description = "The conversation's current turn was aborted"),
        (status = 400, description = "A wrong path: `agent_id` or `session_key` is not a valid one, or names an SDK session (`bad_request`); the message names the field", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token (when the daemon has one)", body = ErrorBody),
        (status = 403, description = "No token is set and the request is not from this machine: its Host is not a loopback name, or it came from a web page (Origin)", body = ErrorBody),
        (status = 404, description = "No turn of this conversation is running or waiting (`not_found`)", body = ErrorBody),
        (status = 500, description = "A fault of the daemon (`internal`)", body = ErrorBody),
        (status = 503, description = "The pool is shutting down (`draining`), or `too_many_connections`", body = ErrorBody),
    ),
    security((), ("api_token" = [])),
)]
pub(super) async fn post_abort(
    State(state): State<Arc<AppState>>,
    path: Result<Path<ConversationPath>, PathRejection>,
) -> Response {
    let ConversationPath {
        agent_id,
        session_key,
    } = match path {
        Ok(Path(p)) => p,
        Err(e) => return rejection(e),
    };
    if let Err(refused) = super::body::check_conversation(&agent_id, &session_key) {
        return refused;
    }
    let conversation = ConversationId::new(agent_id, session_key);
    // The earliest turn asked for here and not over (running, waiting for its lease, about
    // to send, between backends) stops where it is, aborting its own backend's turn; no
    // other is touched (a later turn may hold the conversation while the earliest is between
    // backends). Without one, the runtime's running turn (a turn the library started).
    if state.stop_turn(&conversation.key()) {
        return StatusCode::NO_CONTENT.into_response();
    }
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

/// What a compaction did.
#[derive(Serialize, ToSchema)]
pub(super) struct CompactResult {
    /// The runtime compacted the conversation (`false`, with nothing removed, when there was
    /// nothing to compact).
    success: bool,
    /// Tokens freed (negative when the summary is longer than what it replaced), if the
    /// runtime said.
    tokens_removed: Option<i64>,
    /// Messages folded into the summary, if the runtime said.
    messages_removed: Option<u64>,
}

/// The conversation named by the URL and the optional body of compact and reset, each
/// refused with the error body when it cannot be read.
async fn path_and_body<B>(
    state: &AppState,
    path: Result<Path<ConversationPath>, PathRejection>,
    body: Body,
) -> Result<(ConversationPath, B), Response>
where
    B: for<'de> Deserialize<'de> + Default,
{
    let Path(conversation) = path.map_err(rejection)?;
    let body = read_body(state, body).await?;
    Ok((conversation, optional_body::<B>(&body)?))
}

/// The lease of an existing conversation for compact and reset (never a new session).
async fn existing_lease(
    state: &AppState,
    agent_id: &str,
    session_key: &str,
    conv: ConversationBody,
) -> Result<Lease, Response> {
    let mut req = lease_request(state, agent_id, session_key, conv).await?;
    req.existing_only = true;
    // A conversation running a turn is a 409 now, as documented, not a wait.
    req.fail_if_busy = true;
    req.runs_no_turn = true;
    state.pool.lease(req).await.map_err(|e| pool_error(&e))
}

/// Compacts an existing conversation (summarizes its history). The body is optional: the
/// conversation's settings (as its turns send them) and `custom_instructions`.
#[utoipa::path(
    post,
    path = "/v1/sessions/{agent_id}/{session_key}/compact",
    tag = "sessions",
    params(ConversationPath),
    request_body(content = Option<CompactBody>, content_type = "application/json"),
    responses(
        (status = 200, description = "Compacted", body = CompactResult),
        (status = 400, description = "The body or a field is wrong (`bad_request`, `bad_body`); the message names it", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token (when the daemon has one)", body = ErrorBody),
        (status = 403, description = "No token is set and the request is not from this machine: its Host is not a loopback name, or it came from a web page (Origin)", body = ErrorBody),
        (status = 408, description = "The body did not arrive in time (`body_timeout`)", body = ErrorBody),
        (status = 413, description = "The body exceeds `max_body_bytes`, or holds more JSON values than one per 32 bytes of it (at least 65,536) (`too_large`)", body = ErrorBody),
        (status = 404, description = "No such conversation: it never ran a turn, or was reset (`not_found`)", body = ErrorBody),
        (status = 409, description = "The conversation runs a turn (`busy`)", body = ErrorBody),
        (status = 500, description = "A fault of the daemon (`internal`)", body = ErrorBody),
        (status = 502, description = "The runtime failed (`runtime`)", body = ErrorBody),
        (status = 503, description = "No room or shutting down: `draining`, `no_capacity`, `quarantined`, `state_unwritable`, `resource_exhausted`, `too_many_connections`", body = ErrorBody),
    ),
    security((), ("api_token" = [])),
)]
pub(super) async fn post_compact(
    State(state): State<Arc<AppState>>,
    path: Result<Path<ConversationPath>, PathRejection>,
    body: Body,
) -> Response {
    let (
        ConversationPath {
            agent_id,
            session_key,
        },
        compact,
    ) = match path_and_body::<CompactBody>(&state, path, body).await {
        Ok(read) => read,
        Err(r) => return r,
    };
    let (custom_instructions, conv) = compact.into_parts();
    let mut lease = match existing_lease(&state, &agent_id, &session_key, conv).await {
        Ok(l) => l,
        Err(r) => return r,
    };
    match lease.compact(custom_instructions).await {
        Ok(r) => axum::Json(CompactResult {
            success: r.success,
            tokens_removed: r.tokens_removed,
            messages_removed: r.messages_removed,
        })
        .into_response(),
        Err(e) => pool_error(&e),
    }
}

/// Which conversation a reset deletes: the Copilot one (the default) or a CLI backend's.
#[derive(Deserialize, Default, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(super) struct ResetQuery {
    /// The backend whose conversation under this key is deleted (default `copilot`). For a
    /// CLI backend, the files its CLI keeps of the session (its transcript) are removed with
    /// the stored session: how a gateway frees their disk (the pool prunes nothing), and how
    /// it starts over after `transcript_missing`.
    #[serde(default)]
    backend: Option<String>,
}

/// Resets an existing conversation: deletes its runtime session, its binding and the inline
/// attachments its turns were given, so its next turn starts a new one. The body is
/// optional: the conversation's settings, as its turns send them. The conversation is
/// deleted whatever settings the body carries: the session its binding names, in the
/// working directory the binding recorded; `auth` and `provider`, when given, choose the
/// process that does it (without them, a process of the agent's home with no identity).
/// With
/// `?backend=<id>` of a CLI backend, the conversation on that backend instead: its kept
/// process is ended, its CLI's files of the session removed, and its stored session.
#[utoipa::path(
    delete,
    path = "/v1/sessions/{agent_id}/{session_key}",
    tag = "sessions",
    params(ConversationPath, ResetQuery),
    request_body(content = Option<ConversationBody>, content_type = "application/json"),
    responses(
        (status = 204, description = "Reset"),
        (status = 400, description = "The body or a field is wrong (`bad_request`, `bad_body`); the message names it", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token (when the daemon has one)", body = ErrorBody),
        (status = 403, description = "No token is set and the request is not from this machine: its Host is not a loopback name, or it came from a web page (Origin)", body = ErrorBody),
        (status = 408, description = "The body did not arrive in time (`body_timeout`)", body = ErrorBody),
        (status = 413, description = "The body exceeds `max_body_bytes`, or holds more JSON values than one per 32 bytes of it (at least 65,536) (`too_large`)", body = ErrorBody),
        (status = 404, description = "No such conversation: it never ran a turn, or was reset (`not_found`)", body = ErrorBody),
        (status = 409, description = "The conversation runs a turn, or a lease waits for it (`busy`)", body = ErrorBody),
        (status = 500, description = "A fault of the daemon (`internal`)", body = ErrorBody),
        (status = 502, description = "The runtime failed (`runtime`)", body = ErrorBody),
        (status = 503, description = "No room or shutting down: `draining`, `no_capacity`, `quarantined`, `state_unwritable` (for a CLI backend: a file of its session could not be removed), `resource_exhausted`, `too_many_connections`", body = ErrorBody),
    ),
    security((), ("api_token" = [])),
)]
pub(super) async fn delete_session(
    State(state): State<Arc<AppState>>,
    path: Result<Path<ConversationPath>, PathRejection>,
    query: Result<Query<ResetQuery>, QueryRejection>,
    body: Body,
) -> Response {
    let Query(query) = match query {
        Ok(q) => q,
        Err(e) => return rejection(e),
    };
    let (
        ConversationPath {
            agent_id,
            session_key,
        },
        conv,
    ) = match path_and_body::<ConversationBody>(&state, path, body).await {
        Ok(read) => read,
        Err(r) => return r,
    };
    if let Some(backend) = query.backend.filter(|b| b != COPILOT_BACKEND) {
        return delete_cli_conversation(state, &agent_id, &session_key, conv, backend).await;
    }
    let by_name_alone = conv.names_no_credentials();
    let req = if by_name_alone {
        // No credentials: the deletion needs none.
        conv.place(&state, &agent_id, &session_key).await
    } else {
        lease_request(&state, &agent_id, &session_key, conv).await
    };
    let mut req = match req {
        Ok(req) => req,
        Err(r) => return r,
    };
    req.existing_only = true;
    req.fail_if_busy = true;
    req.runs_no_turn = true;
    // Deleted whatever settings the request carries (they may differ from the
    // conversation's: a 404 here would leave its session and files for good); credentials,
    // when given, only choose the process that does it.
    let leased = state.pool.lease_to_delete(req).await;
    let lease = match leased {
        Ok(l) => l,
        Err(e @ PoolError::NoSuchConversation { .. }) => {
            let hint = "; a conversation on a CLI backend is deleted with ?backend=<id>";
            return error(StatusCode::NOT_FOUND, "not_found", format!("{e}{hint}"));
        }
        Err(e) => return pool_error(&e),
    };
    // Removed once the runtime's session is gone (a refused deletion keeps the conversation,
    // and what its turns were given), while the lease is held: no turn of the conversation
    // writes there meanwhile. Its directory is the lease's (by name alone, the one its
    // binding recorded).
    let remove_files: crate::pool::WhileHeld = {
        let conversation = ConversationId::new(&agent_id, &session_key);
        Box::new(move |work| {
            Box::pin(async move {
                remove_conversation_files(&state, work, &conversation, COPILOT_BACKEND).await;
            })
        })
    };
    match lease.reset_then(Some(remove_files)).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => pool_error(&e),
    }
}

/// The reset of a conversation on CLI backend `backend` (see [`delete_session`]).
async fn delete_cli_conversation(
    state: Arc<AppState>,
    agent_id: &str,
    session_key: &str,
    conv: ConversationBody,
    backend: String,
) -> Response {
    if let Err(e) = state.pool.check_backend(&backend) {
        return pool_error(&e);
    }
    // Where it lives is all a deletion needs: no credentials are asked for.
    let mut req = match conv.place(&state, agent_id, session_key).await {
        Ok(req) => req,
        Err(r) => return r,
    };
    req.backend = backend.clone();
    // Its attachments go while the deletion holds it (in its directory: the one its binding
    // recorded, else its kept process's, else the request's), before a turn let in after
    // the deletion could write its own there.
    let remove_files: crate::pool::WhileHeld = {
        let state = state.clone();
        let conversation = ConversationId::new(agent_id, session_key);
        let backend = backend.clone();
        Box::new(move |work| {
            Box::pin(async move {
                remove_conversation_files(&state, work, &conversation, &backend).await;
            })
        })
    };
    match state
        .pool
        .delete_cli_conversation_then(req, Some(remove_files))
        .await
    {
        Ok(Some(_)) => StatusCode::NO_CONTENT.into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!(
                "no conversation {session_key:?} of agent {agent_id:?} is stored on backend \
                 `{backend}`: it never ran a turn there, or was deleted"
            ),
        ),
        Err(e) => pool_error(&e),
    }
}
