//! The API's OpenAPI 3.1 document. The routes are registered from their handlers'
//! `#[utoipa::path]` (utoipa-axum's `routes!`), and every body, answer and event is the
//! `ToSchema` of the type the handlers read or write, so the router, the document served on
//! `GET /openapi.json` and the committed `deploy/openapi.json` cannot drift apart
//! (`tests/openapi.rs` fails when the committed file differs from [`document`]).

use std::sync::Arc;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{AppState, gateway, health, sessions, turns};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "copilot-pool",
        description = "The HTTP API of the copilot-pool daemon: turns of agent conversations \
                       on pooled GitHub Copilot CLI runtime processes, their event streams and \
                       the requests a gateway answers, and the daemon's health. Every error is \
                       `{code, message}` (`ErrorBody`). `/v1` needs `Authorization: Bearer \
                       <api token>` when the daemon is configured with a token.",
        license(name = "MIT"),
    ),
    tags(
        (name = "turns", description = "Turns and the requests they ask the gateway"),
        (name = "sessions", description = "A conversation outside its turns"),
        (name = "daemon", description = "Health, readiness, metrics, the pool and this document"),
    ),
    modifiers(&BearerToken),
)]
struct ApiDoc;

/// The `api_token` security scheme (`Authorization: Bearer <token>`).
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_token",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

/// The `/v1` routes (behind the token), with their documentation.
pub(super) fn v1_routes() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::new()
        .routes(routes!(turns::post_turn))
        .routes(routes!(gateway::post_answer))
        .routes(routes!(sessions::post_abort))
        .routes(routes!(sessions::post_compact))
        .routes(routes!(sessions::delete_session))
        .routes(routes!(health::get_pool))
}

/// The routes outside `/v1`, with their documentation.
pub(super) fn open_routes() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::new()
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(health::get_metrics))
        .routes(routes!(get_openapi))
}

/// The document of `routes` (the router's own paths) with the API's info, tags and security
/// schemes.
pub(super) fn with_info(routes: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.merge(routes);
    doc
}

/// The OpenAPI 3.1 document of [`router`](super::router): what `GET /openapi.json` answers,
/// and what `deploy/openapi.json` holds.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut routes = v1_routes().into_openapi();
    routes.merge(open_routes().into_openapi());
    with_info(routes)
}

/// [`document`] as the committed file holds it: pretty JSON with a final newline.
pub fn document_json() -> Result<String, serde_json::Error> {
    pretty(&document())
}

/// `doc` as pretty JSON with a final newline.
pub(super) fn pretty(doc: &utoipa::openapi::OpenApi) -> Result<String, serde_json::Error> {
    let mut text = doc.to_pretty_json()?;
    text.push('\n');
    Ok(text)
}

/// This document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "daemon",
    responses(
        (status = 200, description = "The OpenAPI 3.1 document of this API", body = Object, content_type = "application/json"),
    ),
)]
pub(super) async fn get_openapi(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        state.openapi.clone(),
    )
        .into_response()
}
