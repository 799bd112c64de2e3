#!/usr/bin/env node
// A fake Copilot runtime for faults the real one cannot be told to produce. It speaks the
// runtime's JSON-RPC (Content-Length frames on stdio) just far enough for the pool:
// `connect`, `llmInference.setProvider`, `ping`, `session.create`/`resume` (creating `$COPILOT_HOME/session-state/<id>`
// like the real one), `session.send`, `session.abort`, `session.detach`, `session.delete`,
// `session.name.set`.
//
// FAKE_RUNTIME_MODE picks the fault:
//   never-idle       acknowledges `session.abort` but never sends `session.idle`
//   crash-on-resume  exits with status 7 on every `session.resume`
//   stray-after-abort  after acknowledging `session.abort`, asks for a client tool call and
//                    sends `session.idle {aborted: true}` only once that call is answered
//   flood            answers every `session.send` with FAKE_RUNTIME_FLOOD_EVENTS (default
//                    10000) `assistant.message_delta` events in one write, then `session.idle`:
//                    a synthetic peer for measuring the pool's own framing and routing
//                    (`cargo bench --bench routing`), so the runtime is not the limit
//   late-open-event  sends `session.start` / `session.resume` 300 ms after its answer to the
//                    open (the real runtime sends it right after, usually read with the answer)
//   delete-fails-once  refuses the first `session.delete` in its `COPILOT_HOME` (a marker
//                    file there), answers every later one; a `session.send` is answered
//                    with an `assistant.message` and `session.idle`
//   compaction-between-turns  answers each `session.send` with an `assistant.message` and
//                    `session.idle`, then a successful `session.compaction_complete` (a
//                    background compaction that ends after the turn)
//   slow-answers     answers `session.send` and `session.delete` 500 ms late (a caller may
//                    stop waiting meanwhile), and a `session.abort` at once with
//                    `session.idle {aborted: true}`
//   idle-as-a-send-lands  a first `session.send` starts a turn that waits; a second one sent
//                    into it ends that turn (`session.idle`, written before the send's answer,
//                    as the runtime does when a prompt lands as its turn ends) and starts a
//                    turn of its own: `assistant.message` `REPLY-TO-<prompt>`, then
//                    `session.idle`, 200 ms apart, once `session.metadata.isProcessing`
//                    (which says whether a turn runs) was asked, or 3 s after the prompt
//
// With FAKE_RUNTIME_LOG set, every method it is called with is appended to that file, one
// line each.
import fs from "node:fs";
import path from "node:path";

const mode = process.env.FAKE_RUNTIME_MODE ?? "";
const home = process.env.COPILOT_HOME ?? ".";

function write(message) {
  const body = Buffer.from(JSON.stringify({ jsonrpc: "2.0", ...message }));
  process.stdout.write(`Content-Length: ${body.length}\r\n\r\n`);
  process.stdout.write(body);
}

let eventCount = 0;
function event(sessionId, type, data) {
  eventCount += 1;
  write({
    method: "session.event",
    params: { sessionId, event: { id: `e-${eventCount}`, type, data, timestamp: new Date().toISOString() } },
  });
}

// flood: each session's events, framed once and written as they are on every send.
const floodEvents = Number(process.env.FAKE_RUNTIME_FLOOD_EVENTS ?? "10000");
const floods = new Map();
function flood(sessionId) {
  let frames = floods.get(sessionId);
  if (frames === undefined) {
    const parts = [];
    for (let i = 0; i < floodEvents; i += 1) {
      const body = Buffer.from(
        JSON.stringify({
          jsonrpc: "2.0",
          method: "session.event",
          params: {
            sessionId,
            event: {
              id: `f-${i}`,
              type: "assistant.message_delta",
              data: { messageId: "m-flood", deltaContent: "token " },
              timestamp: "2026-11-30T00:00:00.000Z",
            },
          },
        }),
      );
      parts.push(Buffer.from(`Content-Length: ${body.length}\r\n\r\n`), body);
    }
    frames = Buffer.concat(parts);
    floods.set(sessionId, frames);
  }
  process.stdout.write(frames);
  event(sessionId, "session.idle", {});
}

function sessionDir(id) {
  fs.mkdirSync(path.join(home, "session-state", id), { recursive: true });
}

const SLOW_MS = 500;
// Sessions running a turn (idle-as-a-send-lands), and the rest of a turn a late prompt
// started, by session.
const running = new Set();
const landed = new Map();

