#!/usr/bin/env python3
"""The daemon's own cost per warm turn, counted exactly: instructions, not CPU time.

On a 2-core machine the CPU time of one short run moves by 15-30 % from run to run, more
than most changes to the daemon's hot path. Valgrind's callgrind counts the instructions the
daemon executes instead, which repeat to well under 1 % between runs, and says where they go.

What it runs: the scripted model (`copilot-pool scripted-model`), `copilot-pool serve` under
callgrind (instrumentation off), and the bench's own gateway (`workload.mjs`, mode `http`:
POST /v1/turns, SSE back, the gateway tool answered over HTTP) with one agent. A first pass
opens every conversation with one turn; then instrumentation goes on for a second pass of
warm turns on the same conversations, and off again at its end. Prints the instructions per
turn and the crate's functions that take the most, inclusive of what they call.

    cargo build --release
    python3 scripts/pool-instructions.py [--conversations 4] [--turns 10] [--top 25]
                                         [--save FILE]

Needs valgrind (`callgrind_control`, `callgrind_annotate`) and Node.js; finds or installs the
runtime with `copilot-pool install-cli`. Under callgrind the daemon runs ~50x slower, so a
run takes a minute or two. Nothing is asserted: the numbers are for comparing two builds.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "src" / "bin" / "copilot-pool" / "bench" / "workload.mjs"
# A bound on waiting for any one step (a failure guard; the daemon is slow under callgrind).
STEP_LIMIT = 600


def fail(message):
    sys.exit(f"pool-instructions: {message}")


def wait_for_line(path, pattern, proc, what):
    """The first match of `pattern` in the file `path` (a process's output), waiting for it."""
    deadline = time.monotonic() + STEP_LIMIT
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        match = re.search(pattern, text)
        if match:
            return match.group(1)
        if proc.poll() is not None:
            fail(f"{what} exited before it was ready:\n{text[-2000:]}")
        time.sleep(0.1)
    fail(f"{what} was not ready within {STEP_LIMIT} s")


def run_workload(env, turns):
    """One pass of the bench's gateway: answers its `go`, returns its `load` line."""
    proc = subprocess.Popen(
        ["node", str(WORKLOAD)],
        env={**env, "TURNS": str(turns)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            step = json.loads(line)
            if "error" in step:
                fail(f"the workload failed: {step['error']}")
            if step.get("step") == "start":
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif step.get("step") == "load":
                return step
        fail("the workload ended before its load was done")
    finally:
        proc.kill()
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default=str(REPO / "target" / "release" / "copilot-pool"))
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=10, help="warm turns per conversation")
    parser.add_argument("--top", type=int, default=25, help="functions to list")
    parser.add_argument(
        "--save", metavar="FILE", help="keep callgrind's profile there (for callgrind_annotate)"
    )
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate", "node"):
        if shutil.which(tool) is None:
            fail(f"{tool} is not on PATH (valgrind's package has the callgrind tools)")
    binary = Path(args.bin)
    if not binary.exists():
        fail(f"{binary} does not exist; build it with `cargo build --release` or pass --bin")

    installed = subprocess.run(
        [str(binary), "install-cli"], capture_output=True, text=True, timeout=STEP_LIMIT
    )
    if installed.returncode != 0:
        fail(f"install-cli failed:\n{installed.stderr}")
    runtime = installed.stdout.strip().splitlines()[-1]

    scratch = Path(tempfile.mkdtemp(prefix="pool-instructions-"))
    children = []
    try:
        model_out = scratch / "model.out"
        with open(model_out, "w") as out:
            model = subprocess.Popen(
                [str(binary), "scripted-model"], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        children.append(model)
        model_url = wait_for_line(model_out, r"model on (\S+)", model, "the scripted model")

        config = scratch / "serve.toml"
        config.write_text(
            "[pool]\nmax_sessions = 4096\nmax_waiters = 4096\n\n"
            "[model]\nallow_private_endpoints = true\n"
        )
        profile = scratch / "callgrind.out"
        serve_out = scratch / "serve.out"
        with open(serve_out, "w") as out:
            serve = subprocess.Popen(
                [
                    "valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={profile}",
                    str(binary), "serve", "--config", str(config),
                    "--listen", "127.0.0.1:0", "--state-dir", str(scratch / "state"),
                    "--cli", runtime,
                ],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "COPILOT_POOL_HOME": str(scratch / "home"),
                     "COPILOT_POOL_LOG": "error"},
            )
        children.append(serve)
        url = wait_for_line(serve_out, r"listening on (http://\S+)", serve, "serve")

        env = {
            **os.environ, "MODE": "http", "AGENTS": "1",
            "CONVERSATIONS": str(args.conversations), "TOOL": "1", "STREAMING": "0",
            "MODEL_URL": model_url, "MODEL_ID": "scripted-model", "ATTEMPT_MS": "120000",
            "HTTP_URL": url,
        }
        run_workload(env, 1)
        control = lambda *a: subprocess.run(
            ["callgrind_control", *a, str(serve.pid)], check=True, capture_output=True,
            timeout=STEP_LIMIT,
        )
        control("-i", "on")
        load = run_workload(env, args.turns)
        control("-i", "off")
        control("-d")
        turns = load["turns"]

        dumps = sorted(scratch.glob("callgrind.out.*"))
        if not dumps:
            fail("callgrind wrote no dump")
        if args.save:
            shutil.copyfile(dumps[-1], args.save)
        annotated = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", str(dumps[-1])],
            capture_output=True, text=True, check=True,
        ).stdout
        total = re.search(r"^\s*([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", annotated, re.M)
        if not total:
            fail("callgrind_annotate printed no total")
        instructions = int(total.group(1).replace(",", ""))
        print(f"{turns} warm tool turns, {args.conversations} conversations on one process")
        print(f"instructions per turn: {instructions / turns:,.0f}")
        print(f"\nthe crate's functions, inclusive, per turn (of {instructions / turns:,.0f}):")
        seen = set()
        for line in annotated.splitlines():
            match = re.match(r"^\s*([\d,]+) \(\s*([\d.]+)%\)\s+(\S+?):(copilot_pool::\S+)", line)
            if not match or match.group(4) in seen:
                continue
            seen.add(match.group(4))
            count = int(match.group(1).replace(",", "")) / turns
            print(f"{count:>12,.0f}  {float(match.group(2)):5.1f} %  {match.group(4)}")
            if len(seen) >= args.top:
                break
    finally:
        for child in reversed(children):
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
