//! A conversation's session options: the runtime's own `session.create`/`session.resume`
//! fields a caller may set, by their wire names (camelCase, as the official SDKs send them).
//! This module owns which fields are offered and checks them against the runtime's schema
//! (the embedded `schema.json`, generated from the pinned package's `schemas/api.schema.json`
//! and checked against it by `tests/session_options_schema.rs`), which fields the pool owns
//! and refuses, which fields change what a stored conversation means (they enter the compat
//! key), and which entries start local commands (`mcpServers`). Where directories may lie is
//! [`crate::confine`]'s.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use serde::Serialize;
use serde_json::{Map, Value};

/// The embedded schema of the offered fields (generated; see the module doc).
const SCHEMA: &str = include_str!("schema.json");

/// Fields the pool sets itself, and why a caller's is refused. Any other `request*` field is
/// refused too (see [`owned_reason`]).
const OWNED: &[(&str, &str)] = &[
    (
        "sessionId",
        "the pool chooses the CLI session id and binds it to the session_key",
    ),
    (
        "gitHubToken",
        "the session's identity comes from `auth` (the pool passes the token it resolves)",
    ),
    (
        "gitHubTokenProviderRegistrationId",
        "the session's identity comes from `auth`",
    ),
    (
        "configDir",
        "every agent has its own COPILOT_HOME, chosen by the pool",
    ),
    (
        "hooks",
        "hooks follow the conversation's hook handlers, which the pool answers",
    ),
    (
        "provider",
        "the BYOK provider is the request's own `provider` field (checked, and part of the \
         process key)",
    ),
    (
        "providers",
        "the BYOK provider is the request's own `provider` field",
    ),
    (
        "models",
        "the BYOK provider is the request's own `provider` field",
    ),
    ("capi", "the model provider is the pool's"),
    (
        "tools",
        "gateway tools are the turn's `tools` (their calls are answered through the pool)",
    ),
    ("envValueMode", "fixed by the pool to what the SDK sends"),
    (
        "toolFilterPrecedence",
        "fixed by the pool to what the SDK sends",
    ),
    (
        "continuePendingWork",
        "the pool decides how a stored conversation resumes",
    ),
];

/// Why the pool refuses `field` from a caller, if it owns it.
pub fn owned_reason(field: &str) -> Option<&'static str> {
    if let Some((_, why)) = OWNED.iter().find(|(f, _)| *f == field) {
        return Some(why);
    }
    field.starts_with("request").then_some(
        "the pool answers the runtime's requests (tools, permissions, ask_user) itself; they \
         follow the conversation's handlers",
    )
}

/// Why session options were refused. Every message names the field and says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionOptionsError {
    /// The options are not a JSON object.
    #[error(
        "session must be a JSON object of the runtime's session.create fields (camelCase), \
         not {found}"
    )]
    NotAnObject {
        /// The JSON type found instead.
        found: &'static str,
    },
    /// A field the pool sets itself.
    #[error("session.{field} is set by the pool and cannot be passed: {reason}; remove it")]
    Owned {
        /// The field.
        field: String,
        /// Why the pool owns it.
        reason: &'static str,
    },
    /// A field that is not offered, or a value of the wrong type or shape.
    #[error(
        "session.{field}: {message}; see the `session` object in the README for the accepted \
         fields and their types (the runtime's session.create fields)"
    )]
    Invalid {
        /// The field's path (`mcpServers.web.url`).
        field: String,
        /// What is wrong (values are not repeated: they may hold secrets).
        message: String,
    },
    /// An MCP server that starts a local command, where the daemon does not allow them.
    #[error(
        "session.{field} starts a local command, which this daemon does not allow; use a \
         remote server (`type` \"http\" or \"sse\" with a `url`), or set \
         allow_local_mcp_servers = true in the daemon's config"
    )]
    LocalMcpServer {
        /// The entry's path (`mcpServers.git` or `customAgents.0.mcpServers.git`).
        field: String,
    },
    /// The embedded schema does not compile (a bug: the generated file is broken).
    #[error("the embedded session options schema is unusable ({0}); please report this")]
    Schema(String),
}

/// The compiled schema and what the generator recorded beside it.
struct Compiled {
    validator: jsonschema::Validator,
    changes_meaning: BTreeSet<String>,
}

