#!/usr/bin/env node
// Fault injection in front of the real runtime: runs PROXY_RUNTIME with our arguments and
// passes its frames through both ways, except that once the runtime streams a
// `session.resume` event, the proxy writes PROXY_MARKER and holds everything the runtime
// sends next (its reply to `session.resume` first) for PROXY_DELAY_MS. A test can then act
// between the runtime's resume event and its reply, which the real runtime alone leaves no
// time for. Once the held reply is passed on, it writes PROXY_MARKER.replied.
import { spawn } from "node:child_process";
import fs from "node:fs";

const runtime = process.env.PROXY_RUNTIME;
const marker = process.env.PROXY_MARKER;
const delayMs = Number(process.env.PROXY_DELAY_MS ?? "500");

const child = spawn(runtime, process.argv.slice(2), { stdio: ["pipe", "pipe", "inherit"] });
process.stdin.pipe(child.stdin);
child.on("exit", (code, signal) => process.exit(code ?? (signal ? 1 : 0)));

let buffer = Buffer.alloc(0);
let held = Promise.resolve();
let holding = false;
child.stdout.on("data", (chunk) => {
  buffer = Buffer.concat([buffer, chunk]);
  for (;;) {
    const end = buffer.indexOf("\r\n\r\n");
    if (end < 0) return;
    const match = /Content-Length: (\d+)/i.exec(buffer.subarray(0, end).toString());
    if (!match) process.exit(2);
    const total = end + 4 + Number(match[1]);
    if (buffer.length < total) return;
    const frame = buffer.subarray(0, total);
    buffer = buffer.subarray(total);
    const isResumeEvent = frame.includes('"type":"session.resume"');
    // Frames keep their order: each waits for the ones before it.
    held = held.then(() => {
      process.stdout.write(frame);
      if (isResumeEvent) {
        fs.writeFileSync(marker, "resumed\n");
        return new Promise((resolve) => setTimeout(resolve, delayMs));
      }
      if (holding) {
        // The first frame after the hold (the reply) is out.
        holding = false;
        fs.writeFileSync(`${marker}.replied`, "replied\n");
      }
    });
    if (isResumeEvent) holding = true;
  }
});
