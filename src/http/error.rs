//! The API's error answers: a JSON `{code, message}` with its status, and the status and
//! code of each pool error kind (one table, so every route answers a kind the same way).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::kinds::ErrorKind;
use crate::pool::PoolError;

/// A JSON error `{code, message}`.
pub(super) fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({"code": code, "message": message.into()})),
    )
        .into_response()
}

/// The HTTP status and code for a pool error before a turn starts.
pub(super) fn pool_error(e: &PoolError) -> Response {
    let (status, code) = match e.kind() {
        ErrorKind::Invalid => (StatusCode::BAD_REQUEST, "bad_request"),
        ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        ErrorKind::Busy | ErrorKind::BusyTimeout => (StatusCode::CONFLICT, "busy"),
        ErrorKind::NoCapacity | ErrorKind::WaitersFull => {
            (StatusCode::SERVICE_UNAVAILABLE, "no_capacity")
        }
        ErrorKind::Quarantined => (StatusCode::SERVICE_UNAVAILABLE, "quarantined"),
        ErrorKind::Closed => (StatusCode::SERVICE_UNAVAILABLE, "draining"),
        ErrorKind::StateUnwritable => (StatusCode::SERVICE_UNAVAILABLE, "state_unwritable"),
        ErrorKind::ResourceExhausted => (StatusCode::SERVICE_UNAVAILABLE, "resource_exhausted"),
        ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        ErrorKind::Runtime => (StatusCode::BAD_GATEWAY, "runtime"),
    };
    error(status, code, e.to_string())
}
