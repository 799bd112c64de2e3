#!/usr/bin/env python3
"""What one runtime process costs before and at its first turn, and which session options
change it: the CPU (user + system, from /proc, in the kernel's 10 ms ticks) and the resident
memory of a bare `copilot-runtime` driven over its stdio JSON-RPC, with no pool in between.

Each run starts the runtime in a fresh COPILOT_HOME, sends `connect`, `session.create` (a
BYOK provider: the embedded scripted model, `copilot-pool scripted-model`), optionally
`session.options.update` with a variant's options, then two plain turns, and reads the
process's CPU and RSS after the create, after the first turn and after the second. Variants
alternate, --runs of each; the medians are printed.

    cargo build --release
    python3 scripts/runtime-first-turn.py [--bin target/release/copilot-pool] [--runs 3]

Why: at 4 agents x 3 conversations x 2 turns the bench is CPU-bound and each agent's process
pays its first turn once, in every mode; this says how much of the runtimes' CPU that is and
whether the pool could avoid any of it by the options it sets. Nothing is asserted.
"""

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
# A bound on any one call or turn (a failure guard).
STEP_LIMIT = 60

VARIANTS = {
    "default": ({}, {}),
    "no host git": ({}, {"enableHostGitOperations": False}),
    "no embeddings": ({}, {"skipEmbeddingRetrieval": True}),
    "no skills": ({"enableSkills": False}, {}),
    "no custom instructions": ({}, {"skipCustomInstructions": True}),
    "all of them off": (
        {"enableSkills": False},
        {
            "enableHostGitOperations": False,
            "skipEmbeddingRetrieval": True,
            "skipCustomInstructions": True,
            "enableSessionStore": False,
            "enableFileHooks": False,
        },
    ),
}


def fail(message):
    sys.exit(f"runtime-first-turn: {message}")


class Runtime:
    """One runtime process and its framed JSON-RPC over stdio."""

    def __init__(self, executable, home):
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "COPILOT_HOME": str(home / "copilot"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "NO_PROXY": "127.0.0.1,localhost",
        }
        (home / "work").mkdir(parents=True)
        self.work = home / "work"
        self.proc = subprocess.Popen(
            [executable, "--headless", "--no-auto-update", "--stdio", "--no-auto-login"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env, cwd=self.work, start_new_session=True,
        )
        self.next_id = 1
        self.answers = {}
        self.events = queue.Queue()
        self.lock = threading.Condition()
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        out = self.proc.stdout
        while True:
            length = None
            while True:
                line = out.readline()
                if not line:
                    return
                line = line.strip()
                if not line:
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            message = json.loads(out.read(length))
            if "id" in message and "method" not in message:
                with self.lock:
                    self.answers[message["id"]] = message
                    self.lock.notify_all()
            elif "id" in message:
                # A request of the runtime's: none is expected; answer it empty.
                self.send({"jsonrpc": "2.0", "id": message["id"], "result": {}})
            elif message.get("method") == "session.event":
                self.events.put(message["params"]["event"]["type"])

    def send(self, message):
        body = json.dumps(message).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.proc.stdin.flush()

    def call(self, method, params):
        with self.lock:
            rid = self.next_id
            self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        deadline = time.monotonic() + STEP_LIMIT
        with self.lock:
            while rid not in self.answers:
                if not self.lock.wait(timeout=max(0, deadline - time.monotonic())):
                    fail(f"no answer to {method} within {STEP_LIMIT} s")
            answer = self.answers.pop(rid)
        if "error" in answer:
            fail(f"{method}: {answer['error']}")
        return answer["result"]

    def turn(self, session_id, prompt):
        self.call("session.send", {"sessionId": session_id, "prompt": prompt})
        deadline = time.monotonic() + STEP_LIMIT
        while True:
            try:
                event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                fail(f"no session.idle within {STEP_LIMIT} s")
            if event == "session.idle":
                return

    def cpu_ms(self):
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        # utime, stime, and those of its reaped children (git and the like).
        return sum(int(f) for f in fields[11:15]) * TICK_MS

    def rss_mib(self):
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def close(self):
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()


def settled(runtime):
    """The process's figures once what it does after an answer is done (its idle event came,
    but it may still write its session files)."""
    time.sleep(0.3)
    return runtime.cpu_ms(), runtime.rss_mib()


def one_run(executable, model_url, create_extra, update, scratch, n):
    home = scratch / f"run-{n}"
    runtime = Runtime(executable, home)
    try:
        runtime.call("connect", {})
        start_cpu, _ = settled(runtime)
        session_id = f"dddddddd-0000-4000-8000-{n:012d}"
        runtime.call("session.create", {
            "sessionId": session_id, "model": "scripted-model",
            "workingDirectory": str(runtime.work),
            "provider": {"type": "openai", "baseUrl": model_url, "apiKey": "scripted-key"},
            **create_extra,
        })
        if update:
            runtime.call("session.options.update", {"sessionId": session_id, **update})
        created_cpu, created_rss = settled(runtime)
        runtime.turn(session_id, "REPLY=first")
        first_cpu, first_rss = settled(runtime)
        runtime.turn(session_id, "REPLY=second")
        second_cpu, _ = settled(runtime)
        return {
            "start": start_cpu, "create": created_cpu - start_cpu,
            "first turn": first_cpu - created_cpu, "second turn": second_cpu - first_cpu,
            "RSS after create": created_rss, "RSS after the first turn": first_rss,
        }
    finally:
        runtime.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default=str(REPO / "target" / "release" / "copilot-pool"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    binary = Path(args.bin)
    if not binary.is_file():
        fail(f"{binary} is missing: run `cargo build --release` first, or pass --bin")
    installed = subprocess.run([str(binary), "install-cli"], capture_output=True, text=True,
                               timeout=600)
    lines = installed.stdout.strip().splitlines()
    if installed.returncode != 0 or not lines:
        fail(f"install-cli failed (exit {installed.returncode}):\n{installed.stderr}")
    executable = lines[-1]

    scratch = Path(tempfile.mkdtemp(prefix="runtime-first-turn-"))
    model = subprocess.Popen([str(binary), "scripted-model"], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        line = model.stdout.readline()
        if not line.startswith("model on "):
            fail(f"the scripted model did not start: {line!r}")
        model_url = line.split()[-1]
        results = {name: [] for name in VARIANTS}
        n = 0
        for _ in range(args.runs):
            for name, (create_extra, update) in VARIANTS.items():
                n += 1
                results[name].append(one_run(executable, model_url, create_extra, update,
                                             scratch, n))
        print(f"median of {args.runs} runs each (CPU in ms of the runtime process, RSS in MiB)")
        columns = list(next(iter(results.values()))[0].keys())
        print(f"{'options':24} " + " ".join(f"{c:>24}" for c in columns))
        for name, runs in results.items():
            row = [statistics.median(r[c] for r in runs) for c in columns]
            print(f"{name:24} " + " ".join(f"{v:24.1f}" for v in row))
    finally:
        os.killpg(model.pid, 9)
        model.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
