//! The embedded schema of a conversation's `session` options
//! (`src/session_options/schema.json`) against the runtime's shipped package, so it cannot
//! drift.
//!
//! The runtime's `session.create` params are the SDK's hand-written part: the pinned
//! package's `schemas/api.schema.json` has no method entry for them, but it does define the
//! types of most of their fields (the `SessionOpenOptions` of `sessions.open`, the
//! `SessionUpdateOptionsParams` of `session.options.update`, `ProtocolSystemMessageConfig`,
//! `McpServerConfig`, …). The table below says where each offered field's schema comes from;
//! the few the api schema lacks (`infiniteSessions`, `customAgents`, …) are written here from
//! the SDK's `copilot-sdk/types.d.ts` of the same package. The generated file is that table
//! resolved against the shipped schema, with the transitive closure of its `$ref`s.
//!
//! Run with `COPILOT_POOL_REGENERATE=1` to rewrite the file after a runtime upgrade.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

/// Where an offered field's schema comes from.
enum Source {
    /// `SessionOpenOptions.properties[field]` (the options of `sessions.open`).
    Open,
    /// `SessionUpdateOptionsParams.properties[field]` (`session.options.update`).
    Update,
    /// A definition of the api schema.
    Def(&'static str),
    /// An object whose values are a definition of the api schema.
    MapOf(&'static str),
    /// Not in the api schema: the SDK's type (`copilot-sdk/types.d.ts`), as JSON schema.
    Sdk(fn() -> Value),
}

/// Whether a change of the field changes what a stored conversation means (so a change
/// starts a new CLI session), or only how the next turns run.
const MEANING: bool = true;
const RUNNING: bool = false;

/// Every field a caller may set, by its wire name (the SDK's name on the wire).
fn offered() -> Vec<(&'static str, Source, bool)> {
    use Source::*;
    vec![
        ("model", Open, MEANING),
        ("reasoningEffort", Open, RUNNING),
        ("reasoningSummary", Open, RUNNING),
        ("contextTier", Def("ContextTier"), RUNNING),
        (
            "modelCapabilities",
            Def("ModelCapabilitiesOverride"),
            RUNNING,
        ),
        ("systemMessage", Def("ProtocolSystemMessageConfig"), MEANING),
        ("organizationCustomInstructions", Update, MEANING),
        ("availableTools", Open, MEANING),
        ("excludedTools", Open, MEANING),
        ("toolSearch", Sdk(tool_search), RUNNING),
        ("mcpServers", MapOf("McpServerConfig"), MEANING),
        ("disabledMcpServers", Open, MEANING),
        ("customAgents", Sdk(custom_agents), MEANING),
        ("customAgentsLocalOnly", Open, MEANING),
        ("defaultAgent", Sdk(default_agent), MEANING),
        ("agent", Sdk(agent), MEANING),
        ("excludedBuiltinAgents", Open, MEANING),
        ("enableSkills", Open, MEANING),
        ("disabledSkills", Open, MEANING),
        ("workingDirectory", Open, MEANING),
        ("additionalDirectories", Open, MEANING),
        ("streaming", Sdk(boolean), RUNNING),
        ("includeSubAgentStreamingEvents", Sdk(boolean), RUNNING),
        ("infiniteSessions", Sdk(infinite_sessions), RUNNING),
        ("memory", Open, RUNNING),
        ("sessionLimits", Open, RUNNING),
        ("largeOutput", Sdk(large_output), RUNNING),
        ("enableCitations", Open, RUNNING),
        ("enableFileChangeTracking", Open, RUNNING),
    ]
}

/// Fields of the SDK's `SessionConfigBase` the pool sets itself (a caller's is refused).
const POOL_OWNED: &[&str] = &[
    "gitHubToken",
    "gitHubTokenProvider",
    "configDirectory",
    "provider",
    "providers",
    "models",
    "capi",
    "tools",
    "hooks",
    "onPermissionRequest",
    "onUserInputRequest",
    "onElicitationRequest",
    "onExitPlanModeRequest",
    "onAutoModeSwitchRequest",
    "onMcpAuthRequest",
    "clientName",
];

/// Fields of the SDK's `SessionConfigBase` not offered over the pool, and why.
const NOT_OFFERED: &[(&str, &str)] = &[
    ("enableExperimentalMode", "experimental runtime behaviour"),
    ("enableConfigDiscovery", "reads configuration from the host"),
    ("canvases", "UI"),
    ("requestCanvasRenderer", "UI"),
    ("requestExtensions", "extensions run host code"),
    ("extensionSdkPath", "extensions run host code"),
    ("extensionInfo", "extensions run host code"),
    ("canvasProvider", "UI"),
    ("commands", "slash commands need a client handler"),
    ("includedBuiltinSkills", "host skills"),
    (
        "enableSessionTelemetry",
        "telemetry is the operator's choice",
    ),
    ("coauthorEnabled", "git commits on the host"),
    ("manageScheduleEnabled", "host scheduling"),
    ("askUserVariant", "the pool's ask_user handler decides"),
    ("enableMcpApps", "UI"),
    (
        "githubMcpToolConfig",
        "needs a GitHub identity the pool owns",
    ),
    ("mcpOAuthTokenStorage", "stores credentials on the host"),
    ("authClientIdMetadataUrl", "MCP OAuth on the host"),
    ("skillDirectories", "loads code from host paths"),
    ("pluginDirectories", "loads code from host paths"),
    ("instructionDirectories", "reads host paths"),
    ("enableManagedSettings", "fetches enterprise settings"),
    ("managedSettings", "enterprise policy is the operator's"),
    ("skipEmbeddingRetrieval", "host embedding cache"),
    ("embeddingCacheStorage", "host embedding cache"),
    ("enableOnDemandInstructionDiscovery", "reads host paths"),
    ("enableFileHooks", "runs hooks from host files"),
    ("enableHostGitOperations", "git on the host"),
    ("enableSessionStore", "host session store"),
    ("remoteSession", "remote sessions leave the pool"),
    ("onEvent", "a client callback"),
    ("createSessionFsProvider", "a client callback"),
    ("featureFlags", "runtime internals"),
    (
        "skipCustomInstructions",
        "the SDK sends it through session.options.update, not session.create",
    ),
];

fn boolean() -> Value {
    json!({"type": "boolean"})
}

fn agent() -> Value {
    json!({"type": "string", "description": "Name of the custom agent to activate when the session starts."})
}

fn tool_search() -> Value {
    json!({
        "type": "object",
        "properties": {
            "enabled": {"type": "boolean"},
            "deferThreshold": {"type": "integer", "minimum": 0}
        },
        "additionalProperties": false
    })
}

fn custom_agents() -> Value {
    json!({
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "displayName": {"type": "string"},
                "description": {"type": "string"},
                "tools": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
                "prompt": {"type": "string"},
                "mcpServers": {
                    "type": "object",
                    "additionalProperties": {"$ref": "#/definitions/McpServerConfig"}
                },
                "infer": {"type": "boolean"},
                "skills": {"type": "array", "items": {"type": "string"}},
                "model": {"type": "string"},
                "reasoningEffort": {"type": "string", "enum": ["low", "medium", "high", "xhigh", "max"]}
            },
            "required": ["name", "prompt"],
            "additionalProperties": false
        }
    })
}

