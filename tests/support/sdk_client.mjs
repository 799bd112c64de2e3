// The official Node SDK (@github/copilot-sdk, installed by tests/support/node_sdk.rs) attached
// to copilot-pool's SDK endpoint by URL, as a gateway would: one scenario per run, chosen by
// SCENARIO. Each step prints one JSON line on stdout; the Rust test reads them and checks
// them (and, for `crash`, kills the process of the session when told `streaming`).
//
// Environment: SDK_DIR (the package directory), SDK_URL ("127.0.0.1:PORT"), SDK_TOKEN,
// SDK_TOKEN_B (second agent, `isolation`), MODEL_URL (the scripted model's base URL),
// MODEL_ID, SCENARIO (`turns`, `crash`, `isolation`, `requests`, `moved`, `resume`).

import { pathToFileURL } from "node:url";
import { join } from "node:path";

const env = (name) => {
  const value = process.env[name];
  if (value === undefined || value === "") throw new Error(`${name} is not set`);
  return value;
};

const sdk = await import(pathToFileURL(join(env("SDK_DIR"), "dist", "index.js")).href);
const { CopilotClient, RuntimeConnection, defineTool, approveAll } = sdk;

const say = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

// Every wait is bounded: a scenario that hangs fails instead.
const within = (ms, promise, what) =>
  Promise.race([
    promise,
    new Promise((_, reject) => setTimeout(() => reject(new Error(`${what}: no answer within ${ms} ms`)), ms).unref()),
  ]);

const client = (token) =>
  new CopilotClient({ connection: RuntimeConnection.forUri(env("SDK_URL"), { connectionToken: token }) });

const sessionConfig = (extra = {}) => ({
  model: env("MODEL_ID"),
  provider: { type: "openai", baseUrl: env("MODEL_URL"), apiKey: "scripted-key" },
  availableTools: ["custom:*"],
  onPermissionRequest: approveAll,
  ...extra,
});

const secretTool = defineTool("get_secret_number", {
  description: "Returns the secret number for a key",
  parameters: { type: "object", properties: { key: { type: "string" } }, required: ["key"] },
  skipPermission: true,
  handler: async ({ key }) => `secret number for ${key} is 42`,
});

async function turns() {
  const c = client(env("SDK_TOKEN"));
  const status = await within(10000, (async () => { await c.start(); return c.getStatus(); })(), "start");
  const ping = await c.ping("hello");
  say({ step: "status", version: status.version, protocolVersion: status.protocolVersion, ping });

  // A tool turn: the model calls the SDK's tool, the SDK answers, the model reads the answer.
  const session = await c.createSession(sessionConfig({ tools: [secretTool], streaming: true }));
  const seen = [];
  session.on((event) => seen.push(event.type));
  const tool = await session.sendAndWait({ prompt: "SCENARIO:tool" }, 30000);
  say({
    step: "tool",
    sessionId: session.sessionId,
    content: tool?.data?.content,
    toolRequested: seen.includes("external_tool.requested"),
    toolCompleted: seen.includes("tool.execution_complete"),
  });

  // Streaming: deltas arrive before the final message.
  let deltas = "";
  const off = session.on("assistant.message_delta", (e) => { deltas += e.data.deltaContent; });
  const streamed = await session.sendAndWait({ prompt: "SCENARIO:slow SLOW=5x20" }, 30000);
  off();
  say({ step: "streaming", deltas, content: streamed?.data?.content });

  // Abort: a slow turn is aborted at its first delta and ends idle with aborted set.
  const aborted = new Promise((resolve) => {
    const stop = session.on("session.idle", (e) => { stop(); resolve(e.data); });
  });
  const first = new Promise((resolve) => {
    const stop = session.on("assistant.message_delta", () => { stop(); resolve(); });
  });
  await session.send({ prompt: "SCENARIO:slow SLOW=200x100" });
  await within(30000, first, "first delta");
  await session.abort();
  const idle = await within(15000, aborted, "idle after abort");
  say({ step: "abort", idle });

  // The session goes on after the abort.
  const after = await session.sendAndWait({ prompt: "REPLY=still here" }, 30000);
  say({ step: "after-abort", content: after?.data?.content });

  const messages = await session.getEvents();
  say({ step: "messages", count: messages.length, types: [...new Set(messages.map((m) => m.type))] });
  await session.disconnect();
  const errors = await c.stop();
  say({ step: "stopped", errors: errors.map(String) });
}

