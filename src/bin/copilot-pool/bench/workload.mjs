// The workload of `copilot-pool bench` (src/bin/copilot-pool/bench/): AGENTS x CONVERSATIONS
// conversations at once, TURNS turns each one after another, driven one of four ways (MODE):
//   http      POST /v1/turns to `copilot-pool serve` (HTTP_URL), SSE back, gateway tools
//             answered on /v1/requests/{id};
//   endpoint  the official Node SDK attached by URL to serve's SDK endpoint (SDK_URL, agent
//             i's token TOKEN_PREFIX + i), one client per agent, sessions kept attached;
//   resume    the official Node SDK as its product pages show it: one client and runtime per
//             agent (RUNTIME, COPILOT_HOME under HOMES), the session resumed before every turn;
//   attached  the same SDK and runtime per agent, sessions kept attached.
// Then every agent goes away until its runtime is gone and returns with one turn on its first
// conversation (the returning agent's cold first event). Then the harness SIGKILLs agent 0's runtime and this times the next turn of agent 0's first
// conversation from the kill to its first event (a failed attempt, ATTEMPT_MS at most, is
// followed by the mode's recovery: the pool resumes by itself; the SDK alone needs a new
// client, a new runtime and resumeSession).
//
// Every step prints one JSON line on stdout; the harness answers `back` and `killed` on stdin.
// Environment: MODE, SDK_DIR (SDK modes), AGENTS, CONVERSATIONS, TURNS, TOOL (1|0),
// STREAMING (1|0), MODEL_URL, MODEL_ID, ATTEMPT_MS; HTTP_URL, and HTTP_SOCKET and API_TOKEN
// when the daemon's API is on a Unix socket (mode http); TRACE, a file each turn's timeline
// is appended to (`bench --trace`), and RUN, the run's number there.

import { pathToFileURL } from "node:url";
import { join } from "node:path";
import { appendFileSync, mkdirSync } from "node:fs";
import { createInterface } from "node:readline";
import http from "node:http";

