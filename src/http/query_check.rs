//! Refuses a query parameter a route does not take, on every route: what each route takes is
//! read once from the API's own OpenAPI document (the routes are registered with it, so the
//! two cannot drift), and a request naming anything else gets a 400 that lists what the route
//! takes, before its handler runs. A misspelt `?stream=flase` or `?backend=` on the wrong
//! route is then an error the caller sees, never a parameter silently ignored.
//!
//! Owns only that check; the values of the parameters a route takes are its handler's.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{MatchedPath, Query, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::{OpenApi, RefOr};

/// The query parameters each route takes: (method, path template) → names.
#[derive(Debug, Default)]
pub(super) struct RouteQueries(HashMap<(Method, String), Vec<String>>);

impl RouteQueries {
    /// What `doc` documents for each operation (its query parameters, and its path's).
    pub(super) fn of(doc: &OpenApi) -> RouteQueries {
        let mut routes = HashMap::new();
        for (path, item) in &doc.paths.paths {
            let shared = query_names(item.parameters.as_deref());
            let operations: [(Method, &Option<Operation>); 5] = [
                (Method::GET, &item.get),
                (Method::POST, &item.post),
                (Method::PUT, &item.put),
                (Method::DELETE, &item.delete),
                (Method::PATCH, &item.patch),
            ];
            for (method, operation) in operations {
                if let Some(operation) = operation {
                    let mut names = shared.clone();
                    names.extend(query_names(operation.parameters.as_deref()));
                    routes.insert((method, path.clone()), names);
                }
            }
        }
        RouteQueries(routes)
    }

    /// The first parameter of `query` the route (`method`, `path`) does not take, with what
    /// it takes; `None` when all are taken, or the route is not documented (nothing known
    /// to check against).
    fn refused<'a>(
        &'a self,
        method: &Method,
        path: &str,
        query: &'a [(String, String)],
    ) -> Option<(&'a str, &'a [String])> {
        // HEAD is served by the GET route; a router nested under a prefix (`nest`) matches
        // the documented path with the prefix before it.
        let method = if method == Method::HEAD {
            &Method::GET
        } else {
            method
        };
        let taken = self.0.get(&(method.clone(), path.to_owned())).or_else(|| {
            self.0
                .iter()
                .find(|((m, documented), _)| m == method && path.ends_with(documented.as_str()))
                .map(|(_, taken)| taken)
        })?;
        query
            .iter()
            .find(|(name, _)| !taken.contains(name))
            .map(|(name, _)| (name.as_str(), taken.as_slice()))
    }
}

fn query_names(parameters: Option<&[RefOr<utoipa::openapi::path::Parameter>]>) -> Vec<String> {
    parameters
        .unwrap_or_default()
        .iter()
        .filter_map(|p| match p {
            RefOr::T(p) if matches!(p.parameter_in, ParameterIn::Query) => Some(p.name.clone()),
            _ => None,
        })
        .collect()
}

/// The middleware: a 400 `bad_request` naming the parameter and what the route takes.
/// (Routes that read their query, `/v1/turns` and a session's deletion, refuse the same
/// again through their own `deny_unknown_fields`; this is the one message a caller sees.)
pub(super) async fn refuse_unknown(
    State(routes): State<Arc<RouteQueries>>,
    request: Request,
    next: Next,
) -> Response {
    if let (Some(matched), Some(raw)) = (
        request.extensions().get::<MatchedPath>(),
        request.uri().query().filter(|q| !q.is_empty()),
    ) {
        let parsed = Query::<Vec<(String, String)>>::try_from_uri(request.uri());
        let query = match parsed {
            Ok(Query(query)) => query,
            Err(e) => return super::error::rejection(format!("the query {raw:?}: {e}")),
        };
        if let Some((name, taken)) = routes.refused(request.method(), matched.as_str(), &query) {
            let takes = if taken.is_empty() {
                "takes no query parameter".to_owned()
            } else {
                format!(
                    "takes {}",
                    taken
                        .iter()
                        .map(|t| format!("`{t}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            return super::error::rejection(format!(
                "unknown query parameter `{name}`: {} {} {takes} (GET /openapi.json lists \
                 each route's)",
                request.method(),
                matched.as_str()
            ));
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes() -> RouteQueries {
        let (router, doc) = super::super::openapi::v1_routes().split_for_parts();
        drop(router);
        RouteQueries::of(&doc)
    }

    #[test]
    fn each_documented_route_takes_its_own_query_parameters_and_no_other() {
        let routes = routes();
        let q = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let turns = q(&[("stream", "false")]);
        assert_eq!(routes.refused(&Method::POST, "/v1/turns", &turns), None);
        let typo = q(&[("steam", "false")]);
        let (name, taken) = routes
            .refused(&Method::POST, "/v1/turns", &typo)
            .expect("refused");
        assert_eq!(name, "steam");
        assert!(taken.contains(&"stream".to_owned()), "{taken:?}");
        let stray = q(&[("x", "1")]);
        let (name, taken) = routes
            .refused(&Method::GET, "/v1/pool", &stray)
            .expect("refused");
        assert_eq!((name, taken.len()), ("x", 0));
        // The parameter of one route is not another's.
        let backend = q(&[("backend", "claude-cli")]);
        assert!(
            routes
                .refused(
                    &Method::POST,
                    "/v1/sessions/{agent_id}/{session_key}/compact",
                    &backend
                )
                .is_some()
        );
        assert!(
            routes
                .refused(
                    &Method::DELETE,
                    "/v1/sessions/{agent_id}/{session_key}",
                    &backend
                )
                .is_none()
        );
        // Under a gateway's prefix, and for HEAD, the route is still known.
        assert!(
            routes
                .refused(&Method::GET, "/pool-api/v1/pool", &stray)
                .is_some()
        );
        assert!(routes.refused(&Method::HEAD, "/v1/pool", &stray).is_some());
    }
}