fn compiled() -> Result<&'static Compiled, SessionOptionsError> {
    static COMPILED: OnceLock<Result<Compiled, String>> = OnceLock::new();
    COMPILED
        .get_or_init(|| {
            let schema: Value = serde_json::from_str(SCHEMA).map_err(|e| e.to_string())?;
            let validator = jsonschema::options()
                .with_draft(jsonschema::Draft::Draft201909)
                .build(&schema)
                .map_err(|e| e.to_string())?;
            let changes_meaning = schema["x-changes-meaning"]
                .as_array()
                .map(|fields| {
                    fields
                        .iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            Ok(Compiled {
                validator,
                changes_meaning,
            })
        })
        .as_ref()
        .map_err(|e| SessionOptionsError::Schema(e.clone()))
}

/// Compiles the embedded schema now instead of on the first lease that carries options (a
/// daemon calls it at start: the compile is the slowest step of a first lease's checks, and a
/// broken schema is then found before any traffic). Idempotent and cheap after the first call.
pub fn compile_schema() -> Result<(), SessionOptionsError> {
    compiled().map(|_| ())
}

/// Whether a change of `field` changes what a stored conversation means (so the pool starts
/// a new CLI session), as opposed to how the next turns run.
pub fn changes_meaning(field: &str) -> bool {
    compiled().is_ok_and(|c| c.changes_meaning.contains(field))
}

/// Session options: a JSON object of offered `session.create` fields, checked when built
/// and again by the pool on every lease. Build one from JSON ([`SessionOptions::from_value`]),
/// from any `Serialize` type with the wire's field names ([`SessionOptions::from_typed`]), or
/// field by field ([`SessionOptions::set`]).
#[derive(Clone, Default, PartialEq)]
pub struct SessionOptions {
    fields: Map<String, Value>,
}

/// Field names only: values may hold secrets (an MCP server's headers or environment).
impl std::fmt::Debug for SessionOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.fields.keys()).finish()
    }
}

impl SessionOptions {
    /// No options.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks a JSON object of session options.
    pub fn from_value(value: Value) -> Result<Self, SessionOptionsError> {
        let fields = match value {
            Value::Object(map) => map,
            other => {
                return Err(SessionOptionsError::NotAnObject {
                    found: json_type(&other),
                });
            }
        };
        let options = Self { fields };
        options.validate()?;
        Ok(options)
    }

    /// Checks options given as a `Serialize` type whose fields serialize under the wire
    /// names (for example a struct with `#[serde(rename_all = "camelCase")]`).
    pub fn from_typed<T: Serialize>(options: &T) -> Result<Self, SessionOptionsError> {
        let value = serde_json::to_value(options).map_err(|e| SessionOptionsError::Invalid {
            field: String::new(),
            message: format!("could not serialize the options: {e}"),
        })?;
        Self::from_value(value)
    }

    /// Sets one field (its wire name), checked with the others.
    pub fn set(
        &mut self,
        field: &str,
        value: impl Serialize,
    ) -> Result<&mut Self, SessionOptionsError> {
        let value = serde_json::to_value(value).map_err(|e| SessionOptionsError::Invalid {
            field: field.to_owned(),
            message: format!("could not serialize the value: {e}"),
        })?;
        let mut fields = self.fields.clone();
        fields.insert(field.to_owned(), value);
        let candidate = Self { fields };
        candidate.validate()?;
        *self = candidate;
        Ok(self)
    }

    /// The value of a field.
    pub fn get(&self, field: &str) -> Option<&Value> {
        self.fields.get(field)
    }

    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// The fields, by wire name.
    pub fn fields(&self) -> &Map<String, Value> {
        &self.fields
    }

    /// The fields, to replace values in place (the directories, by their resolved paths;
    /// what goes in is not checked again).
    #[cfg(feature = "http")]
    pub(crate) fn fields_mut(&mut self) -> &mut Map<String, Value> {
        &mut self.fields
    }

    /// Adds every field of `other` (its values win), checked with the others.
    pub fn extend(&mut self, other: SessionOptions) -> Result<(), SessionOptionsError> {
        let mut fields = self.fields.clone();
        fields.extend(other.fields);
        let candidate = Self { fields };
        candidate.validate()?;
        *self = candidate;
        Ok(())
    }

    /// Removes a field and returns its value.
    pub fn remove(&mut self, field: &str) -> Option<Value> {
        self.fields.remove(field)
    }

