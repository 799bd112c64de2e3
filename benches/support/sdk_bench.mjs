// One workload, two ways (benches/sdk_endpoint.rs runs both): the official Node SDK attached
// by URL to copilot-pool (MODE=pool, one connection token per agent), or the same SDK
// spawning its own runtime per agent (MODE=direct, the runtime at RUNTIME with its own
// COPILOT_HOME under HOMES). Every step prints one JSON line; the harness measures memory
// and kills processes between steps and answers on stdin.
//
// Environment: SDK_DIR, MODE, AGENTS, SESSIONS (per agent), WARM_TURNS, LOAD_TURNS (per
// session), MODEL_URL, MODEL_ID; pool: SDK_URL and TOKEN_PREFIX (agent i's token is
// TOKEN_PREFIX + i); direct: RUNTIME, HOMES.

import { pathToFileURL } from "node:url";
import { join } from "node:path";
import { mkdirSync } from "node:fs";
import { createInterface } from "node:readline";

const env = (name) => {
  const value = process.env[name];
  if (value === undefined || value === "") throw new Error(`${name} is not set`);
  return value;
};
const sdk = await import(pathToFileURL(join(env("SDK_DIR"), "dist", "index.js")).href);
const { CopilotClient, RuntimeConnection, approveAll } = sdk;

const say = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
const now = () => performance.now();
const within = (ms, promise, what) =>
  Promise.race([
    promise,
    new Promise((_, reject) => setTimeout(() => reject(new Error(`${what}: no answer within ${ms} ms`)), ms).unref()),
  ]);
const stdin = createInterface({ input: process.stdin });
const lines = stdin[Symbol.asyncIterator]();
const waitFor = async (expected) => {
  const { value } = await lines.next();
  if (value !== expected) throw new Error(`expected ${expected} on stdin, got ${value}`);
};

const MODE = env("MODE");
const AGENTS = Number(env("AGENTS"));
const SESSIONS = Number(env("SESSIONS"));
const WARM_TURNS = Number(env("WARM_TURNS"));
const LOAD_TURNS = Number(env("LOAD_TURNS"));

const newClient = (agent) => {
  if (MODE === "pool") {
    return new CopilotClient({
      connection: RuntimeConnection.forUri(env("SDK_URL"), { connectionToken: `${env("TOKEN_PREFIX")}${agent}` }),
    });
  }
  const home = join(env("HOMES"), `agent-${agent}`);
  mkdirSync(home, { recursive: true });
  return new CopilotClient({
    connection: RuntimeConnection.forStdio({ path: env("RUNTIME"), env: { ...process.env, COPILOT_HOME: home } }),
  });
};
const config = () => ({
  model: env("MODEL_ID"),
  provider: { type: "openai", baseUrl: env("MODEL_URL"), apiKey: "scripted-key" },
  availableTools: ["custom:*"],
  onPermissionRequest: approveAll,
});
const turn = (session, text) => within(60000, session.sendAndWait({ prompt: `REPLY=${text}` }, 60000), "turn");

// Cold: from a new client (and, direct, its runtime) to the first event of the first turn.
const agents = [];
for (let a = 0; a < AGENTS; a++) {
  const started = now();
  const client = newClient(a);
  await within(60000, client.start(), "start");
  const session = await client.createSession(config());
  const first = new Promise((resolve) => {
    const off = session.on(() => { off(); resolve(now()); });
  });
  const done = turn(session, `cold ${a}`);
  const firstAt = await first;
  await done;
  const sessions = [session];
  for (let s = 1; s < SESSIONS; s++) sessions.push(await client.createSession(config()));
  agents.push({ client, sessions });
  say({ step: "cold", agent: a, ms: firstAt - started });
}

// Warm: one session's turns one after another.
const warm = [];
for (let i = 0; i < WARM_TURNS; i++) {
  const t = now();
  await turn(agents[0].sessions[0], `warm ${i}`);
  warm.push(now() - t);
}
say({ step: "warm", ms: warm });

// Load: every session of every agent runs its turns at once.
const loadStart = now();
await Promise.all(
  agents.flatMap(({ sessions }) =>
    sessions.map(async (session, s) => {
      for (let i = 0; i < LOAD_TURNS; i++) await turn(session, `load ${s} ${i}`);
    }),
  ),
);
const loadMs = now() - loadStart;
say({ step: "load", turns: AGENTS * SESSIONS * LOAD_TURNS, ms: loadMs });

// Memory: the harness measures the runtime processes (direct: these pids).
const pids = MODE === "direct" ? agents.map(({ client }) => client.cliProcess?.pid) : [];
say({ step: "memory", pids });
await waitFor("measured");

// Kill: the harness kills every runtime process and says so; each agent's first session is
// ready again when a turn on it succeeds (direct: a new client spawns a runtime and resumes).
say({ step: "kill", pids });
await waitFor("killed");
const killedAt = now();
const ready = await Promise.all(
  agents.map(async (agent, a) => {
    const id = agent.sessions[0].sessionId;
    for (let attempt = 0; attempt < 5; attempt++) {
      try {
        await turn(agent.sessions[0], `after the kill ${a}`);
        return now() - killedAt;
      } catch (error) {
        if (MODE === "direct") {
          await agent.client.forceStop().catch(() => {});
          agent.client = newClient(a);
          await within(60000, agent.client.start(), "restart");
          agent.sessions[0] = await agent.client.resumeSession(id, config());
        }
      }
    }
    throw new Error(`agent ${a} was not ready after 5 attempts`);
  }),
);
say({ step: "ready", ms: ready });
for (const { client } of agents) await client.stop();
say({ done: true });
process.exit(0);