async function crash() {
  const c = client(env("SDK_TOKEN"));
  const session = await c.createSession(sessionConfig({ streaming: true }));
  const first = await session.sendAndWait({ prompt: "REPLY=first answer" }, 30000);
  say({ step: "first", sessionId: session.sessionId, content: first?.data?.content });

  const streaming = new Promise((resolve) => {
    const stop = session.on("assistant.message_delta", () => { stop(); resolve(); });
  });
  const errors = [];
  const order = [];
  session.on("session.error", (e) => { errors.push(e.data); order.push(e.type); });
  // The idle that follows the error (the SDK's sendAndWait rejects on the error alone, and
  // an idle still on its way would end the next sendAndWait at once: wait for it first).
  const idleAfterError = new Promise((resolve) => {
    const stop = session.on("session.idle", (e) => {
      if (errors.length > 0) { stop(); order.push(e.type); resolve(e.data); }
    });
  });
  const turn = session.sendAndWait({ prompt: "SCENARIO:slow SLOW=300x100" }, 60000).then(
    (m) => ({ ok: true, content: m?.data?.content }),
    (e) => ({ ok: false, message: String(e.message ?? e) }),
  );
  await within(30000, streaming, "first delta");
  // The test kills the session's process now and times the rejection from the kill.
  say({ step: "streaming" });
  const outcome = await within(30000, turn, "the interrupted turn");
  say({ step: "rejected", outcome, errors });
  const idle = await within(1000, idleAfterError, "the idle after the error");
  say({ step: "idle", idle, order });

  // The same session object goes on, on a fresh process, with its history.
  const types = [];
  session.on((e) => types.push(e.type));
  const next = await session.sendAndWait({ prompt: "REPLY=after the crash" }, 30000);
  say({ step: "after", content: next?.data?.content, types });
  await c.stop();
}

async function isolation() {
  const a = client(env("SDK_TOKEN"));
  const b = client(env("SDK_TOKEN_B"));
  // Every session event that reaches B's connection, whoever it names.
  const seenByB = new Set();
  await within(10000, b.start(), "start b");
  const original = b.handleSessionEventNotification.bind(b);
  b.handleSessionEventNotification = (n) => { if (n?.sessionId) seenByB.add(n.sessionId); original(n); };

  const sa = await a.createSession(sessionConfig());
  await sa.sendAndWait({ prompt: "REPLY=agent a speaking" }, 30000);
  const sb = await b.createSession(sessionConfig());
  await sb.sendAndWait({ prompt: "REPLY=agent b speaking" }, 30000);

  const listedByA = (await a.listSessions()).map((s) => s.sessionId);
  const listedByB = (await b.listSessions()).map((s) => s.sessionId);
  const attempt = async (f) => { try { await f(); return "ok"; } catch (e) { return String(e.message ?? e); } };
  const resumeByB = await attempt(() => b.resumeSession(sa.sessionId, sessionConfig()));
  const sendByB = await attempt(() =>
    b.connection.sendRequest("session.send", { sessionId: sa.sessionId, prompt: "REPLY=intruder" }));
  const messagesByB = await attempt(() =>
    b.connection.sendRequest("session.getMessages", { sessionId: sa.sessionId }));
  const wrongToken = await attempt(async () => {
    const w = client("not-a-token");
    try { await within(10000, w.start(), "start wrong"); } finally { await w.forceStop(); }
  });
  // A's session is still A's: another turn works.
  const again = await sa.sendAndWait({ prompt: "REPLY=agent a again" }, 30000);
  say({
    step: "isolation",
    a: sa.sessionId,
    b: sb.sessionId,
    listedByA,
    listedByB,
    resumeByB,
    sendByB,
    messagesByB,
    wrongToken,
    seenByB: [...seenByB],
    again: again?.data?.content,
  });
  await a.stop();
  await b.stop();
}

