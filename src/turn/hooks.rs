//! Turn hooks: the gateway's view of what happens in a turn, fed from `hooks.invoke`
//! requests and from the event stream. A hook that fails or hangs never stalls the runtime:
//! the request is answered `{}` and the failure is logged and counted.

use std::future::Future;
use std::pin::Pin;

use serde_json::Value;

/// A hook's optional output (`{output}` for hooks the runtime asks about).
pub type HookFuture = Pin<Box<dyn Future<Output = Result<Option<Value>, String>> + Send>>;

fn nothing() -> HookFuture {
    Box::pin(async { Ok(None) })
}

/// Hooks of a conversation. Every method has a no-op default.
///
/// | hook | fed from |
/// |---|---|
/// | `before_prompt_build` | `hooks.invoke userPromptSubmitted` (output goes back to the runtime) |
/// | `llm_input` | `assistant.turn_start` (one model call begins) |
/// | `llm_output` | `assistant.message` |
/// | `agent_end` | `hooks.invoke agentStop` |
/// | `before_compaction` / `after_compaction` | a compaction that happened, a background one or one asked for with `Lease::compact`: its `session.compaction_complete` with `success`, read in a turn, between turns (as the next starts) or as `Lease::compact` returns; the input is its `session.compaction_start` (`trigger`, `currentTokens`) with `customInstructions` when it was asked to keep something; both fire, in order, after the fact, once, and neither for a compaction that did not happen |
/// | `before_tool_call` | `hooks.invoke preToolUse` (output, e.g. a permission decision, goes back) |
/// | `after_tool_call` | `hooks.invoke postToolUse` and `postToolUseFailure` |
pub trait TurnHooks: Send + Sync + 'static {
    /// The user prompt was submitted.
    fn before_prompt_build(&self, _input: Value) -> HookFuture {
        nothing()
    }
    /// A model call starts.
    fn llm_input(&self, _input: Value) -> HookFuture {
        nothing()
    }
    /// The model answered.
    fn llm_output(&self, _output: Value) -> HookFuture {
        nothing()
    }
    /// The agent stopped.
    fn agent_end(&self, _input: Value) -> HookFuture {
        nothing()
    }
    /// A compaction starts.
    fn before_compaction(&self, _input: Value) -> HookFuture {
        nothing()
    }
    /// A compaction ended.
    fn after_compaction(&self, _output: Value) -> HookFuture {
        nothing()
    }
    /// A tool is about to run.
    fn before_tool_call(&self, _input: Value) -> HookFuture {
        nothing()
    }
    /// A tool ran.
    fn after_tool_call(&self, _input: Value) -> HookFuture {
        nothing()
    }
}

/// A [`TurnHooks`] method.
pub(crate) type HookMethod = fn(&dyn TurnHooks, Value) -> HookFuture;

/// Which hook a runtime `hookType` feeds, if any.
pub(crate) fn for_hook_type(hook_type: &str) -> Option<HookMethod> {
    match hook_type {
        "userPromptSubmitted" => Some(|hooks, input| hooks.before_prompt_build(input)),
        "preToolUse" => Some(|hooks, input| hooks.before_tool_call(input)),
        "postToolUse" | "postToolUseFailure" => Some(|hooks, input| hooks.after_tool_call(input)),
        "agentStop" => Some(|hooks, input| hooks.agent_end(input)),
        _ => None,
    }
}