    /// Checks the fields: none the pool owns, and every one offered with a value of the
    /// runtime's type. The first problem is returned, naming its field.
    pub fn validate(&self) -> Result<(), SessionOptionsError> {
        if let Some((field, reason)) = self
            .fields
            .keys()
            .find_map(|f| owned_reason(f).map(|why| (f, why)))
        {
            return Err(SessionOptionsError::Owned {
                field: field.clone(),
                reason,
            });
        }
        let compiled = compiled()?;
        let instance = Value::Object(self.fields.clone());
        let Some(error) = compiled.validator.iter_errors(&instance).next() else {
            return Ok(());
        };
        let mut path: Vec<String> = error
            .instance_path()
            .segments()
            .map(|s| s.to_string())
            .collect();
        let message = match error.kind() {
            jsonschema::error::ValidationErrorKind::AdditionalProperties { unexpected } => {
                path.extend(unexpected.first().cloned());
                if path.len() == 1 {
                    "not a field the pool accepts".to_owned()
                } else {
                    "not a field of this object".to_owned()
                }
            }
            _ => error.masked().to_string(),
        };
        Err(SessionOptionsError::Invalid {
            field: path.join("."),
            message,
        })
    }

    /// The fields that change what a stored conversation means, for the compat key (empty
    /// when there are none, so conversations without options keep their key).
    pub fn meaning(&self) -> Map<String, Value> {
        self.fields
            .iter()
            .filter(|(field, _)| changes_meaning(field))
            .map(|(f, v)| (f.clone(), v.clone()))
            .collect()
    }

    /// The paths of the MCP server entries that start a local command: in `mcpServers`
    /// and in every custom agent's `mcpServers`. An entry is remote only with a `url`, no
    /// `command`, and `type` absent, `http` or `sse`.
    pub fn local_mcp_servers(&self) -> Vec<String> {
        local_mcp_servers(&self.fields)
    }

    /// Refuses MCP servers that start local commands (unless `allowed`).
    pub fn check_mcp_servers(&self, allowed: bool) -> Result<(), SessionOptionsError> {
        match self.local_mcp_servers().into_iter().next() {
            Some(field) if !allowed => Err(SessionOptionsError::LocalMcpServer { field }),
            _ => Ok(()),
        }
    }
}

/// The paths of the MCP server entries of session `fields` (wire names) that start a local
/// command (see [`SessionOptions::local_mcp_servers`]); for params read elsewhere (the SDK
/// endpoint's `session.create`).
pub fn local_mcp_servers(fields: &Map<String, Value>) -> Vec<String> {
    let mut local = Vec::new();
    if let Some(servers) = fields.get("mcpServers") {
        local_servers_in(servers, "mcpServers", &mut local);
    }
    if let Some(Value::Array(agents)) = fields.get("customAgents") {
        for (i, agent) in agents.iter().enumerate() {
            if let Some(servers) = agent.get("mcpServers") {
                local_servers_in(servers, &format!("customAgents.{i}.mcpServers"), &mut local);
            }
        }
    }
    local
}

fn local_servers_in(servers: &Value, prefix: &str, out: &mut Vec<String>) {
    let Value::Object(servers) = servers else {
        return;
    };
    for (name, entry) in servers {
        let remote = entry.get("command").is_none()
            && entry.get("url").is_some()
            && matches!(
                entry.get("type").and_then(Value::as_str),
                None | Some("http" | "sse")
            )
            && entry.get("type").is_none_or(Value::is_string);
        if !remote {
            out.push(format!("{prefix}.{name}"));
        }
    }
}