// The runtime's requests answered by the SDK's own handlers, through the pool: a permission
// prompt, ask_user, a hook, exit-plan-mode and a system message section transform.
async function requests() {
  const c = client(env("SDK_TOKEN"));
  const permissions = [];
  const questions = [];
  const prompts = [];
  const plans = [];
  let transforms = 0;
  const colourTool = defineTool("lookup_colour", {
    description: "Returns the colour of the day",
    parameters: { type: "object", properties: {} },
    handler: async () => "colour of the day is teal",
  });
  const session = await c.createSession(sessionConfig({
    availableTools: undefined,
    tools: [colourTool],
    onPermissionRequest: async (request) => {
      permissions.push(request.kind);
      return { kind: "approve-once" };
    },
    onUserInputRequest: async (request) => {
      questions.push({ question: request.question, choices: request.choices });
      return { answer: "blue", wasFreeform: false };
    },
    hooks: {
      onUserPromptSubmitted: async (input) => {
        prompts.push(input.prompt);
        return input.prompt.includes("HOOK-ME") ? { modifiedPrompt: "REPLY=rewritten by the hook" } : undefined;
      },
    },
    onExitPlanModeRequest: async (request) => {
      plans.push(request.summary);
      // Declined (approving switches to autopilot, which goes on by itself).
      return { approved: false, feedback: "keep planning, said the SDK" };
    },
    systemMessage: {
      mode: "customize",
      sections: { identity: { action: (content) => { transforms += 1; return `${content}\nTRANSFORMED-BY-THE-SDK`; } } },
    },
  }));
  const perm = await session.sendAndWait({ prompt: "SCENARIO:tool NAME=lookup_colour ARGS={}" }, 30000);
  say({ step: "permission", permissions, content: perm?.data?.content, transforms });
  const ask = await session.sendAndWait(
    { prompt: 'SCENARIO:tool NAME=ask_user ARGS={"question":"Pick a colour","choices":["red","blue"],"allow_freeform":false}' },
    30000,
  );
  say({ step: "ask_user", questions, content: ask?.data?.content });
  const hooked = await session.sendAndWait({ prompt: "HOOK-ME please" }, 30000);
  say({ step: "hook", prompts, content: hooked?.data?.content });
  const plan = await session.sendAndWait(
    { prompt: 'SCENARIO:tool NAME=exit_plan_mode ARGS={"summary":"the plan is ready"}', agentMode: "plan" },
    30000,
  );
  say({ step: "plan", plans, content: plan?.data?.content });
  await session.disconnect();
  await c.stop();
}

// One session whose process is recycled after every turn (the test's pool): each turn runs on
// a fresh process and the model still sees the earlier turns.
async function moved() {
  const c = client(env("SDK_TOKEN"));
  const session = await c.createSession(sessionConfig());
  const first = await session.sendAndWait({ prompt: "REPLY=first of three" }, 30000);
  say({ step: "first", content: first?.data?.content });
  const second = await session.sendAndWait({ prompt: "REPLY=second of three" }, 30000);
  say({ step: "second", content: second?.data?.content });
  const third = await session.sendAndWait({ prompt: "REPLY=third of three" }, 30000);
  say({ step: "third", content: third?.data?.content });
  await c.stop();
}

// A session taken up again by a new client of the same agent after the first one stopped.
async function resume() {
  const first = client(env("SDK_TOKEN"));
  const session = await first.createSession(sessionConfig());
  // The runtime answers an open before it emits the open's event: a handler registered when
  // the call returns sees it (`session.start`, `session.resume`), as with the runtime itself.
  const created = await firstEventOf(session);
  await session.sendAndWait({ prompt: "REPLY=remember the word kumquat" }, 30000);
  const id = session.sessionId;
  await first.stop();
  const second = client(env("SDK_TOKEN"));
  // Another session takes the process's one place (the test's pool config), so the first
  // one is detached there and resumed for real, not found still attached.
  await second.createSession(sessionConfig());
  const resumed = await second.resumeSession(id, sessionConfig());
  const reopened = await firstEventOf(resumed);
  const next = await resumed.sendAndWait({ prompt: "REPLY=resumed fine" }, 30000);
  const events = await resumed.getEvents();
  say({
    step: "resumed",
    sessionId: id,
    content: next?.data?.content,
    earlier: events.some((e) => e.type === "user.message" && String(e.data?.content).includes("kumquat")),
    firstAfterCreate: created,
    firstAfterResume: reopened,
  });
  await second.stop();
}

// The type of the first event a session's handler sees without a send (null after 5 s).
function firstEventOf(session) {
  return new Promise((resolve) => {
    const timer = setTimeout(() => { off(); resolve(null); }, 5000);
    const off = session.on((event) => { clearTimeout(timer); off(); resolve(event.type); });
  });
}

const scenarios = { turns, crash, isolation, requests, moved, resume };
try {
  const run = scenarios[env("SCENARIO")];
  if (!run) throw new Error(`unknown SCENARIO ${process.env.SCENARIO}`);
  await run();
  say({ done: true });
  process.exit(0);
} catch (error) {
  say({ error: String(error?.stack ?? error) });
  process.exit(1);
}
