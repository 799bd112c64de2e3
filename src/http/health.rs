//! What the daemon says about itself: `/healthz` (the pool actor answers), `/readyz` (and
//! not draining), `/metrics` (the caller's renderer) and `/v1/pool` (`PoolStatus` as JSON).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::{ErrorBody, error};

/// How long `/healthz` waits for the pool actor to answer.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// Alive while the pool actor answers (a status call within `HEALTH_TIMEOUT`); a dead or
/// stuck pool makes it 503, so an orchestrator restarts the daemon. Draining is still alive.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "daemon",
    responses(
        (status = 200, description = "Alive (`ok`)", body = String, content_type = "text/plain"),
        (status = 503, description = "The pool is down or not answering", body = String, content_type = "text/plain"),
    ),
)]
pub(super) async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    match tokio::time::timeout(HEALTH_TIMEOUT, state.pool.status()).await {
        Ok(Ok(_)) => (StatusCode::OK, "ok\n").into_response(),
        Ok(Err(e)) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("pool down: {e}\n")).into_response()
        }
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "pool not answering\n").into_response(),
    }
}

/// Ready for turns: the pool is open and the daemon is not draining.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "daemon",
    responses(
        (status = 200, description = "Ready (`ready`)", body = String, content_type = "text/plain"),
        (status = 503, description = "Draining or not ready", body = String, content_type = "text/plain"),
    ),
)]
pub(super) async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response();
    }
    match state.pool.status().await {
        Ok(s) if !s.closed => (StatusCode::OK, "ready\n").into_response(),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response(),
    }
}

/// The metrics in Prometheus' text format (when this listener serves them).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "daemon",
    responses(
        (status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain; version=0.0.4"),
        (status = 404, description = "Metrics are not served on this listener (`not_found`)", body = ErrorBody),
    ),
)]
pub(super) async fn get_metrics(State(state): State<Arc<AppState>>) -> Response {
    match &state.config.metrics {
        Some(render) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            render.render(),
        )
            .into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "not_found",
            "metrics are not served on this listener (see metrics_listen)",
        ),
    }
}

/// `GET /v1/pool`: the pool's status and, when the caller set it, what the workers' sandbox
/// enforces.
#[derive(serde::Serialize, utoipa::ToSchema)]
struct PoolAnswer {
    #[serde(flatten)]
    status: crate::PoolStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    sandbox: Option<crate::sandbox::SandboxStatus>,
}

/// The pool's processes, conversations and counters.
#[utoipa::path(
    get,
    path = "/v1/pool",
    tag = "daemon",
    responses(
        (status = 200, description = "The pool now", body = PoolAnswer),
        (status = 401, description = "Missing or wrong bearer token (when the daemon has one)", body = ErrorBody),
        (status = 403, description = "No token is set and the request is not from this machine: its Host is not a loopback name, or it came from a web page (Origin)", body = ErrorBody),
        (status = 503, description = "The pool is closed (`pool_closed`), or `too_many_connections`", body = ErrorBody),
    ),
    security((), ("api_token" = [])),
)]
pub(super) async fn get_pool(State(state): State<Arc<AppState>>) -> Response {
    match state.pool.status().await {
        Ok(mut status) => {
            // The daemon drains a moment before its pool closes.
            status.closed |= state.draining();
            axum::Json(PoolAnswer {
                status,
                sandbox: state.config.sandbox.clone(),
            })
            .into_response()
        }
        Err(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "pool_closed",
            e.to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use crate::http::{ApiConfig, ConnectionLimits, MetricsRender, router};
    use crate::pool::{Pool, PoolConfig};
    use crate::worker::WorkerConfig;
    use std::path::PathBuf;

    async fn get(addr: std::net::SocketAddr, path: &str) -> reqwest::Response {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        client
            .get(format!("http://{addr}{path}"))
            .send()
            .await
            .unwrap()
    }

    async fn status_of(addr: std::net::SocketAddr, path: &str) -> u16 {
        get(addr, path).await.status().as_u16()
    }

    /// A pool whose program is never started (no lease is taken).
    async fn idle_pool(dir: &std::path::Path) -> Pool {
        let worker = WorkerConfig::new("/nonexistent".into(), PathBuf::new(), PathBuf::new());
        let config = PoolConfig::new(worker, dir.join("state"), dir.into());
        Pool::start(config).await.unwrap()
    }

    async fn serve_on_loopback(app: axum::Router) -> (std::net::SocketAddr, impl FnOnce()) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(crate::http::serve(
            listener,
            app,
            ConnectionLimits::default(),
            async move {
                let _ = stopped.await;
            },
        ));
        (addr, move || {
            let _ = stop.send(());
            drop(server);
        })
    }

    /// The API over an idle pool, on loopback.
    async fn idle_pool_api(
        dir: &std::path::Path,
        config: ApiConfig,
    ) -> (Pool, std::net::SocketAddr, impl FnOnce()) {
        let pool = idle_pool(dir).await;
        let (addr, stop) = serve_on_loopback(router(pool.clone(), config)).await;
        (pool, addr, stop)
    }

    #[tokio::test]
    async fn healthz_is_503_once_the_pool_actor_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let (pool, addr, stop) = idle_pool_api(dir.path(), ApiConfig::default()).await;

        assert_eq!(status_of(addr, "/healthz").await, 200);
        // The pool's actor stops at the end of its shutdown.
        pool.shutdown().await.unwrap();
        assert_eq!(status_of(addr, "/healthz").await, 503);
        stop();
    }

    #[tokio::test]
    async fn metrics_are_the_callers_text_and_404_without_a_renderer() {
        let dir = tempfile::tempdir().unwrap();
        let (pool, addr, stop) = idle_pool_api(dir.path(), ApiConfig::default()).await;
        assert_eq!(status_of(addr, "/metrics").await, 404);
        stop();

        let config = ApiConfig {
            metrics: Some(MetricsRender::new(|| "copilot_pool_test 1\n".to_owned())),
            ..ApiConfig::default()
        };
        let (addr, stop) = serve_on_loopback(router(pool.clone(), config)).await;
        let text = get(addr, "/metrics").await.text().await.unwrap();
        assert_eq!(text, "copilot_pool_test 1\n");
        stop();
        pool.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn readyz_and_the_pool_status_say_draining_once_the_handle_drains() {
        let dir = tempfile::tempdir().unwrap();
        let pool = idle_pool(dir.path()).await;
        let (app, handle) = crate::http::router_with_handle(pool.clone(), ApiConfig::default());
        let (addr, stop) = serve_on_loopback(app).await;
        assert_eq!(status_of(addr, "/readyz").await, 200);
        handle.set_draining();
        assert!(handle.is_draining());
        assert_eq!(status_of(addr, "/readyz").await, 503);
        let body = get(addr, "/v1/pool").await.bytes().await.unwrap();
        let status: crate::PoolStatus = serde_json::from_slice(&body).unwrap();
        assert!(status.closed);
        // The pool itself is still open: draining is the API's.
        assert!(!pool.status().await.unwrap().closed);
        stop();
        pool.shutdown().await.unwrap();
    }
}
