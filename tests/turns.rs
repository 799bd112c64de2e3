//! End-to-end: the turn API over real runtime processes and the scripted model — gateway
//! tools, the permission policy, ask_user, hooks, timeouts, typed errors, compaction and the
//! transcript mirror.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use copilot_pool::permission::{
    ApproveAll, DecisionFuture, PermissionDecision, PermissionPolicy, PermissionRequest, Rule,
    RulePolicy,
};
use copilot_pool::pool::{LeaseRequest, OpenReason, Pool, PoolError};
use copilot_pool::transcript::{TranscriptMode, count_duplicates};
use copilot_pool::turn::hooks::HookFuture;
use copilot_pool::turn::{
    Answer, GatewayTool, Question, TimeoutKind, ToolCall, TranscriptSettings, TurnError, TurnHooks,
};
use serde_json::{Value, json};
use support::pool_fixture::{Fixture, shutdown_leaves_nothing};
use tokio::sync::mpsc;

fn lookup_tool() -> GatewayTool {
    GatewayTool::new(
        "lookup_number",
        "Looks up the number for a key",
        json!({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
        |call: ToolCall| async move {
            match call.arguments["key"].as_str() {
                Some("alpha") => Ok("the number is 42".to_owned()),
                Some("panic") => panic!("handler bug"),
                other => Err(format!("no number for {other:?}")),
            }
        },
    )
}

fn call_tool(name: &str, args: Value) -> String {
    format!("SCENARIO:tool NAME={name} ARGS={args}")
}

fn with_tools(fx: &Fixture, key: &str, tools: Vec<GatewayTool>) -> LeaseRequest {
    let mut req = fx.request("agent-t", key);
    req.available_tools = None;
    req.handlers.tools = tools;
    req
}

#[tokio::test]
async fn gateway_tools_answer_and_failures_become_failure_results() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut lease = pool
        .lease(with_tools(&fx, "tools", vec![lookup_tool()]))
        .await
        .expect("lease");
    let ok = lease
        .run(call_tool("lookup_number", json!({"key": "alpha"})))
        .await
        .expect("turn");
    assert_eq!(ok.text, "tool said: the number is 42");
    assert_eq!(ok.gateway_tool_calls, 1);
    assert_eq!(ok.model_calls, 2);
    let failed = lease
        .run(call_tool("lookup_number", json!({"key": "beta"})))
        .await
        .expect("turn");
    assert!(failed.text.contains("no number for"), "{}", failed.text);
    let panicked = lease
        .run(call_tool("lookup_number", json!({"key": "panic"})))
        .await
        .expect("a panicking handler still answers");
    assert!(
        panicked.text.contains("panicked: handler bug"),
        "{}",
        panicked.text
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

/// The session event types one tool turn on `lease` yields, and its outcome.
async fn turn_event_types(
    lease: &mut copilot_pool::Lease,
) -> (Vec<String>, copilot_pool::TurnOutcome) {
    lease
        .send(call_tool("lookup_number", json!({"key": "alpha"})))
        .await
        .expect("send");
    let mut types = Vec::new();
    while let Some(event) = lease.next_event().await {
        types.push(event.expect("event").event_type().to_owned());
    }
    (types, lease.outcome())
}

#[tokio::test]
async fn events_the_caller_and_the_pool_leave_unread_never_reach_the_lease_and_the_turn_still_completes()
 {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    // Written out here, not taken from `rpc::unread_by_the_pool`: the test checks that list.
    let unread_by_the_pool = |t: &String| t.starts_with("model.") || t == "system.message";

    // Read whole, a tool turn carries the runtime's internal events and its system prompt.
    let mut lease = pool
        .lease(with_tools(&fx, "unread", vec![lookup_tool()]))
        .await
        .expect("lease");
    let (all, outcome) = turn_event_types(&mut lease).await;
    assert_eq!(outcome.text, "tool said: the number is 42");
    assert!(all.iter().any(|t| t == "system.message"), "{all:?}");
    assert!(all.iter().any(|t| t.starts_with("model.")), "{all:?}");
    drop(lease);

    // A caller that reads nothing: the pool still reads what a turn needs.
    let mut req = with_tools(&fx, "unread", vec![lookup_tool()]);
    req.handlers.unread_events = Some(Arc::new(|_: &str| true));
    let mut lease = pool.lease(req).await.expect("lease");
    let (read, outcome) = turn_event_types(&mut lease).await;
    assert_eq!(outcome.text, "tool said: the number is 42");
    assert_eq!(outcome.gateway_tool_calls, 1);
    assert_eq!(outcome.model_calls, 2);
    assert!(!read.iter().any(unread_by_the_pool), "{read:?}");
    for needed in [
        "external_tool.requested",
        "assistant.message",
        "session.idle",
    ] {
        assert!(read.iter().any(|t| t == needed), "{needed} in {read:?}");
    }
    assert_eq!(outcome.events, read.len());
    drop(lease);

    // The next lease reads everything again: nothing is left registered.
    let mut lease = pool
        .lease(with_tools(&fx, "unread", vec![lookup_tool()]))
        .await
        .expect("lease");
    let (again, _) = turn_event_types(&mut lease).await;
    assert!(again.iter().any(|t| t == "system.message"), "{again:?}");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

/// Runs one turn in which the model calls `step` three times at once, and returns the
/// largest number of calls that ran at the same time.
async fn max_overlap(sequential: bool) -> u32 {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let running = Arc::new(Mutex::new((0u32, 0u32))); // (now, max)
    let (entered_tx, entered) = tokio::sync::watch::channel(0u32);
    let entered_tx = Arc::new(entered_tx);
    let mut tool = {
        let running = running.clone();
        GatewayTool::new(
            "step",
            "a step",
            json!({"type": "object"}),
            move |_c: ToolCall| {
                let running = running.clone();
                let entered_tx = entered_tx.clone();
                let mut entered = entered.clone();
                async move {
                    {
                        let mut r = running.lock().expect("lock");
                        r.0 += 1;
                        r.1 = r.1.max(r.0);
                    }
                    entered_tx.send_modify(|n| *n += 1);
                    // Concurrent calls wait for each other (all three inside at once); a
                    // sequential call only waits a moment for a second one that never comes.
                    let _ = tokio::time::timeout(
                        Duration::from_millis(300),
                        entered.wait_for(|n| *n >= 3),
                    )
                    .await;
                    running.lock().expect("lock").0 -= 1;
                    Ok("step done".to_owned())
                }
            },
        )
    };
    if sequential {
        tool = tool.sequential();
    }
    let mut lease = pool
        .lease(with_tools(&fx, "overlap", vec![tool]))
        .await
        .expect("lease");
    let outcome = lease
        .run("SCENARIO:tool NAME=step COUNT=3 ARGS={}")
        .await
        .expect("turn");
    assert_eq!(outcome.gateway_tool_calls, 3, "{outcome:?}");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
    running.lock().expect("lock").1
}

#[tokio::test]
async fn sequential_tools_never_overlap_and_concurrent_ones_do() {
    assert_eq!(max_overlap(true).await, 1);
    assert_eq!(max_overlap(false).await, 3);
}

fn bash(command: &str) -> String {
    call_tool(
        "bash",
        json!({"command": command, "description": "run it", "mode": "sync", "initial_wait": 10}),
    )
}

#[tokio::test]
async fn built_in_bash_is_rejected_by_default_and_allowed_by_a_rule() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut req = fx.request("agent-t", "bash-default");
    req.available_tools = None;
    let mut lease = pool.lease(req).await.expect("lease");
    let rejected = lease.run(bash("echo hello-from-bash")).await.expect("turn");
    assert_eq!(rejected.permission_prompts, 1);
    assert!(
        !rejected.text.contains("hello-from-bash\n"),
        "{}",
        rejected.text
    );
    assert!(
        rejected.text.to_lowercase().contains("reject")
            || rejected.text.to_lowercase().contains("denied"),
        "{}",
        rejected.text
    );
    drop(lease);

    let mut req = fx.request("agent-t", "bash-rule");
    req.available_tools = None;
    let seen = Arc::new(Mutex::new(Vec::new()));
    req.handlers.permission_policy = Arc::new(Recording {
        inner: RulePolicy::new(vec![Rule {
            kind: "shell".into(),
            command: Some("echo *".into()),
            path: None,
            url: None,
            decision: PermissionDecision::Approve,
        }]),
        seen: seen.clone(),
    });
    let working_directory = req.working_directory.clone();
    let mut lease = pool.lease(req).await.expect("lease");
    let allowed = lease.run(bash("echo hello-from-bash")).await.expect("turn");
    assert!(allowed.text.contains("hello-from-bash"), "{}", allowed.text);
    let other = lease.run(bash("ls /")).await.expect("turn");
    assert!(
        !other.text.contains("bin"),
        "a command outside the rule ran: {}",
        other.text
    );
    // `echo *` covers the first command only: the line is not approved.
    let chained = lease
        .run(bash("echo hello-from-bash; ls /"))
        .await
        .expect("turn");
    assert_eq!(chained.permission_prompts, 1);
    assert!(
        !chained.text.contains("bin"),
        "a command after an operator ran: {}",
        chained.text
    );
    drop(lease);
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for request in &seen {
        // The policy takes relative paths against the conversation's working directory.
        assert_eq!(request.working_directory.as_ref(), Some(&working_directory));
    }
    assert_eq!(
        seen[2].command.as_deref(),
        Some("echo hello-from-bash; ls /")
    );
    shutdown_leaves_nothing(&pool).await;
}

/// A policy that records every request it is asked about, then asks another.
struct Recording {
    inner: RulePolicy,
    seen: Arc<Mutex<Vec<PermissionRequest>>>,
}

impl PermissionPolicy for Recording {
    fn decide(&self, request: PermissionRequest) -> DecisionFuture {
        self.seen.lock().expect("lock").push(request.clone());
        self.inner.decide(request)
    }
}

/// Runs each prompt as one turn of the conversation `key`, whose policy answers every
/// permission request `decision`; returns each turn's permission prompts and text.
async fn turns_answered(
    fx: &Fixture,
    pool: &Pool,
    key: &str,
    decision: PermissionDecision,
    prompts: &[String],
) -> Vec<(u32, String)> {
    let mut req = fx.request("agent-t", key);
    req.available_tools = None;
    req.handlers.permission_policy = Arc::new(RulePolicy::new(vec![]).otherwise(decision));
    let mut lease = pool.lease(req).await.expect("lease");
    let mut turns = Vec::new();
    for prompt in prompts {
        let outcome = lease.run(prompt.as_str()).await.expect("turn");
        turns.push((outcome.permission_prompts, outcome.text));
    }
    turns
}

#[tokio::test]
async fn approve_for_session_runs_the_same_shell_line_and_later_writes_unasked_and_approve_once_asks_each_time()
 {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let dir = fx.scratch.path().to_path_buf();
    let create = |name: &str| {
        call_tool(
            "create",
            json!({"path": dir.join(name), "file_text": format!("{name} written")}),
        )
    };
    let prompts = |tag: &str| {
        vec![
            bash("echo remembered-line"),
            // Not the approved line: a command after it is asked for.
            bash("echo remembered-line && echo chained"),
            bash("echo remembered-line"),
            create(&format!("{tag}-first.txt")),
            create(&format!("{tag}-second.txt")),
        ]
    };
    let asked = |turns: &[(u32, String)]| turns.iter().map(|t| t.0).collect::<Vec<_>>();

    let session = turns_answered(
        &fx,
        &pool,
        "for-session",
        PermissionDecision::ApproveForSession,
        &prompts("session"),
    )
    .await;
    assert_eq!(asked(&session), [1, 1, 0, 1, 0], "{session:?}");
    // What ran unasked ran: the line's output, the second file.
    assert!(session[2].1.contains("remembered-line\n"), "{session:?}");
    assert!(session[1].1.contains("chained"), "{session:?}");
    for name in ["session-first.txt", "session-second.txt"] {
        let text = std::fs::read_to_string(dir.join(name)).expect(name);
        assert_eq!(text, format!("{name} written"));
    }

    let once = turns_answered(
        &fx,
        &pool,
        "once",
        PermissionDecision::Approve,
        &prompts("once"),
    )
    .await;
    assert_eq!(asked(&once), [1, 1, 1, 1, 1], "{once:?}");
    assert!(once[2].1.contains("remembered-line\n"), "{once:?}");
    assert!(dir.join("once-second.txt").exists());
    shutdown_leaves_nothing(&pool).await;
}

/// A policy that never decides.
struct Undecided;

impl PermissionPolicy for Undecided {
    fn decide(&self, _request: PermissionRequest) -> DecisionFuture {
        Box::pin(std::future::pending())
    }
}

#[tokio::test]
async fn a_permission_the_policy_does_not_decide_in_time_is_rejected_and_the_turn_goes_on() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut req = fx.request("agent-t", "undecided");
    req.available_tools = None;
    req.handlers.permission_policy = Arc::new(Undecided);
    req.handlers.timeouts.permission = Duration::from_millis(300);
    let mut lease = pool.lease(req).await.expect("lease");
    let outcome = lease
        .run(bash("echo never-approved").as_str())
        .await
        .expect("the turn goes on past the late rejection");
    assert_eq!(outcome.permission_prompts, 1, "{outcome:?}");
    assert!(!outcome.text.contains("never-approved\n"), "{outcome:?}");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

fn ask(choices_freeform: bool) -> String {
    call_tool(
        "ask_user",
        json!({"question": "Pick a colour", "choices": ["red", "blue"], "allow_freeform": choices_freeform}),
    )
}

#[tokio::test]
async fn ask_user_by_index_label_free_text_and_timeout() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let cases: Vec<(&str, Option<Answer>, &str)> = vec![
        ("index", Some(Answer::Choice(1)), "blue"),
        ("label", Some(Answer::Label("Red".into())), "red"),
        ("free", Some(Answer::FreeText("green".into())), "green"),
    ];
    for (key, answer, expect) in cases {
        let mut req = fx.request("agent-t", key);
        req.available_tools = None;
        let answer = answer.clone();
        req.handlers.user_input = Some(Arc::new(move |q: Question| {
            let answer = answer.clone();
            async move {
                assert_eq!(q.choices, vec!["red".to_owned(), "blue".to_owned()]);
                answer
            }
        }));
        let mut lease = pool.lease(req).await.expect("lease");
        let outcome = lease.run(ask(true)).await.expect("turn");
        assert_eq!(outcome.user_inputs, 1);
        assert!(outcome.text.contains(expect), "{key}: {}", outcome.text);
    }
    // Nobody answers within the timeout: an empty free-form answer, and the turn goes on.
    let mut req = fx.request("agent-t", "silent");
    req.available_tools = None;
    req.handlers.timeouts.user_input = Duration::from_millis(300);
    req.handlers.user_input = Some(Arc::new(|_q: Question| {
        std::future::pending::<Option<Answer>>()
    }));
    let mut lease = pool.lease(req).await.expect("lease");
    let outcome = lease
        .run(ask(true))
        .await
        .expect("turn after a silent user");
    assert_eq!(outcome.user_inputs, 1);
    assert!(!outcome.aborted);
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn aborting_a_turn_cancels_the_pending_question() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let (asked_tx, mut asked) = mpsc::unbounded_channel();
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel::<()>();
    let mut req = fx.request("agent-t", "cancel");
    req.available_tools = None;
    req.handlers.user_input = Some(Arc::new(move |_q: Question| {
        let _ = asked_tx.send(());
        let guard = DropSignal(dropped_tx.clone());
        async move {
            let _guard = guard;
            std::future::pending::<Option<Answer>>().await
        }
    }));
    let mut lease = pool.lease(req).await.expect("lease");
    lease.send(ask(true)).await.expect("send");
    // Pull events until the question reached the handler, then abort.
    loop {
        tokio::select! {
            event = lease.next_event() => { event.expect("turn running").expect("event"); }
            _ = asked.recv() => break,
        }
    }
    lease.abort().await.expect("abort");
    let outcome = lease.wait_idle().await.expect("aborted turn ends");
    assert!(outcome.aborted);
    tokio::time::timeout(Duration::from_secs(5), dropped.recv())
        .await
        .expect("the question was cancelled");
    let next = lease.run("REPLY=after the abort").await.expect("next turn");
    assert_eq!(next.text, "after the abort");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

struct DropSignal(mpsc::UnboundedSender<()>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

struct CountingHooks(
    Mutex<HashMap<&'static str, u32>>,
    tokio::sync::watch::Sender<u32>,
);

impl Default for CountingHooks {
    fn default() -> Self {
        Self(Mutex::default(), tokio::sync::watch::channel(0).0)
    }
}

impl CountingHooks {
    fn hit(&self, name: &'static str) -> HookFuture {
        *self.0.lock().expect("lock").entry(name).or_default() += 1;
        self.1.send_modify(|n| *n += 1);
        Box::pin(async { Ok(None) })
    }
    fn count(&self, name: &str) -> u32 {
        self.0.lock().expect("lock").get(name).copied().unwrap_or(0)
    }
    /// Waits until `name` fired `n` times (hooks fed from events run in tasks).
    async fn wait_for(&self, name: &str, n: u32) {
        let mut rx = self.1.subscribe();
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            rx.wait_for(|_| self.count(name) >= n),
        )
        .await;
    }
}

impl TurnHooks for CountingHooks {
    fn before_prompt_build(&self, _: Value) -> HookFuture {
        self.hit("before_prompt_build")
    }
    fn llm_input(&self, _: Value) -> HookFuture {
        self.hit("llm_input")
    }
    fn llm_output(&self, _: Value) -> HookFuture {
        self.hit("llm_output")
    }
    fn agent_end(&self, _: Value) -> HookFuture {
        self.hit("agent_end")
    }
    fn before_compaction(&self, _: Value) -> HookFuture {
        self.hit("before_compaction")
    }
    fn after_compaction(&self, _: Value) -> HookFuture {
        self.hit("after_compaction")
    }
    fn before_tool_call(&self, _: Value) -> HookFuture {
        self.hit("before_tool_call")
    }
    fn after_tool_call(&self, _: Value) -> HookFuture {
        self.hit("after_tool_call")
    }
}

#[tokio::test]
async fn each_hook_fires_once_per_occasion_and_compaction_reports_what_it_removed() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let hooks = Arc::new(CountingHooks::default());
    let mut req = with_tools(&fx, "hooks", vec![lookup_tool()]);
    req.handlers.hooks = Some(hooks.clone());
    let mut lease = pool.lease(req).await.expect("lease");
    let outcome = lease
        .run(call_tool("lookup_number", json!({"key": "alpha"})))
        .await
        .expect("turn");
    assert_eq!(outcome.hook_failures, 0);
    // Event-fed hooks run in tasks: wait for them, then check nothing fired twice.
    hooks.wait_for("llm_output", outcome.model_calls).await;
    hooks.wait_for("llm_input", outcome.model_calls).await;
    for (hook, n) in [
        ("before_prompt_build", 1),
        ("before_tool_call", 1),
        ("after_tool_call", 1),
        ("agent_end", 1),
        ("llm_input", outcome.model_calls),
        ("llm_output", outcome.model_calls),
    ] {
        assert_eq!(
            hooks.count(hook),
            n,
            "{hook}: {:?}",
            hooks.0.lock().expect("lock")
        );
    }
    for i in 0..3 {
        lease
            .run(format!("REPLY=filler answer {i}"))
            .await
            .expect("turn");
    }
    let compacted = lease
        .compact(Some("keep the numbers".into()))
        .await
        .expect("compact");
    assert!(compacted.success);
    assert!(compacted.messages_removed.unwrap_or(0) > 0, "{compacted:?}");
    assert_eq!(hooks.count("before_compaction"), 1);
    assert_eq!(hooks.count("after_compaction"), 1);
    let after = lease
        .run("REPLY=still here")
        .await
        .expect("turn after compaction");
    assert_eq!(after.text, "still here");
    // The runtime's own events of that compaction, read as the turn started, are the same
    // compaction: its hooks do not fire again.
    assert_eq!(hooks.count("before_compaction"), 1);
    assert_eq!(hooks.count("after_compaction"), 1);
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_compaction_its_caller_stops_waiting_for_still_ends_before_the_conversations_next_turn() {
    use copilot_pool::scripted_model::Reply;
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-t", "compact-cut"))
        .await
        .expect("lease");
    for i in 0..3 {
        lease
            .run(format!("REPLY=filler answer {i}"))
            .await
            .expect("turn");
    }
    let seen = fx.model.requests().len();
    // The summary comes slowly; the caller (a client that hangs up) stops waiting as soon as
    // the model has the compaction's request.
    fx.model.push_reply(Reply::Slow {
        chunks: 8,
        interval: Duration::from_millis(150),
    });
    {
        let compacting = lease.compact(None);
        tokio::select! {
            done = compacting => panic!("the compaction ended first: {done:?}"),
            _ = fx.model.wait_for_requests(seen + 1) => {}
        }
    }
    drop(lease);
    let mut lease = pool
        .lease(fx.request("agent-t", "compact-cut"))
        .await
        .expect("lease again");
    let outcome = lease.run("REPLY=after").await.expect("turn after");
    assert_eq!(outcome.text, "after");
    // The next turn went to the model with the compacted history: the runtime holds a turn
    // sent during a compaction until the compaction ends (so the lease's drop may park the
    // conversation at once, as it does).
    let requests = fx.model.requests();
    let turn = requests
        .last()
        .expect("the turn's request")
        .body
        .to_string();
    assert!(
        turn.contains("slow-chunk 7"),
        "the turn's request carries the summary: {turn}"
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

/// Records the compaction hooks in the order they ran, with their input or output.
/// [`CompactionLog::failing`]: each hook fails once recorded.
struct CompactionLog(
    Mutex<Vec<(&'static str, Value)>>,
    tokio::sync::watch::Sender<usize>,
    bool,
);

impl Default for CompactionLog {
    fn default() -> Self {
        Self(Mutex::default(), tokio::sync::watch::channel(0).0, false)
    }
}

impl CompactionLog {
    fn failing() -> Self {
        Self {
            2: true,
            ..Self::default()
        }
    }
    fn seen(&self) -> Vec<(&'static str, Value)> {
        self.0.lock().expect("lock").clone()
    }
    fn push(&self, name: &'static str, value: Value) -> HookFuture {
        let mut log = self.0.lock().expect("lock");
        log.push((name, value));
        self.1.send_replace(log.len());
        let fail = self.2;
        Box::pin(async move {
            match fail {
                true => Err("the gateway's hook failed".to_owned()),
                false => Ok(None),
            }
        })
    }
    /// Waits until `n` hooks ran (hooks fed from events run in tasks).
    async fn wait_for(&self, n: usize) {
        let mut rx = self.1.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|len| *len >= n)).await;
    }
    /// Waits for the two compaction hooks, and checks the first two fired in order for a
    /// background compaction the runtime started at its threshold, which succeeded. Returns
    /// how many hooks fired (a later compaction may have fired two more).
    async fn assert_a_threshold_compaction_fired(&self) -> usize {
        self.wait_for(2).await;
        let seen = self.seen();
        let names: Vec<_> = seen.iter().take(2).map(|(name, _)| *name).collect();
        assert_eq!(names, ["before_compaction", "after_compaction"], "{seen:?}");
        assert_eq!(seen[0].1["trigger"], "threshold", "{:?}", seen[0].1);
        assert_eq!(seen[1].1["success"], true, "{:?}", seen[1].1);
        seen.len()
    }
}

impl TurnHooks for CompactionLog {
    fn before_compaction(&self, input: Value) -> HookFuture {
        self.push("before_compaction", input)
    }
    fn after_compaction(&self, output: Value) -> HookFuture {
        self.push("after_compaction", output)
    }
}

#[tokio::test]
async fn compaction_hooks_fire_only_around_a_compaction_that_happened() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let hooks = Arc::new(CompactionLog::default());
    let mut req = fx.request("agent-t", "compaction-hooks");
    req.handlers.hooks = Some(hooks.clone());
    let dir = fx.scratch.path().join("transcripts");
    req.handlers.transcript = Some(TranscriptSettings::new(dir.clone(), TranscriptMode::Strict));
    let mut lease = pool.lease(req).await.expect("lease");
    let transcript = dir.join(format!("copilot-{}.jsonl", lease.cli_session_id()));
    // A new conversation has nothing to compact: the runtime refuses, which is no failure
    // (nothing removed, `success: false`), and no hook fires.
    let nothing = lease
        .compact(None)
        .await
        .expect("nothing to compact is no error");
    assert!(!nothing.success, "{nothing:?}");
    assert_eq!(
        (nothing.tokens_removed, nothing.messages_removed),
        (Some(0), Some(0))
    );
    assert_eq!(hooks.seen(), vec![]);
    // One short turn: its summary is longer than what it replaces (tokensRemoved < 0), and
    // the compaction still happened.
    lease.run("REPLY=short").await.expect("turn");
    let compacted = lease
        .compact(Some("keep the numbers".into()))
        .await
        .expect("compact");
    assert!(compacted.success, "{compacted:?}");
    let seen = hooks.seen();
    let names: Vec<_> = seen.iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["before_compaction", "after_compaction"]);
    assert_eq!(seen[0].1["customInstructions"], "keep the numbers");
    assert_eq!(seen[1].1["success"], true);
    assert_eq!(seen[1].1["tokensRemoved"], json!(compacted.tokens_removed));
    // The summary is mirrored (role `summary`), where a fallback's prelude starts.
    let tail = copilot_pool::fallback::read_transcript_tail(&transcript, 10_000).expect("read");
    let summary = compacted.summary_content.clone().unwrap_or_default();
    assert!(!summary.is_empty(), "{compacted:?}");
    assert_eq!(tail.summary.as_deref(), Some(summary.as_str()));
    // Once: the runtime's events of the compaction, read again as the next turn starts,
    // neither fire the hooks again nor add the summary again.
    lease
        .run("REPLY=after")
        .await
        .expect("turn after compaction");
    assert_eq!(hooks.seen().len(), 2, "{:?}", hooks.seen());
    let summaries = std::fs::read_to_string(&transcript)
        .expect("transcript")
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|entry| entry["role"] == "summary")
        .count();
    assert_eq!(summaries, 1);
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_compaction_the_runtime_finishes_between_turns_fires_its_hooks_as_the_next_turn_starts() {
    let fx = Fixture::new().await;
    // The fake runtime starts a compaction in each turn and ends it after the turn's
    // `session.idle`, where no caller reads (the real one does so on its own clock).
    let pool = Pool::start(fx.fake_runtime_config("compaction-between-turns").await)
        .await
        .expect("pool");
    // Hooks that fail: their failures count in the turn that fired them.
    let hooks = Arc::new(CompactionLog::failing());
    let request = || {
        let mut req = fx.request("agent-t", "between");
        req.handlers.hooks = Some(hooks.clone());
        req
    };
    let mut lease = pool.lease(request()).await.expect("lease");
    lease.run("first").await.expect("first turn");
    assert_eq!(hooks.seen(), vec![], "started, not known to have happened");
    let pid = lease.worker_pid();
    // The conversation goes back, its end unread: the next lease (the HTTP API takes one
    // per turn) reads it, with the start the first lease saw.
    drop(lease);
    // Another conversation opened on the same process: its open waits until what the
    // runtime sent before (the first turn's late `session.compaction_complete`) is routed,
    // so the end waits, unread, as the second turn starts.
    let other = pool
        .lease(fx.request("agent-t", "other"))
        .await
        .expect("other lease");
    assert_eq!(other.worker_pid(), pid, "one process");
    drop(other);
    let mut lease = pool.lease(request()).await.expect("lease again");
    assert_eq!(lease.worker_pid(), pid, "parked, not moved");
    let second = lease.run("second").await.expect("second turn");
    assert_eq!(hooks.assert_a_threshold_compaction_fired().await, 2);
    assert_eq!(second.hook_failures, 2, "{second:?}");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_background_compactions_hooks_fire_in_order_once_it_completed() {
    let fx = Fixture::new().await;
    let mut config = fx.config().await;
    // A threshold every conversation crosses at once: the runtime compacts in the
    // background, starting in one turn and completing in a later one.
    config.infinite_sessions = Some(copilot_pool::pool::InfiniteSessions {
        enabled: true,
        background_compaction_threshold: Some(0.001),
        buffer_exhaustion_threshold: Some(0.9),
    });
    let pool = Pool::start(config).await.expect("pool");
    let hooks = Arc::new(CompactionLog::default());
    let mut req = fx.request("agent-t", "background");
    req.handlers.hooks = Some(hooks.clone());
    let dir = fx.scratch.path().join("transcripts");
    req.handlers.transcript = Some(TranscriptSettings::new(dir.clone(), TranscriptMode::Strict));
    let mut lease = pool.lease(req).await.expect("lease");
    let transcript = dir.join(format!("copilot-{}.jsonl", lease.cli_session_id()));
    let (mut started, mut completed) = (false, false);
    // The runtime compacts in the background, on its own clock: a bound on the turns it may
    // take (one CI run under load saw none complete within six), not a count it must take.
    // It may finish between two turns, where no caller reads it: its hooks fire as the next
    // turn starts.
    const TURNS: usize = 12;
    for i in 0..TURNS {
        lease.send(format!("REPLY=turn {i}")).await.expect("send");
        let started_before = started;
        while let Some(event) = lease.next_event().await {
            match event.expect("event").event_type() {
                "session.compaction_start" => started = true,
                "session.compaction_complete" => completed = true,
                _ => {}
            }
        }
        if started && !started_before && !completed {
            // Started in this turn, not complete in it: nothing may have fired.
            assert_eq!(hooks.seen(), vec![], "turn {i}");
        }
        if completed || hooks.seen().len() >= 2 {
            break;
        }
    }
    hooks.wait_for(2).await;
    assert!(
        hooks.seen().len() >= 2,
        "no background compaction in {TURNS} turns (started: {started}, completed: {completed})"
    );
    // A second compaction may have ended in the turn after the first's end.
    hooks.assert_a_threshold_compaction_fired().await;
    // The summary of `session.compaction_complete` is mirrored (role `summary`).
    let tail = copilot_pool::fallback::read_transcript_tail(&transcript, 10_000).expect("read");
    assert!(
        tail.summary.as_deref().is_some_and(|s| !s.is_empty()),
        "{tail:?}"
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_stuck_tool_call_ends_in_turn_timeout_and_the_next_turn_works() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let stuck = GatewayTool::new(
        "stuck",
        "never returns",
        json!({"type": "object"}),
        |_c: ToolCall| std::future::pending::<Result<String, String>>(),
    )
    .with_timeout(Duration::from_millis(500));
    let mut lease = pool
        .lease(with_tools(&fx, "stuck", vec![stuck]))
        .await
        .expect("lease");
    let err = lease
        .run(call_tool("stuck", json!({})))
        .await
        .expect_err("timeout");
    let PoolError::Turn(TurnError::Timeout { kind, detail, .. }) = &err else {
        panic!("{err}")
    };
    assert_eq!(*kind, TimeoutKind::Tool);
    assert!(detail.contains("stuck"), "{detail}");
    let next = lease
        .run("REPLY=recovered")
        .await
        .expect("the next turn works");
    assert_eq!(next.text, "recovered");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_caller_reading_a_turns_events_too_slowly_has_the_turn_aborted_and_the_conversation_goes_on()
 {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut req = fx.request("agent-b", "backlog");
    // Under each of the turn's two large events (20 KiB), so that one of them waits behind
    // each of the first two events read; the runtime's own `model.*` events (the whole
    // conversation each) and its system message left out.
    req.handlers.max_unread_event_bytes = 12 * 1024;
    req.handlers.unread_events = Some(Arc::new(|t: &str| {
        t.starts_with("model.") || t == "system.message"
    }));
    let mut lease = pool.lease(req).await.expect("lease");
    // The prompt and the answer, 20 KiB each, come back in the turn's events.
    let long = "x".repeat(20 * 1024);
    lease.send(format!("REPLY={long}")).await.expect("sent");
    // The runtime writes them while nothing reads them. No event says "written" (the only
    // one is the turn's events themselves, unread here): the count is watched.
    tokio::time::timeout(Duration::from_secs(60), async {
        while lease.unread_event_bytes() <= 40 * 1024 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the runtime wrote the turn's events");
    // Two events come (what waited behind each is past the limit), then the turn is aborted.
    for _ in 0..2 {
        lease
            .next_event()
            .await
            .expect("an item")
            .expect("an event");
    }
    let err = lease
        .next_event()
        .await
        .expect("an item")
        .expect_err("the turn is aborted");
    assert!(
        matches!(
            err,
            PoolError::Turn(TurnError::Backlog { limit: 12288, .. })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("read too slowly"), "{err}");
    assert!(lease.next_event().await.is_none(), "the turn ended");
    assert!(
        lease.unread_event_bytes() < 12 * 1024,
        "what waited was drained: {}",
        lease.unread_event_bytes()
    );
    let next = lease
        .run("REPLY=recovered")
        .await
        .expect("the next turn works");
    assert_eq!(next.text, "recovered");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn an_inactive_turn_times_out_with_a_typed_error() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut req = fx.request("agent-t", "inactive");
    req.handlers.timeouts.inactivity = Duration::from_millis(400);
    let mut lease = pool.lease(req).await.expect("lease");
    // One chunk, then silence for far longer than the inactivity timeout.
    let err = lease
        .run("SCENARIO:slow SLOW=2x5000")
        .await
        .expect_err("inactivity");
    assert!(
        matches!(
            err,
            PoolError::Turn(TurnError::Timeout {
                kind: TimeoutKind::Inactivity,
                ..
            })
        ),
        "{err}"
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn a_provider_500_is_a_typed_error_with_its_status() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut lease = pool
        .lease(fx.request("agent-t", "err"))
        .await
        .expect("lease");
    // The runtime retries a 500 five times with back-off (~15 s) before it gives up.
    let err = lease
        .run("SCENARIO:error STATUS=500")
        .await
        .expect_err("500");
    let PoolError::Turn(TurnError::Failed {
        status_code,
        message,
        ..
    }) = &err
    else {
        panic!("{err}")
    };
    assert_eq!(*status_code, Some(500), "{message}");
    let next = lease.run("REPLY=fine again").await.expect("next turn");
    assert_eq!(next.text, "fine again");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transcript_has_no_duplicate_after_resume_and_restart() {
    let fx = Fixture::new().await;
    let dir = fx.scratch.path().join("transcripts");
    let settings = TranscriptSettings::new(dir.clone(), TranscriptMode::Strict);
    let request = || {
        let mut req = fx.request("agent-t", "mirrored");
        req.handlers.transcript = Some(settings.clone());
        req
    };
    // The lease after the crash resumes the conversation itself (a warm spare, the default,
    // could resume it ahead and the lease would find it attached).
    let mut config = fx.config().await;
    config.warm_spares = 0;
    let pool = Pool::start(config).await.expect("pool");
    let mut lease = pool.lease(request()).await.expect("lease");
    let id = lease.cli_session_id().to_owned();
    lease.run("REPLY=one").await.expect("turn");
    let pid = lease.worker_pid();
    drop(lease);
    // Subscribed before the kill: the crash's event may come before the next line runs.
    let mut events = pool.subscribe();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    support::pool_fixture::wait_event(
        &mut events,
        |e| matches!(e, copilot_pool::pool::PoolEvent::WorkerCrashed { pid: p, .. } if *p == pid),
    )
    .await;
    let mut lease = pool.lease(request()).await.expect("lease after crash");
    assert_eq!(lease.reason(), OpenReason::Resumed);
    lease.run("REPLY=two").await.expect("turn");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;

    let pool = Pool::start(fx.config().await).await.expect("pool again");
    let mut lease = pool.lease(request()).await.expect("lease after restart");
    assert_eq!(lease.cli_session_id(), &id);
    lease.run("REPLY=three").await.expect("turn");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;

    // The leases went through the settings' cache (each reads only what is new since the last).
    assert_eq!(settings.cache().len(), 1);
    let file = dir.join(format!("copilot-{id}.jsonl"));
    assert_eq!(count_duplicates(&file).expect("read"), 0);
    let lines: Vec<Value> = std::fs::read_to_string(&file)
        .expect("transcript")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    let roles: Vec<&str> = lines.iter().filter_map(|l| l["role"].as_str()).collect();
    assert_eq!(
        roles,
        [
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant"
        ],
        "{lines:?}"
    );
    assert!(lines.iter().all(|l| l["scope"] == format!("copilot:{id}")));
}

/// The roles and contents of a transcript mirror's lines.
fn mirrored_rows(file: &std::path::Path) -> Vec<(String, String)> {
    std::fs::read_to_string(file)
        .expect("transcript")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json line"))
        .map(|l| {
            let role = l["role"].as_str().unwrap_or_default().to_owned();
            let content = l["content"].as_str().unwrap_or_default().to_owned();
            (role, content)
        })
        .collect()
}

/// Waits until the runtime's own event log of a session holds `text` (the runtime wrote the
/// event that carries it). The log is the only witness of what the runtime produced while
/// the lease reads nothing; read every 20 ms, for at most 30 s.
async fn runtime_logged(copilot_home: &std::path::Path, session_id: &str, text: &str) {
    let log = copilot_pool::fallback::copilot_events_path(copilot_home, session_id)
        .expect("a valid session id");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if std::fs::read_to_string(&log).is_ok_and(|l| l.contains(text)) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the runtime did not log {text:?} in {} within 30 s",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_dropped_mid_way_still_mirrors_what_the_runtime_produced_before_the_conversation_goes_back()
 {
    let fx = Fixture::new().await;
    let dir = fx.scratch.path().join("transcripts");
    let settings = TranscriptSettings::new(dir.clone(), TranscriptMode::Strict);
    let (called_tx, mut called) = mpsc::unbounded_channel::<()>();
    let request = || {
        let called_tx = called_tx.clone();
        let answering = GatewayTool::new(
            "lookup_number",
            "Looks up the number for a key",
            json!({"type": "object"}),
            move |_c: ToolCall| {
                let _ = called_tx.send(());
                async { Ok::<_, String>("the number is 42".to_owned()) }
            },
        );
        let mut req = with_tools(&fx, "dropped-mirror", vec![answering]);
        req.handlers.transcript = Some(settings.clone());
        req
    };
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut lease = pool.lease(request()).await.expect("lease");
    let id = lease.cli_session_id().to_owned();
    let file = dir.join(format!("copilot-{id}.jsonl"));
    // The caller reads the turn until its tool is called, then reads nothing more: the
    // tool's result and the model's answer stay undelivered in the lease.
    lease
        .send(call_tool("lookup_number", json!({})))
        .await
        .expect("send");
    let pull = async {
        while let Some(event) = lease.next_event().await {
            event.expect("event");
        }
    };
    tokio::select! {
        _ = pull => panic!("the turn ended before its tool was called"),
        called = called.recv() => called.expect("the tool was called"),
    }
    runtime_logged(
        lease.copilot_home(),
        id.as_str(),
        "tool said: the number is 42",
    )
    .await;
    // The caller goes: the pool aborts the turn and drains it in a task of its own, and the
    // next lease of the conversation waits until that drain gave it back.
    drop(lease);
    let mut lease = pool.lease(request()).await.expect("lease again");
    assert_eq!(lease.cli_session_id(), &id);
    let rows = mirrored_rows(&file);
    let roles: Vec<&str> = rows.iter().map(|(role, _)| role.as_str()).collect();
    assert_eq!(roles, ["user", "tool", "assistant"], "{rows:?}");
    assert_eq!(rows[1].1, "the number is 42", "{rows:?}");
    assert_eq!(rows[2].1, "tool said: the number is 42", "{rows:?}");

    let next = lease.run("REPLY=after").await.expect("the next turn works");
    assert_eq!(next.text, "after");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
    assert_eq!(count_duplicates(&file).expect("read"), 0);
}

#[tokio::test]
async fn strict_transcript_mode_aborts_the_turn_on_a_failing_write() {
    let fx = Fixture::new().await;
    let dir = fx.scratch.path().join("transcripts");
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut req = fx.request("agent-t", "strict");
    req.handlers.transcript = Some(TranscriptSettings::new(dir.clone(), TranscriptMode::Strict));
    let mut lease = pool.lease(req).await.expect("lease");
    lease.run("REPLY=written").await.expect("turn");
    let file = dir.join(format!("copilot-{}.jsonl", lease.cli_session_id()));
    // Make further writes fail (immutable file: even root's open handle gets EPERM).
    let status = std::process::Command::new("chattr")
        .arg("+i")
        .arg(&file)
        .status()
        .expect("chattr");
    assert!(status.success(), "chattr +i is needed for this test");
    let err = lease
        .run("REPLY=not written")
        .await
        .expect_err("strict write failure");
    let _ = std::process::Command::new("chattr")
        .arg("-i")
        .arg(&file)
        .status();
    assert!(
        matches!(err, PoolError::Turn(TurnError::TranscriptPersistence(_))),
        "{err}"
    );
    // The conversation goes on once the mirror is writable again.
    let next = lease.run("REPLY=written again").await.expect("turn");
    assert_eq!(next.text, "written again");
    drop(lease);

    // Best effort keeps going through a failing mirror.
    let mut req = fx.request("agent-t", "best-effort");
    req.handlers.transcript = Some(TranscriptSettings::new(
        fx.scratch.path().join("not-a-dir"),
        TranscriptMode::BestEffort,
    ));
    std::fs::write(fx.scratch.path().join("not-a-dir"), b"a file in the way").expect("file");
    let mut lease = pool.lease(req).await.expect("best-effort lease");
    lease.run("REPLY=fine").await.expect("turn");
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}

#[tokio::test]
async fn reasoning_effort_is_validated_and_an_approve_all_policy_runs_bash() {
    let fx = Fixture::new().await;
    let pool = Pool::start(fx.config().await).await.expect("pool");
    let mut req = fx.request("agent-t", "effort");
    // An unknown effort cannot reach the pool: reading it fails, naming the allowed values.
    let err = "extreme"
        .parse::<copilot_pool::ReasoningEffort>()
        .expect_err("bad effort");
    assert!(
        err.to_string().contains("low, medium, high, xhigh"),
        "{err}"
    );
    req.reasoning_effort = Some(copilot_pool::ReasoningEffort::High);
    req.available_tools = None;
    req.handlers.permission_policy = Arc::new(ApproveAll);
    let mut lease = pool.lease(req).await.expect("lease");
    let outcome = lease
        .run(bash("echo approved-by-policy"))
        .await
        .expect("turn");
    assert!(
        outcome.text.contains("approved-by-policy"),
        "{}",
        outcome.text
    );
    drop(lease);
    shutdown_leaves_nothing(&pool).await;
}
