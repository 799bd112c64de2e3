//! End to end: every BYOK provider shape through the real runtime to the scripted model,
//! which speaks each wire format (OpenAI chat completions and responses, Anthropic
//! messages). For each shape, streaming and not, through the guarded model path (the
//! runtime's requests come over the JSON-RPC tunnel and the pool's own client makes them
//! over HTTP): a turn with a gateway tool call, then a
//! turn whose first model call fails with an upstream 500 and succeeds on the runtime's own
//! retry; and the requests the runtime made carry the shape's route, credential header,
//! custom headers and wire model.

mod support;

use copilot_pool::pool::{LeaseRequest, OpenReason, Pool};
use copilot_pool::rpc::messages::ProviderConfig;

use copilot_pool::scripted_model::{Answer, RecordedRequest, Reply, ScriptedModel, Transport};
use copilot_pool::secret::Secret;
use copilot_pool::turn::{GatewayTool, ToolCall};
use serde_json::json;
use support::pool_fixture::{Fixture, shutdown_leaves_nothing};

fn lookup_tool() -> GatewayTool {
    GatewayTool::new(
        "lookup_number",
        "Looks up the number for a key",
        json!({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
        |call: ToolCall| async move {
            match call.arguments["key"].as_str() {
                Some("alpha") => Ok("the number is 42".to_owned()),
                other => Err(format!("no number for {other:?}")),
            }
        },
    )
}

/// What a shape's requests must look like at the model.
struct Expect {
    /// The path every model call is posted to.
    path: &'static str,
    /// The query every model call carries, if any.
    query: Option<&'static str>,
    /// The credential header and its value.
    credential: (&'static str, &'static str),
    /// The `model` of the request body.
    wire_model: &'static str,
    /// The runtime streams every call of this shape, whether the session streams or not
    /// (seen: anthropic).
    always_streams: bool,
}

/// The scripted model's origin (`http://127.0.0.1:<port>`), for shapes whose base URL is
/// not the `/v1` one.
fn origin(fx: &Fixture) -> String {
    format!("http://{}", fx.endpoint.addr())
}

/// Runs both turns of one shape, streaming and not, and checks every model request against
/// `expect`. Every BYOK request goes through the guard, which reaches the model over HTTP
/// (a tunnel of the worker's own config is replaced by the guard's for BYOK leases).
async fn prove_shape(provider: impl Fn(&Fixture) -> ProviderConfig, expect: Expect) {
    prove_shape_over(Transport::Http, &provider, &expect).await;
}

async fn prove_shape_over(
    transport: Transport,
    provider: &impl Fn(&Fixture) -> ProviderConfig,
    expect: &Expect,
) {
    let fx = Fixture::new().await;
    let config = fx.config().await;
    let pool = Pool::start(config).await.expect("pool");
    for streaming in [false, true] {
        let mut req: LeaseRequest = fx.request("agent-s", &format!("conv-{streaming}"));
        req.provider = Some(provider(&fx));
        req.streaming = streaming;
        req.available_tools = None;
        req.handlers.tools = vec![lookup_tool()];
        let mut lease = pool.lease(req).await.expect("lease");
        assert_eq!(lease.reason(), OpenReason::New);
        let before = fx.model.requests().len();

        let tool = lease
            .run(r#"SCENARIO:tool NAME=lookup_number ARGS={"key": "alpha"}"#)
            .await
            .expect("the tool turn");
        assert_eq!(tool.error, None, "streaming {streaming}");
        assert_eq!(
            tool.text, "tool said: the number is 42",
            "streaming {streaming}"
        );
        assert_eq!(tool.gateway_tool_calls, 1);
        assert_eq!(tool.model_calls, 2);
        assert_eq!(
            tool.usage.output_tokens,
            2 * ScriptedModel::COMPLETION_TOKENS,
            "the usage of both calls was read (streaming {streaming})"
        );

        fx.model.push_reply(Reply::Error { status: 500 });
        let retried = lease
            .run("REPLY=answered after the retry")
            .await
            .expect("the retried turn");
        assert_eq!(retried.error, None, "streaming {streaming}");
        assert_eq!(retried.text, "answered after the retry");

        let calls: Vec<RecordedRequest> = fx.model.requests().split_off(before);
        let answers: Vec<String> = calls
            .iter()
            .map(|c| match &c.answer {
                Answer::Chat { decision, .. } => format!("{decision:?}"),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(calls.len(), 4, "{answers:?}");
        assert!(
            answers[2].contains("Error { status: 500 }") && answers[3].contains("Text"),
            "the upstream 500, then the retry: {answers:?}"
        );
        for call in &calls {
            assert_eq!(call.transport, transport);
            assert_eq!(call.method, "POST");
            assert_eq!(call.path, expect.path);
            assert_eq!(call.query.as_deref(), expect.query);
            let (header, value) = expect.credential;
            // Trimmed: a keyless call's `Bearer ` loses its space in HTTP parsing, not in
            // the tunnel.
            let sent: Vec<&str> = call.header(header).into_iter().map(str::trim).collect();
            let want: Vec<&str> = [value].into_iter().filter(|v| !v.is_empty()).collect();
            assert_eq!(sent, want, "{header} of {}", call.path);
            assert_eq!(call.header("x-tenant"), ["tenant-7"]);
            assert_eq!(call.body["model"], expect.wire_model);
            let streamed = call.body["stream"] == json!(true);
            assert_eq!(
                streamed,
                streaming || expect.always_streams,
                "{}",
                call.path
            );
        }
        // The tool went to the model in the shape's own way and its result came back.
        let second = serde_json::to_string(&calls[1].body).expect("json");
        assert!(second.contains("lookup_number") && second.contains("the number is 42"));
        drop(lease);
    }
    shutdown_leaves_nothing(&pool).await;
}

fn with_tenant_header(mut provider: ProviderConfig) -> ProviderConfig {
    provider.headers = Some([("X-Tenant".to_owned(), "tenant-7".to_owned())].into());
    provider
}

#[tokio::test]
async fn openai_chat_completions_runs_tools_streams_and_retries() {
    prove_shape(
        |fx| with_tenant_header(fx.provider()),
        Expect {
            path: "/v1/chat/completions",
            query: None,
            credential: ("authorization", "Bearer scripted-key"),
            wire_model: ScriptedModel::MODEL_ID,
            always_streams: false,
        },
    )
    .await;
}

#[tokio::test]
async fn openai_responses_runs_tools_streams_and_retries() {
    prove_shape(
        |fx| {
            with_tenant_header(ProviderConfig::openai_responses(
                fx.endpoint.base_url(),
                Some(Secret::new("responses-key")),
            ))
        },
        Expect {
            path: "/v1/responses",
            query: None,
            credential: ("authorization", "Bearer responses-key"),
            wire_model: ScriptedModel::MODEL_ID,
            always_streams: false,
        },
    )
    .await;
}

#[tokio::test]
async fn azure_deployments_run_tools_stream_and_retry_with_the_api_version() {
    prove_shape(
        |fx| {
            with_tenant_header(ProviderConfig::azure(
                origin(fx),
                Some(Secret::new("azure-key")),
                "prod-deployment",
                Some("2024-10-21".to_owned()),
            ))
        },
        Expect {
            path: "/openai/deployments/prod-deployment/chat/completions",
            query: Some("api-version=2024-10-21"),
            credential: ("api-key", "azure-key"),
            wire_model: "prod-deployment",
            always_streams: false,
        },
    )
    .await;
}

#[tokio::test]
async fn azure_without_an_api_version_uses_the_v1_route_with_responses() {
    prove_shape(
        |fx| {
            let mut provider =
                ProviderConfig::azure(origin(fx), Some(Secret::new("azure-key")), "dep", None);
            provider.wire_api = Some(copilot_pool::kinds::WireApi::Responses);
            with_tenant_header(provider)
        },
        Expect {
            path: "/openai/v1/responses",
            query: None,
            credential: ("api-key", "azure-key"),
            wire_model: "dep",
            always_streams: false,
        },
    )
    .await;
}

#[tokio::test]
async fn anthropic_messages_run_tools_stream_and_retry() {
    prove_shape(
        |fx| {
            with_tenant_header(ProviderConfig::anthropic(
                origin(fx),
                Some(Secret::new("anthropic-key")),
            ))
        },
        Expect {
            path: "/v1/messages",
            query: None,
            credential: ("x-api-key", "anthropic-key"),
            wire_model: ScriptedModel::MODEL_ID,
            always_streams: true,
        },
    )
    .await;
}

#[tokio::test]
async fn an_openai_compatible_local_server_without_a_key_runs_its_wire_model() {
    // ollama, vLLM and llama.cpp all serve `/v1/chat/completions` and need no key; the
    // bearer token wins over the key when both are given, so this shape also carries one.
    prove_shape(
        |fx| {
            let mut provider =
                ProviderConfig::openai_compatible(fx.endpoint.base_url(), "llama3.2:1b");
            provider.max_prompt_tokens = Some(100_000);
            provider.max_output_tokens = Some(4_096);
            provider.max_context_window_tokens = Some(128_000);
            with_tenant_header(provider)
        },
        Expect {
            path: "/v1/chat/completions",
            query: None,
            // The runtime sends an empty `Bearer `; the guard, with no key to put in, sends no
            // credential at all.
            credential: ("authorization", ""),
            wire_model: "llama3.2:1b",
            always_streams: false,
        },
    )
    .await;
}

#[tokio::test]
async fn a_bearer_token_wins_over_the_api_key() {
    prove_shape(
        |fx| {
            let mut provider = fx.provider();
            provider.bearer_token = Some(Secret::new("bearer-token-1"));
            provider.wire_model = Some("served-name".to_owned());
            with_tenant_header(provider)
        },
        Expect {
            path: "/v1/chat/completions",
            query: None,
            credential: ("authorization", "Bearer bearer-token-1"),
            wire_model: "served-name",
            always_streams: false,
        },
    )
    .await;
}