pub(crate) fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(value: Value) -> SessionOptionsError {
        SessionOptions::from_value(value).unwrap_err()
    }

    #[test]
    fn the_embedded_schema_compiles() {
        assert!(compiled().is_ok(), "{:?}", compiled().err());
    }

    #[test]
    fn offered_fields_of_the_runtimes_types_are_accepted() {
        let options = SessionOptions::from_value(json!({
            "systemMessage": {"mode": "replace", "content": "You are terse."},
            "availableTools": ["custom:*"],
            "excludedTools": ["builtin:bash"],
            "infiniteSessions": {"enabled": false},
            "customAgents": [{"name": "reviewer", "prompt": "Review."}],
            "reasoningSummary": "concise",
            "contextTier": "long_context",
            "enableCitations": true,
            "memory": {"enabled": false},
            "streaming": false,
            "mcpServers": {"web": {"type": "http", "url": "https://mcp.example/mcp"}},
        }))
        .unwrap();
        assert_eq!(options.fields().len(), 11);
    }

    #[test]
    fn a_wrong_type_or_an_unknown_field_is_refused_naming_the_field() {
        let e = refused(json!({"systemMessage": 5}));
        assert!(
            matches!(&e, SessionOptionsError::Invalid { field, .. } if field == "systemMessage"),
            "{e}"
        );
        let e = refused(json!({"availableTools": ["a", 3]}));
        assert!(
            e.to_string().starts_with("session.availableTools.1:"),
            "{e}"
        );
        let e = refused(json!({"infiniteSessions": {"enabled": "yes"}}));
        assert!(
            e.to_string()
                .starts_with("session.infiniteSessions.enabled:"),
            "{e}"
        );
        let e = refused(json!({"systemPrompt": "x"}));
        assert!(
            e.to_string()
                .starts_with("session.systemPrompt: not a field"),
            "{e}"
        );
        let e = refused(json!({"memory": {"enabled": true, "extra": 1}}));
        assert!(e.to_string().starts_with("session.memory.extra:"), "{e}");
        let e = refused(json!({"contextTier": "huge"}));
        assert!(e.to_string().starts_with("session.contextTier:"), "{e}");
        assert!(matches!(
            refused(json!(["x"])),
            SessionOptionsError::NotAnObject { found: "an array" }
        ));
    }

    #[test]
    fn debug_shows_field_names_and_no_values() {
        let options = SessionOptions::from_value(json!({
            "mcpServers": {"s": {"type": "http", "url": "https://m/", "headers": {"Authorization": "Bearer sk-secret-3"}}},
        }))
        .unwrap();
        let text = format!("{options:?}");
        assert_eq!(text, "{\"mcpServers\"}");
    }

    #[test]
    fn a_refusal_does_not_repeat_the_value() {
        let e = refused(
            json!({"mcpServers": {"s": {"type": "http", "url": 7, "headers": {"Authorization": "Bearer sk-secret-1"}}}}),
        );
        assert!(!e.to_string().contains("sk-secret-1"), "{e}");
        let e = refused(json!({"agent": ["sk-secret-2"]}));
        assert!(!e.to_string().contains("sk-secret-2"), "{e}");
    }

    #[test]
    fn fields_the_pool_owns_are_refused_with_the_reason() {
        for field in [
            "sessionId",
            "gitHubToken",
            "configDir",
            "requestPermission",
            "requestUserInput",
            "requestElicitation",
            "hooks",
            "provider",
            "tools",
        ] {
            let e = refused(json!({ field: true }));
            assert!(
                matches!(&e, SessionOptionsError::Owned { field: f, .. } if f == field),
                "{field}: {e}"
            );
            assert!(e.to_string().contains("set by the pool"), "{e}");
        }
        let mut options = SessionOptions::new();
        assert!(options.set("gitHubToken", "ghu_x").is_err());
        assert!(options.is_empty(), "a refused set changes nothing");
    }

    #[test]
    fn only_remote_mcp_servers_pass_unless_local_ones_are_allowed() {
        let options = SessionOptions::from_value(json!({
            "mcpServers": {
                "web": {"type": "http", "url": "https://mcp.example/mcp"},
                "events": {"type": "sse", "url": "https://mcp.example/sse"},
                "plain": {"url": "https://mcp.example/plain"},
                "git": {"command": "git-mcp", "args": ["serve"]},
                "shell": {"type": "local", "command": "sh"},
            },
            "customAgents": [{"name": "a", "prompt": "p", "mcpServers": {"tool": {"type": "stdio", "command": "x"}}}],
        }))
        .unwrap();
        let mut local = options.local_mcp_servers();
        local.sort();
        assert_eq!(
            local,
            [
                "customAgents.0.mcpServers.tool",
                "mcpServers.git",
                "mcpServers.shell"
            ]
        );
        let e = options.check_mcp_servers(false).unwrap_err();
        assert!(e.to_string().contains("allow_local_mcp_servers"), "{e}");
        assert!(options.check_mcp_servers(true).is_ok());
        let remote = SessionOptions::from_value(
            json!({"mcpServers": {"web": {"type": "http", "url": "https://m/"}}}),
        )
        .unwrap();
        assert!(remote.check_mcp_servers(false).is_ok());
    }

    #[test]
    fn what_a_conversation_means_is_split_from_how_it_runs() {
        for field in [
            "model",
            "systemMessage",
            "availableTools",
            "excludedTools",
            "customAgents",
            "mcpServers",
            "workingDirectory",
        ] {
            assert!(changes_meaning(field), "{field}");
        }
        for field in [
            "reasoningEffort",
            "streaming",
            "infiniteSessions",
            "enableCitations",
            "reasoningSummary",
        ] {
            assert!(!changes_meaning(field), "{field}");
        }
        let options = SessionOptions::from_value(json!({
            "systemMessage": {"content": "x"},
            "streaming": true,
            "reasoningSummary": "none",
        }))
        .unwrap();
        assert_eq!(
            Value::Object(options.meaning()),
            json!({"systemMessage": {"content": "x"}})
        );
    }
}
