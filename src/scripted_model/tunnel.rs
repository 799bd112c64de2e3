//! The scripted model behind the JSON-RPC model tunnel: [`ModelTunnel`] for
//! [`ScriptedModel`]. Same routes, decisions and bodies as the HTTP endpoint; the request is
//! recorded with [`Transport::Tunnel`] and the runtime's session id.

use super::log::Transport;
use super::model::{Incoming, ScriptedModel};
use crate::tunnel::{ModelRequest, ModelTunnel, ServeFuture};

impl ModelTunnel for ScriptedModel {
    fn serve(&self, request: ModelRequest) -> ServeFuture {
        let model = self.clone();
        Box::pin(async move {
            model
                .respond(Incoming {
                    transport: Transport::Tunnel,
                    method: &request.method,
                    path: request.path(),
                    query: request.url.split_once('?').map(|(_, q)| q),
                    session_id: request.session_id.clone(),
                    headers: request
                        .headers
                        .iter()
                        .map(|(n, v)| (n.to_ascii_lowercase(), v.clone()))
                        .collect(),
                    body: &request.body,
                })
                .await
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::{Value, json};

    use super::*;
    use crate::scripted_model::{Answer, Decision};

    fn request(url: &str, body: Value) -> ModelRequest {
        ModelRequest {
            request_id: "r1".into(),
            session_id: Some("session-7".into()),
            method: "POST".into(),
            url: url.into(),
            headers: vec![("authorization".into(), "Bearer unused".into())],
            body: serde_json::to_vec(&body).unwrap(),
        }
    }

    async fn drain(response: crate::tunnel::ModelResponse) -> String {
        let mut body = response.body;
        let mut out = String::new();
        while let Some(chunk) = body.recv().await {
            out.push_str(&chunk.unwrap());
        }
        out
    }

    #[tokio::test]
    async fn tunnel_streams_the_same_answers() {
        let model = ScriptedModel::new();
        let tunnel: Arc<dyn ModelTunnel> = Arc::new(model.clone());
        let body = json!({
            "stream": true,
            "messages": [{"role": "user", "content": "REPLY=via the tunnel"}]
        });
        let response = tunnel
            .serve(request("http://127.0.0.1:9/v1/chat/completions?x=1", body))
            .await;
        assert_eq!(response.status, 200);
        assert!(
            response
                .headers
                .contains(&("content-type".into(), "text/event-stream".into()))
        );
        let sse = drain(response).await;
        assert!(sse.ends_with("data: [DONE]\n\n"));
        let content: String = sse
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| {
                serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(content, "via the tunnel");

        let recorded = model.requests();
        assert_eq!(recorded.len(), 1);
        assert_eq!(recorded[0].transport, Transport::Tunnel);
        assert_eq!(recorded[0].session_id.as_deref(), Some("session-7"));
        assert_eq!(recorded[0].path, "/v1/chat/completions");
        assert_eq!(
            recorded[0].answer,
            Answer::Chat {
                number: 1,
                decision: Decision::Text("via the tunnel".into())
            }
        );
    }

    #[tokio::test]
    async fn tunnel_404s_other_paths() {
        let model = ScriptedModel::new();
        let response = model
            .serve(request(
                "http://127.0.0.1:9/v1/embeddings",
                json!({"input": []}),
            ))
            .await;
        assert_eq!(response.status, 404);
        assert!(drain(response).await.contains("not_found"));
        assert_eq!(model.requests()[0].answer, Answer::NotFound);
    }
}
