//! Our wire types against the JSON schemas shipped in the runtime's npm package
//! (`schemas/api.schema.json`, `schemas/session-events.schema.json`).
//!
//! Every field we send or read must exist in the schema, every field the schema requires in
//! params we send must be one we can set, and every event type we decode must be one the
//! runtime documents. Methods the schema does not list (the SDK's hand-written part) are
//! named here, so a schema that starts listing them makes this test fail until they are
//! checked too.

mod support;

use std::path::{Path, PathBuf};

use copilot_pool::rpc::events::typed_events;
use copilot_pool::rpc::introspect::field_names;
use copilot_pool::rpc::messages::*;
use serde_json::Value;

async fn schema_dir() -> PathBuf {
    let exe = support::runtime::runtime_path().await;
    exe.ancestors()
        .map(|dir| dir.join("schemas"))
        .find(|dir| dir.join("api.schema.json").is_file())
        .unwrap_or_else(|| panic!("no schemas/ folder above {}", exe.display()))
}

fn load(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("schema is JSON")
}

/// Follows `$ref` and `anyOf` (taking the object branch) to a definition with properties.
fn resolve<'a>(schema: &'a Value, node: &'a Value) -> &'a Value {
    if let Some(reference) = node.get("$ref").and_then(Value::as_str) {
        let name = reference.rsplit('/').next().unwrap_or_default();
        return resolve(schema, &schema["definitions"][name]);
    }
    if let Some(branches) = node.get("anyOf").and_then(Value::as_array)
        && let Some(object) = branches
            .iter()
            .map(|b| resolve(schema, b))
            .find(|b| b.get("properties").is_some())
    {
        return object;
    }
    node
}

fn properties(schema: &Value, node: &Value) -> Vec<String> {
    resolve(schema, node)
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default()
}