const env = (name) => {
  const value = process.env[name];
  if (value === undefined || value === "") throw new Error(`${name} is not set`);
  return value;
};
const say = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
// After the kill, the SDK's writes to its dead runtime fail on their own (EPIPE) outside any
// call this script made: expected then, and reported on stderr; before it, a failure.
let killed = false;
const fail = (error) => {
  if (killed) {
    process.stderr.write(`bench workload (${MODE}): after the kill: ${error?.message ?? error}\n`);
    return;
  }
  say({ error: String(error?.stack ?? error) });
  process.exit(1);
};
process.on("uncaughtException", fail);
process.on("unhandledRejection", fail);
const now = () => performance.now();
// A turn's first event is the first its prompt caused. The session's own lifecycle events
// (`session.*`) are left out in every mode: the SDK hands a new or resumed session its
// `session.start` / `session.resume` as it opens, before the prompt is even sent, and timing
// that would time the opening, not the turn (the HTTP stream starts at the prompt).
const isTurnEvent = (type) => typeof type !== "string" || !type.startsWith("session.");
// What one turn's clock read: `ready` when its session was there to send to (HTTP: the
// answer's head, after the pool's lease; the SDK: the session created, resumed or kept),
// `first` at its first event (of type `firstType`).
const newMarks = () => ({ ready: null, first: null, firstType: null });
const firstEvent = (marks, type) => {
  if (marks.first === null && isTurnEvent(type)) {
    marks.first = now();
    marks.firstType = type;
  }
};
// One JSON line per turn in TRACE, its times in ms from `origin` (the load's start, the
// agents' return, the kill).
const TRACE = process.env.TRACE;
const trace = (phase, origin, agent, conversation, turn, sent, marks, idle) => {
  if (!TRACE) return;
  const at = (t) => (t === null ? null : Math.round((t - origin) * 10) / 10);
  appendFileSync(TRACE, JSON.stringify({
    run: Number(process.env.RUN ?? 0), mode: MODE, phase, agent, conversation, turn, sent: at(sent), ready: at(marks.ready),
    first: at(marks.first), first_type: marks.firstType, end: at(idle),
  }) + "\n");
};
const within = (ms, promise, what) => {
  let timer;
  return Promise.race([
    promise,
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what}: no answer within ${ms} ms`)), ms);
      timer.unref();
    }),
  ]).finally(() => clearTimeout(timer));
};
const stdin = createInterface({ input: process.stdin });
const lines = stdin[Symbol.asyncIterator]();
const waitFor = async (expected) => {
  const { value } = await lines.next();
  if (value !== expected) throw new Error(`expected ${expected} on stdin, got ${value}`);
};

const MODE = env("MODE");
const AGENTS = Number(env("AGENTS"));
const CONVERSATIONS = Number(env("CONVERSATIONS"));
const TURNS = Number(env("TURNS"));
const TOOL = env("TOOL") === "1";
const STREAMING = env("STREAMING") === "1";
const ATTEMPT_MS = Number(env("ATTEMPT_MS"));
const TOOL_NAME = "get_secret_number";
const prompt = (text) => (TOOL ? "SCENARIO:tool" : `REPLY=${text}`);
const toolAnswer = (args) => `secret number for ${args?.key ?? "the key"} is 42`;

// ---- HTTP/SSE to serve ----------------------------------------------------------------------

// The gateway's HTTP client: Node's `http` with one keep-alive agent, as a gateway that cares
// about its own CPU runs it. (Node's `fetch`, undici, cost this gateway 4.6-5.2 ms of CPU per
// warm tool turn against 2.2-2.3 ms with `http`, on two cores a share of every mode's
// throughput that is the client's, not the pool's: BENCHMARKS.md, eighth session.)
// An idle socket is let go after 5 s, before `serve` closes it (10 s idle timeout): a request
// never lands on a connection the daemon is closing.
// With HTTP_SOCKET set, every request goes to the daemon's Unix socket (HTTP_URL then only
// names the paths), with API_TOKEN as its bearer token when set.
const keepAlive = new http.Agent({ keepAlive: true, timeout: 5000 });
const SOCKET = process.env.HTTP_SOCKET || undefined;
const AUTH = process.env.API_TOKEN ? { authorization: `Bearer ${process.env.API_TOKEN}` } : {};
const post = (url, body) => new Promise((resolve, reject) => {
  const payload = Buffer.from(JSON.stringify(body));
  const request = http.request(url, {
    method: "POST",
    agent: keepAlive,
    socketPath: SOCKET,
    headers: { "content-type": "application/json", "content-length": payload.length, ...AUTH },
  }, resolve);
  request.on("error", reject);
  request.end(payload);
});
const readAll = async (response) => {
  let text = "";
  response.setEncoding("utf8");
  for await (const chunk of response) text += chunk;
  return text;
};

async function httpTurn(agent, conversation, text, marks) {
  const base = env("HTTP_URL");
  const body = {
    agent_id: `agent-${agent}`,
    session_key: `conversation-${conversation}`,
    prompt: prompt(text),
    model: env("MODEL_ID"),
    provider: { type: "openai", base_url: env("MODEL_URL"), api_key: "bench-key" },
    // The same session as the SDK modes' `sessionConfig()`: only the gateway's tools. (The
    // runtime's built-in tools would enlarge every model request, and their cost, the runtimes'
    // CPU per turn, would be the workload's difference, not the pool's.)
    session: { streaming: STREAMING, availableTools: ["custom:*"] },
    // What a gateway over HTTP does: it leaves out the runtime's internal events (in no
    // schema; a snapshot of the whole conversation, tens of KiB, at every model call) and the
    // system prompt the runtime repeats at every turn (`system.message`, 7.7 KiB, nearly half
    // of a tool turn's stream). The SDK modes cannot: the runtime sends every event to the SDK.
    omit_events: ["model.*", "system.message"],
  };
  if (TOOL) {
    body.tools = [{
      name: TOOL_NAME,
      description: "Returns the secret number for a key",
      parameters: { type: "object", properties: { key: { type: "string" } } },
    }];
  }
  const response = await post(`${base}/v1/turns`, body);
  marks.ready = now();
  if (response.statusCode !== 200) {
    throw new Error(`POST /v1/turns: HTTP ${response.statusCode}: ${await readAll(response)}`);
  }
  response.setEncoding("utf8");
  let buffer = "";
  let ended = false;
  for await (const chunk of response) {
    buffer += chunk;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let type = null;
      let data = null;
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) type = line.slice(6).trim();
        else if (line.startsWith("data:")) data = (data ?? "") + line.slice(5).trim();
      }
      if (type === null && data === null) continue; // a comment
      firstEvent(marks, type);
      if (type === "tool.call") {
        const call = JSON.parse(data);
        const answered = await post(`${base}/v1/requests/${call.request_id}`, {
          result: toolAnswer(call.arguments),
        });
        const said = await readAll(answered);
        if (answered.statusCode !== 204) {
          throw new Error(`answering the tool call: HTTP ${answered.statusCode}: ${said}`);
        }
      } else if (type === "turn.end") {
        const end = JSON.parse(data);
        if (end.status !== "idle") throw new Error(`turn ended ${end.status}: ${end.error ?? ""}`);
        // Read on to the stream's end, which follows at once: leaving the loop here would
        // destroy the socket, and the next turn would open a new connection.
        ended = true;
      }
    }
  }
  if (!ended) throw new Error("the stream ended without turn.end");
}

// ---- The official Node SDK --------------------------------------------------------------------

// Each mode's client library is loaded before the clock starts: the SDK modes import the SDK;
// the HTTP mode's, `node:http`, is loaded with this script.
let sdk;
if (MODE !== "http") sdk = await import(pathToFileURL(join(env("SDK_DIR"), "dist", "index.js")).href);

const homeOf = (agent) => join(env("HOMES"), "agents", `agent-${agent}`, "copilot");
const newClient = (agent) => {
  const { CopilotClient, RuntimeConnection } = sdk;
  if (MODE === "endpoint") {
    return new CopilotClient({
      connection: RuntimeConnection.forUri(env("SDK_URL"), { connectionToken: `${env("TOKEN_PREFIX")}${agent}` }),
    });
  }
  mkdirSync(homeOf(agent), { recursive: true });
  return new CopilotClient({
    connection: RuntimeConnection.forStdio({ path: env("RUNTIME"), env: { ...process.env, COPILOT_HOME: homeOf(agent) } }),
  });
};
const sessionConfig = () => {
  const config = {
    model: env("MODEL_ID"),
    provider: { type: "openai", baseUrl: env("MODEL_URL"), apiKey: "bench-key" },
    availableTools: ["custom:*"],
    onPermissionRequest: sdk.approveAll,
    streaming: STREAMING,
  };
  if (TOOL) {
    config.tools = [sdk.defineTool(TOOL_NAME, {
      description: "Returns the secret number for a key",
      parameters: { type: "object", properties: { key: { type: "string" } } },
      skipPermission: true,
      handler: async (args) => toolAnswer(args),
    })];
  }
  return config;
};

// One turn on a session object: resolves at session.idle, its first event in `marks`.
function sdkTurn(session, text, marks) {
  return new Promise((resolve, reject) => {
    const off = session.on((event) => {
      firstEvent(marks, event.type);
      if (event.type === "session.idle") { off(); resolve(); }
      else if (event.type === "session.error") { off(); reject(new Error(`session.error: ${event.data?.message}`)); }
    });
    session.send({ prompt: prompt(text) }).catch((error) => { off(); reject(error); });
  });
}

// Agent state: its client (one per agent, started once) and each conversation's session.
const agents = [];
const clientOf = (agent) => {
  const state = agents[agent];
  if (!state.started) {
    state.client = newClient(agent);
    state.started = within(ATTEMPT_MS, state.client.start(), "client start");
  }
  return state.started.then(() => state.client);
};

// One turn of a conversation in the mode's way, its clock in `marks`. The whole
// attempt (a resume included) is bounded by ATTEMPT_MS.
function conversationTurn(agent, conversation, text, marks) {
  if (MODE === "http") return within(ATTEMPT_MS, httpTurn(agent, conversation, text, marks), "turn");
  const attempt = async () => {
    const state = agents[agent];
    const client = await clientOf(agent);
    let session = state.sessions[conversation];
    if (!session) {
      session = await client.createSession(sessionConfig());
      state.ids[conversation] = session.sessionId;
    } else if (MODE === "resume" || state.stale.has(conversation)) {
      session = await client.resumeSession(state.ids[conversation], sessionConfig());
      state.stale.delete(conversation);
    }
    state.sessions[conversation] = session;
    marks.ready = now();
    await sdkTurn(session, text, marks);
  };
  return within(ATTEMPT_MS, attempt(), "turn");
}

// ---- The workload -----------------------------------------------------------------------------

for (let a = 0; a < AGENTS; a++) agents.push({ started: null, client: null, sessions: [], ids: [], stale: new Set() });
const cold = [];
const firstIdle = [];
const warm = [];
// The clock starts here, each mode's client library loaded: the harness takes its CPU
// readings (the gateway's figure leaves out Node's start and the SDK's import) and says `go`.
say({ step: "start" });
await waitFor("go");
const started = now();
await Promise.all(
  Array.from({ length: AGENTS * CONVERSATIONS }, async (_, i) => {
    const agent = i % AGENTS;
    const conversation = Math.floor(i / AGENTS);
    for (let t = 0; t < TURNS; t++) {
      const sent = now();
      const marks = newMarks();
      await conversationTurn(agent, conversation, `turn ${t} of ${agent}/${conversation}`, marks);
      const idleAt = now();
      const firstAt = marks.first;
      trace("load", started, agent, conversation, t, sent, marks, idleAt);
      if (t === 0) {
        cold.push((firstAt ?? idleAt) - started);
        firstIdle.push(idleAt - started);
      } else {
        warm.push(idleAt - sent);
      }
    }
  }),
);
const loadMs = now() - started;
say({ step: "load", turns: AGENTS * CONVERSATIONS * TURNS, ms: loadMs, cold, firstIdle, warm });
// The harness reads the CPU and memory figures before anything is stopped.
await waitFor("measured");

// ---- The returning agent -------------------------------------------------------------------------
// Every agent goes away: the SDK modes stop their clients (their runtimes exit, as a gateway
// stops an idle client); the harness then waits until the runtimes are gone (the pool: evicted
// after its short idle TTL, a primed spare kept in their place) and answers `back`. Then every
// agent returns at once with one turn on its first conversation (a resume), timed from the
// return to its first event and to its end.

for (const state of agents) {
  if (state.client) await within(ATTEMPT_MS, state.client.stop(), "client stop").catch(() => {});
  state.started = null;
  state.client = null;
  // Their sessions belonged to the stopped client: the next turn resumes them.
  state.stale = new Set(state.sessions.keys());
}
say({ step: "away" });
await waitFor("back");
const returningFirst = [];
const returningIdle = [];
await Promise.all(
  agents.map(async (_, agent) => {
    const sent = now();
    const marks = newMarks();
    await conversationTurn(agent, 0, `back ${agent}/0`, marks);
    const idleAt = now();
    const firstAt = marks.first;
    trace("return", sent, agent, 0, 0, sent, marks, idleAt);
    returningFirst.push((firstAt ?? idleAt) - sent);
    returningIdle.push(idleAt - sent);
  }),
);
say({ step: "returned", firstEvent: returningFirst, firstIdle: returningIdle });

// ---- Kill to ready ------------------------------------------------------------------------------

say({ step: "kill", agent: 0 });
await waitFor("killed");
killed = true;
const killedAt = now();
let readyMs = null;
const attempts = [];
for (let attempt = 0; attempt < 5 && readyMs === null; attempt++) {
  const marks = newMarks();
  const sent = now();
  try {
    await conversationTurn(0, 0, `after the kill ${attempt}`, marks);
    readyMs = (marks.first ?? now()) - killedAt;
    trace("kill", killedAt, 0, 0, attempt, sent, marks, now());
  } catch (error) {
    attempts.push(String(error?.message ?? error));
    if (MODE === "resume" || MODE === "attached") {
      // The SDK alone: a new client (and runtime), and the session resumed on it (the
      // resume mode resumes before every turn anyway).
      const state = agents[0];
      await within(ATTEMPT_MS, state.client.forceStop(), "force stop").catch(() => {});
      state.started = null;
      const client = await clientOf(0);
      if (MODE === "attached") {
        state.sessions[0] = await within(ATTEMPT_MS, client.resumeSession(state.ids[0], sessionConfig()), "resume");
      }
    }
  }
}
if (readyMs === null) throw new Error(`agent 0 was not ready after 5 attempts: ${attempts.join("; ")}`);
say({ step: "ready", ms: readyMs, failedAttempts: attempts });

for (const state of agents) if (state.client) await state.client.stop().catch(() => {});
say({ done: true });
process.exit(0);
