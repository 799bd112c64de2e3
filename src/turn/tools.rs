//! Gateway tools: what a conversation registers with the runtime and how a call is run.
//!
//! A tool is a name, a description, a JSON schema and an async handler. It is sent with
//! `skipPermission: true` (the gateway enforces its policy inside its handler) and with
//! `overridesBuiltInTool: true` when its name shadows a built-in. Sequential tools run one at
//! a time and after every earlier call; concurrent tools run side by side.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::rpc::messages::ToolDefinition;

/// Built-in tool names of the runtime (reference §10.4); a gateway tool with one of these
/// names overrides the built-in.
pub const BUILT_IN_TOOLS: &[&str] = &[
    "bash",
    "read_bash",
    "stop_bash",
    "list_bash",
    "view",
    "create",
    "edit",
    "web_fetch",
    "semantic_code_search",
    "skill",
    "sql",
    "read_agent",
    "list_agents",
    "write_agent",
    "grep",
    "glob",
    "task",
    "ask_user",
];

/// One call of a gateway tool.
#[derive(Debug, Clone)]
pub struct ToolCall {
    /// The tool's name.
    pub tool_name: String,
    /// The model's id for this call.
    pub tool_call_id: String,
    /// The arguments, as the model produced them.
    pub arguments: Value,
    /// The CLI session the call belongs to.
    pub session_id: String,
    /// The session's working directory, when the runtime says.
    pub working_directory: Option<String>,
}

/// What a tool handler returns: text for the model, or an error message (the model sees a
/// failure result).
pub type ToolFuture = Pin<Box<dyn Future<Output = Result<String, String>> + Send>>;

/// Runs a tool call.
pub trait ToolHandler: Send + Sync + 'static {
    /// Runs one call.
    fn call(&self, call: ToolCall) -> ToolFuture;
}

impl<F, Fut> ToolHandler for F
where
    F: Fn(ToolCall) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<String, String>> + Send + 'static,
{
    fn call(&self, call: ToolCall) -> ToolFuture {
        Box::pin(self(call))
    }
}

/// How calls of a tool relate to other calls in the same turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolConcurrency {
    /// Runs alongside other concurrent calls.
    #[default]
    Concurrent,
    /// Waits for every earlier call and blocks later ones.
    Sequential,
}

/// A tool the gateway offers to one conversation.
#[derive(Clone)]
pub struct GatewayTool {
    /// Name (unique in the conversation).
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// JSON schema of the arguments.
    pub parameters: Value,
    /// Sequential or concurrent.
    pub concurrency: ToolConcurrency,
    /// Overrides the turn's tool timeout for this tool.
    pub timeout: Option<Duration>,
    pub(crate) handler: Arc<dyn ToolHandler>,
}

impl fmt::Debug for GatewayTool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatewayTool")
            .field("name", &self.name)
            .field("concurrency", &self.concurrency)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl GatewayTool {
    /// A concurrent tool with the turn's default timeout.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: Value,
        handler: impl ToolHandler,
    ) -> Self {
        Self {
            name: name.into(),
            description: description.into(),
            parameters,
            concurrency: ToolConcurrency::Concurrent,
            timeout: None,
            handler: Arc::new(handler),
        }
    }

    /// Makes the tool sequential.
    pub fn sequential(mut self) -> Self {
        self.concurrency = ToolConcurrency::Sequential;
        self
    }

    /// Sets this tool's own timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The tool as the runtime sees it.
    pub fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: self.name.clone(),
            description: self.description.clone(),
            parameters: self.parameters.clone(),
            skip_permission: Some(true),
            overrides_built_in_tool: BUILT_IN_TOOLS.contains(&self.name.as_str()).then_some(true),
        }
    }

    pub(crate) fn handler(&self) -> Arc<dyn ToolHandler> {
        self.handler.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn definitions_skip_permission_and_override_built_ins_by_name() {
        let plain = GatewayTool::new("lookup", "d", json!({}), |_c: ToolCall| async {
            Ok("x".to_owned())
        });
        let d = plain.definition();
        assert_eq!(d.skip_permission, Some(true));
        assert_eq!(d.overrides_built_in_tool, None);
        let shadow = GatewayTool::new("view", "d", json!({}), |_c: ToolCall| async {
            Ok("x".to_owned())
        });
        assert_eq!(shadow.definition().overrides_built_in_tool, Some(true));
        assert_eq!(shadow.sequential().concurrency, ToolConcurrency::Sequential);
    }
}