fn required(schema: &Value, node: &Value) -> Vec<String> {
    resolve(schema, node)
        .get("required")
        .and_then(Value::as_array)
        .map(|r| {
            r.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The method entry with `rpcMethod == name`, anywhere in the api schema.
fn find_method<'a>(node: &'a Value, name: &str) -> Option<&'a Value> {
    match node {
        Value::Object(map) => {
            if map.get("rpcMethod").and_then(Value::as_str) == Some(name) {
                return Some(node);
            }
            map.iter()
                .filter(|(k, _)| k.as_str() != "definitions")
                .find_map(|(_, v)| find_method(v, name))
        }
        _ => None,
    }
}

#[tokio::test]
async fn typed_methods_match_the_api_schema() {
    let api = load(&schema_dir().await.join("api.schema.json"));
    // (method, fields of the params we send, fields of the result we read)
    let typed: Vec<(&str, Vec<&str>, Vec<&str>)> = vec![
        (
            "connect",
            field_names::<ConnectParams>(),
            field_names::<ConnectResult>(),
        ),
        (
            "ping",
            field_names::<PingParams>(),
            field_names::<PingResult>(),
        ),
        (
            "session.send",
            field_names::<SendParams>(),
            field_names::<SendResult>(),
        ),
        (
            "session.abort",
            field_names::<AbortParams>(),
            field_names::<SuccessResult>(),
        ),
        (
            "session.history.compact",
            field_names::<CompactParams>(),
            field_names::<CompactResult>(),
        ),
        (
            "session.tools.handlePendingToolCall",
            field_names::<ToolCallAnswer>(),
            field_names::<AnsweredResult>(),
        ),
        (
            "session.permissions.handlePendingPermissionRequest",
            field_names::<PermissionAnswer>(),
            field_names::<AnsweredResult>(),
        ),
        (
            "llmInference.setProvider",
            vec![],
            field_names::<AnsweredResult>(),
        ),
        (
            "llmInference.httpResponseStart",
            field_names::<HttpResponseStartParams>(),
            field_names::<AcceptedResult>(),
        ),
        (
            "llmInference.httpResponseChunk",
            field_names::<HttpResponseChunkParams>(),
            field_names::<AcceptedResult>(),
        ),
        // Server → client requests: params we read, result we send.
        ("hooks.invoke", field_names::<HookInvocation>(), vec![]),
        (
            "llmInference.httpRequestStart",
            field_names::<HttpRequestStart>(),
            vec![],
        ),
        (
            "llmInference.httpRequestChunk",
            field_names::<HttpRequestChunk>(),
            vec![],
        ),
    ];
    let mut problems = Vec::new();
    for (name, params, result) in &typed {
        let Some(method) = find_method(&api, name) else {
            problems.push(format!("{name}: not in api.schema.json"));
            continue;
        };
        let schema_params = properties(&api, &method["params"]);
        for field in params {
            if !schema_params.iter().any(|p| p == field) {
                problems.push(format!(
                    "{name}: param {field} not in schema {schema_params:?}"
                ));
            }
        }
        for field in required(&api, &method["params"]) {
            if !params.iter().any(|p| *p == field) {
                problems.push(format!(
                    "{name}: schema requires param {field} we cannot send"
                ));
            }
        }
        let schema_result = properties(&api, &method["result"]);
        for field in result {
            if !schema_result.iter().any(|p| p == field) {
                problems.push(format!(
                    "{name}: result field {field} not in schema {schema_result:?}"
                ));
            }
        }
    }
    // Spoken but not in the schema (SDK hand-written client, reference §5.1).
    for name in [
        SessionCreate::NAME,
        SessionResume::NAME,
        SessionDetach::NAME,
        SessionDelete::NAME,
        SessionList::NAME,
        SessionGetLastId::NAME,
        SessionGetMessages::NAME,
        StatusGet::NAME,
        AuthGetStatus::NAME,
        "userInput.request",
    ] {
        if find_method(&api, name).is_some() {
            problems.push(format!(
                "{name}: now in the schema; add it to the typed checks"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[tokio::test]
async fn typed_events_match_the_session_events_schema() {
    let schema = load(&schema_dir().await.join("session-events.schema.json"));
    let union = schema["definitions"]["SessionEvent"]["anyOf"]
        .as_array()
        .expect("SessionEvent union");
    let mut by_type = std::collections::HashMap::new();
    for branch in union {
        let event = resolve(&schema, branch);
        if let Some(t) = event["properties"]["type"]["const"].as_str() {
            by_type.insert(t.to_owned(), &event["properties"]["data"]);
        }
    }
    assert!(
        by_type.len() > 100,
        "only {} event types in the schema",
        by_type.len()
    );
    let mut problems = Vec::new();
    for (event_type, fields) in typed_events() {
        let Some(data) = by_type.get(event_type) else {
            problems.push(format!("{event_type}: not in the schema"));
            continue;
        };
        let known = properties(&schema, data);
        for field in fields {
            if !known.iter().any(|k| k == field) {
                problems.push(format!(
                    "{event_type}: field {field} not in schema {known:?}"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[tokio::test]
async fn every_attachment_and_send_option_we_send_matches_the_api_schema() {
    let api = load(&schema_dir().await.join("api.schema.json"));
    let defs = &api["definitions"];
    let attachments = [
        (
            "AttachmentFile",
            Attachment::File {
                path: "/w/a.png".into(),
                display_name: "a.png".into(),
                line_range: Some(LineRange { start: 1, end: 2 }),
            },
        ),
        (
            "AttachmentDirectory",
            Attachment::Directory {
                path: "/w/src".into(),
                display_name: "src".into(),
            },
        ),
        (
            "AttachmentBlob",
            Attachment::Blob {
                data: "aGk=".into(),
                mime_type: "text/plain".into(),
                display_name: Some("hi.txt".into()),
            },
        ),
    ];
    let mut problems = Vec::new();
    for (definition, attachment) in attachments {
        let def = &defs[definition];
        let wire = serde_json::to_value(&attachment).expect("json");
        let fields = wire.as_object().expect("an object");
        let known = properties(&api, def);
        for field in fields.keys() {
            if !known.contains(field) {
                problems.push(format!("{definition}: {field} not in {known:?}"));
            }
        }
        for field in required(&api, def) {
            if !fields.contains_key(&field) {
                problems.push(format!("{definition}: requires {field}"));
            }
        }
        if def["properties"]["type"]["const"] != wire["type"] {
            problems.push(format!("{definition}: type {}", wire["type"]));
        }
    }
    let enum_of = |name: &str| -> Vec<String> {
        defs[name]["enum"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let modes: Vec<String> = copilot_pool::kinds::SendMode::ALL
        .iter()
        .map(|m| m.to_string())
        .collect();
    let agent_modes: Vec<String> = copilot_pool::kinds::AgentMode::ALL
        .iter()
        .map(|m| m.to_string())
        .collect();
    assert_eq!(modes, enum_of("SendMode"));
    assert_eq!(agent_modes, enum_of("SendAgentMode"));
    // The reason of the pool's own `session.abort`, echoed in the turn's `abort` event.
    let abort_reasons: Vec<String> = AbortReason::ALL
        .iter()
        .map(|r| {
            serde_json::to_value(r)
                .expect("json")
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert_eq!(abort_reasons, enum_of("AbortReason"));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[tokio::test]
async fn the_provider_object_matches_the_api_schema() {
    use copilot_pool::kinds::{ProviderType, WireApi};
    let api = load(&schema_dir().await.join("api.schema.json"));
    let definitions = &api["definitions"];
    let mut problems = Vec::new();
    for (ours, theirs) in [
        (field_names::<ProviderConfig>(), "ProviderConfig"),
        (field_names::<AzureOptions>(), "ProviderConfigAzure"),
    ] {
        let known = properties(&api, &definitions[theirs]);
        assert!(
            !known.is_empty(),
            "{theirs} has no properties in the schema"
        );
        for field in &ours {
            if !known.iter().any(|k| k == field) {
                problems.push(format!("{theirs}: {field} not in schema {known:?}"));
            }
        }
        for field in required(&api, &definitions[theirs]) {
            if !ours.contains(&field.as_str()) {
                problems.push(format!("{theirs}: schema requires {field} we cannot send"));
            }
        }
    }
    let values = |name: &str| -> Vec<String> {
        definitions[name]["enum"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let types: Vec<String> = ProviderType::ALL
        .iter()
        .map(|t| t.as_str().to_owned())
        .collect();
    let wire: Vec<String> = WireApi::ALL.iter().map(|t| t.as_str().to_owned()).collect();
    assert_eq!(types, values("ProviderConfigType"));
    assert_eq!(wire, values("ProviderConfigWireApi"));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
