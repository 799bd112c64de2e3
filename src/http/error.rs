//! The API's error answers: a JSON `{code, message}` with its status, and the status and
//! code of each pool error kind (one table, so every route answers a kind the same way).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::kinds::ErrorKind;
use crate::pool::PoolError;

/// Every error answer of the API (besides the plain-text health probes).
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct ErrorBody<'a> {
    /// A stable word for programs: `bad_request`, `bad_body`, `unauthorized`, `not_found`,
    /// `method_not_allowed`, `body_timeout`, `busy`, `too_large`, `draining`, `no_capacity`,
    /// `quarantined`, `conversation_limit`,
    /// `state_unwritable`, `resource_exhausted`, `pool_closed`, `transcript_missing`,
    /// `too_many_connections`, `runtime`, `io`, `internal`.
    code: &'a str,
    /// What went wrong and how to fix it, for people.
    message: String,
}

/// A JSON error `{code, message}`.
pub(super) fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let body = ErrorBody {
        code,
        message: message.into(),
    };
    (status, axum::Json(body)).into_response()
}

/// A query string or path the router could not read (axum's rejection, which would answer
/// plain text): 400 with the error body.
pub(super) fn rejection(rejection: impl std::fmt::Display) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "bad_request",
        format!("{rejection}; fix the URL"),
    )
}

/// The HTTP status and code for a pool error before a turn starts.
pub(super) fn pool_error(e: &PoolError) -> Response {
    if let PoolError::TranscriptMissing { .. } = e {
        // Its own code: the conversation exists, its CLI's history does not.
        return error(StatusCode::CONFLICT, "transcript_missing", e.to_string());
    }
    let (status, code) = match e.kind() {
        ErrorKind::Invalid => (StatusCode::BAD_REQUEST, "bad_request"),
        ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        ErrorKind::Busy | ErrorKind::BusyTimeout => (StatusCode::CONFLICT, "busy"),
        ErrorKind::NoCapacity
        | ErrorKind::WaitersFull
        | ErrorKind::AgentWaitersFull
        | ErrorKind::AgentLeasesFull => (StatusCode::SERVICE_UNAVAILABLE, "no_capacity"),
        // Not capacity that frees itself: the gateway deletes a conversation first.
        ErrorKind::AgentConversationsFull => (StatusCode::CONFLICT, "conversation_limit"),
        ErrorKind::Quarantined => (StatusCode::SERVICE_UNAVAILABLE, "quarantined"),
        ErrorKind::Closed => (StatusCode::SERVICE_UNAVAILABLE, "draining"),
        ErrorKind::StateUnwritable => (StatusCode::SERVICE_UNAVAILABLE, "state_unwritable"),
        ErrorKind::ResourceExhausted => (StatusCode::SERVICE_UNAVAILABLE, "resource_exhausted"),
        ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        ErrorKind::Runtime => (StatusCode::BAD_GATEWAY, "runtime"),
    };
    error(status, code, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_agent_at_its_conversation_cap_gets_409_conversation_limit_saying_what_to_delete() {
        let response = pool_error(&PoolError::AgentConversationsFull { max: 2 });
        assert_eq!(response.status(), StatusCode::CONFLICT);
        let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
            .await
            .expect("body");
        let body: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(body["code"], "conversation_limit", "{body}");
        let message = body["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("DELETE /v1/sessions/{agent_id}/{session_key}")
                && message.contains("max_conversations_per_agent"),
            "{message}"
        );
    }
}