function handle({ id, method, params }) {
  const reply = (result) => write({ id, result });
  if (process.env.FAKE_RUNTIME_LOG) fs.appendFileSync(process.env.FAKE_RUNTIME_LOG, `${method}\n`);
  switch (method) {
    case "connect":
      return reply({ ok: true, protocolVersion: 3, version: "fake-runtime" });
    case "llmInference.setProvider":
      // A BYOK process serves its model requests over the pipe (the guarded model path).
      return reply({ success: true });
    case "ping":
      return reply({ message: "pong", timestamp: Date.now(), protocolVersion: 3 });
    case "session.create":
      sessionDir(params.sessionId);
      reply({ sessionId: params.sessionId });
      if (mode === "late-open-event") {
        setTimeout(() => event(params.sessionId, "session.start", { sessionId: params.sessionId }), 300);
      }
      return;
    case "session.resume":
      if (mode === "crash-on-resume") {
        process.stderr.write(`fake runtime: crashing on resume of ${params.sessionId}\n`);
        process.exit(7);
      }
      sessionDir(params.sessionId);
      return reply({ sessionId: params.sessionId });
    case "session.metadata.isProcessing":
      reply({ processing: running.has(params.sessionId) });
      // The turn a late prompt started goes on once the client asked (or 3 s after it began).
      landed.get(params.sessionId)?.();
      return;
    case "session.send":
      if (mode === "idle-as-a-send-lands") {
        if (!running.has(params.sessionId)) {
          running.add(params.sessionId);
          return reply({ messageId: `m-${Date.now()}` });
        }
        event(params.sessionId, "session.idle", {});
        reply({ messageId: `m-${Date.now()}` });
        const goOn = () => {
          if (!landed.delete(params.sessionId)) return;
          event(params.sessionId, "assistant.message", { messageId: "m-2", content: `REPLY-TO-${params.prompt}` });
          setTimeout(() => {
            running.delete(params.sessionId);
            event(params.sessionId, "session.idle", {});
          }, 200);
        };
        landed.set(params.sessionId, () => setTimeout(goOn, 50));
        setTimeout(goOn, 3000);
        return;
      }
      if (mode === "slow-answers") {
        setTimeout(() => reply({ messageId: `m-${Date.now()}` }), SLOW_MS);
        return;
      }
      reply({ messageId: `m-${Date.now()}` });
      if (mode === "flood") flood(params.sessionId);
      if (mode === "delete-fails-once") {
        event(params.sessionId, "assistant.message", { messageId: "m-1", content: "fake reply" });
        event(params.sessionId, "session.idle", {});
      }
      if (mode === "compaction-between-turns") {
        event(params.sessionId, "session.compaction_start", { trigger: "threshold", currentTokens: 9 });
        event(params.sessionId, "assistant.message", { messageId: "m-1", content: "fake reply" });
        event(params.sessionId, "session.idle", {});
        event(params.sessionId, "session.compaction_complete", {
          success: true,
          summaryContent: `SUMMARY-AFTER-${params.prompt}`,
        });
      }
      return;
    case "session.abort":
      // never-idle: the abort is acknowledged, and no session.idle ever follows.
      reply({ success: true });
      if (mode === "slow-answers") event(params.sessionId, "session.idle", { aborted: true });
      if (mode === "stray-after-abort") {
        event(params.sessionId, "external_tool.requested", {
          requestId: "stray-1",
          sessionId: params.sessionId,
          toolCallId: "call-stray-1",
          toolName: "stray_tool",
          arguments: {},
        });
      }
      return;
    case "session.tools.handlePendingToolCall":
      reply({ success: true });
      if (mode === "stray-after-abort" && params.requestId === "stray-1") {
        event(params.sessionId, "session.idle", { aborted: true });
      }
      return;
    case "session.delete":
      if (mode === "delete-fails-once") {
        // The first deletion in this home is refused; the next (any process) succeeds.
        const marker = path.join(home, "delete-refused-once");
        if (!fs.existsSync(marker)) {
          fs.writeFileSync(marker, "");
          return write({ id, error: { code: -32603, message: "fake runtime: could not delete the session" } });
        }
      }
      if (mode === "slow-answers") {
        setTimeout(() => {
          fs.rmSync(path.join(home, "session-state", params.sessionId), { recursive: true, force: true });
          reply({ success: true });
        }, SLOW_MS);
        return;
      }
      return reply({ success: true });
    case "session.detach":
      return reply({ success: true });
    case "session.name.set":
      // A session call with an effect, for the endpoint's let-go tests.
      return reply({});
    default:
      if (id !== undefined) {
        write({ id, error: { code: -32601, message: `fake runtime: no method ${method}` } });
      }
  }
}

let buffer = Buffer.alloc(0);
process.stdin.on("data", (chunk) => {
  buffer = Buffer.concat([buffer, chunk]);
  for (;;) {
    const end = buffer.indexOf("\r\n\r\n");
    if (end < 0) return;
    const header = buffer.subarray(0, end).toString();
    const match = /Content-Length: (\d+)/i.exec(header);
    if (!match) process.exit(2);
    const length = Number(match[1]);
    if (buffer.length < end + 4 + length) return;
    const body = buffer.subarray(end + 4, end + 4 + length).toString();
    buffer = buffer.subarray(end + 4 + length);
    handle(JSON.parse(body));
  }
});
process.stdin.on("end", () => process.exit(0));