fn default_agent() -> Value {
    json!({
        "type": "object",
        "properties": {"excludedTools": {"type": "array", "items": {"type": "string"}}},
        "additionalProperties": false
    })
}

fn infinite_sessions() -> Value {
    let share = json!({"type": "number", "minimum": 0, "maximum": 1});
    json!({
        "type": "object",
        "properties": {
            "enabled": {"type": "boolean"},
            "backgroundCompactionThreshold": share,
            "bufferExhaustionThreshold": share
        },
        "additionalProperties": false
    })
}

fn large_output() -> Value {
    // `outputDirectory` (`outputDir` on the wire) is a host path: not offered.
    json!({
        "type": "object",
        "properties": {
            "enabled": {"type": "boolean"},
            "maxSizeBytes": {"type": "integer", "minimum": 0}
        },
        "additionalProperties": false
    })
}

async fn package_dir() -> PathBuf {
    let exe = support::runtime::runtime_path().await;
    exe.ancestors()
        .find(|dir| dir.join("schemas/api.schema.json").is_file())
        .unwrap_or_else(|| panic!("no schemas/ folder above {}", exe.display()))
        .to_path_buf()
}

fn load(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("schema is JSON")
}

/// Every `#/definitions/<name>` a schema refers to.
fn refs(node: &Value, out: &mut BTreeSet<String>) {
    match node {
        Value::Object(map) => {
            if let Some(r) = map.get("$ref").and_then(Value::as_str)
                && let Some(name) = r.strip_prefix("#/definitions/")
            {
                out.insert(name.to_owned());
            }
            map.values().for_each(|v| refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

/// The embedded schema, generated from the shipped api schema and the table.
fn generate(api: &Value) -> Value {
    let definitions = &api["definitions"];
    let open = &definitions["SessionOpenOptions"]["properties"];
    let update = &definitions["SessionUpdateOptionsParams"]["properties"];
    let mut properties = Map::new();
    let mut meaning = Vec::new();
    for (field, source, changes_meaning) in offered() {
        let schema = match source {
            Source::Open => open.get(field).cloned(),
            Source::Update => update.get(field).cloned(),
            Source::Def(name) => definitions
                .get(name)
                .map(|_| json!({"$ref": format!("#/definitions/{name}")})),
            Source::MapOf(name) => definitions.get(name).map(|_| {
                json!({"type": "object", "additionalProperties": {"$ref": format!("#/definitions/{name}")}})
            }),
            Source::Sdk(schema) => Some(schema()),
        };
        let schema = schema.unwrap_or_else(|| {
            panic!("{field}: its source is gone from the shipped api.schema.json; update the table")
        });
        properties.insert(field.to_owned(), schema);
        if changes_meaning {
            meaning.push(field);
        }
    }
    let mut needed = BTreeSet::new();
    refs(&Value::Object(properties.clone()), &mut needed);
    let mut closure = BTreeMap::new();
    while let Some(name) = needed.pop_first() {
        if closure.contains_key(&name) {
            continue;
        }
        let def = definitions
            .get(&name)
            .unwrap_or_else(|| panic!("{name}: referenced but not defined"))
            .clone();
        let mut more = BTreeSet::new();
        refs(&def, &mut more);
        needed.extend(more.into_iter().filter(|n| !closure.contains_key(n)));
        closure.insert(name, def);
    }
    json!({
        "$schema": "https://json-schema.org/draft/2019-09/schema",
        "title": "SessionOptions",
        "description": "GENERATED by tests/session_options_schema.rs from the pinned runtime's schemas/api.schema.json (and copilot-sdk/types.d.ts for the fields the api schema lacks); do not edit. The caller-settable fields of session.create/session.resume.",
        "type": "object",
        "properties": properties,
        "additionalProperties": false,
        "x-changes-meaning": meaning,
        "definitions": closure,
    })
}

fn embedded_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/session_options/schema.json")
}

#[tokio::test]
async fn the_embedded_session_options_schema_is_the_one_generated_from_the_shipped_package() {
    let api = load(&package_dir().await.join("schemas/api.schema.json"));
    let generated = generate(&api);
    let text = format!(
        "{}\n",
        serde_json::to_string_pretty(&generated).expect("serializes")
    );
    let path = embedded_path();
    if std::env::var_os("COPILOT_POOL_REGENERATE").is_some() {
        std::fs::write(&path, &text).expect("write the embedded schema");
        return;
    }
    let embedded = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        embedded == text,
        "{} differs from what the shipped package generates; run `COPILOT_POOL_REGENERATE=1 \
         cargo test --test session_options_schema` and review the diff",
        path.display()
    );
}

/// The fields of `export interface <name> {` in a `.d.ts` file (its top-level members).
fn interface_fields(dts: &str, name: &str) -> Vec<String> {
    let start = dts
        .find(&format!("export interface {name} {{"))
        .unwrap_or_else(|| panic!("no interface {name}"));
    let mut fields = Vec::new();
    for line in dts[start..].lines().skip(1) {
        if line.starts_with('}') {
            break;
        }
        // Members are indented by exactly four spaces; doc comments start with `/**` or `*`.
        if let Some(member) = line.strip_prefix("    ")
            && let Some(end) = member.find("?:").or_else(|| member.find(':'))
        {
            let ident = &member[..end];
            if !ident.is_empty() && ident.chars().all(|c| c.is_ascii_alphanumeric()) {
                fields.push(ident.to_owned());
            }
        }
    }
    fields
}

#[tokio::test]
async fn every_field_of_the_sdks_session_config_is_offered_owned_or_deliberately_left_out() {
    let dir = package_dir().await;
    let dts = std::fs::read_to_string(dir.join("copilot-sdk/types.d.ts")).expect("types.d.ts");
    let fields = interface_fields(&dts, "SessionConfigBase");
    assert!(fields.len() > 40, "only {} fields parsed", fields.len());
    let offered: Vec<&str> = offered().into_iter().map(|(f, _, _)| f).collect();
    let mut problems = Vec::new();
    for field in &fields {
        let known = offered.contains(&field.as_str())
            || POOL_OWNED.contains(&field.as_str())
            || NOT_OFFERED.iter().any(|(f, _)| f == field);
        if !known {
            problems.push(format!(
                "{field}: new in the SDK's SessionConfigBase; offer it, own it or leave it out"
            ));
        }
    }
    for field in &offered {
        if !fields.iter().any(|f| f == field) {
            problems.push(format!(
                "{field}: offered but not in the SDK's SessionConfigBase"
            ));
        }
    }
    // The SDK passes every offered field through to `session.create` under the same name.
    let js = std::fs::read_to_string(dir.join("copilot-sdk/index.js")).expect("index.js");
    let start = js
        .find("sendRequest(\"session.create\", {")
        .expect("the SDK's session.create call");
    let call = &js[start..start + js[start..].find("});").expect("end of the call")];
    for field in &offered {
        if !call.contains(&format!("{field}: ")) {
            problems.push(format!(
                "{field}: the SDK does not send it in session.create"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
