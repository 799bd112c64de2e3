#!/usr/bin/env python3
"""The daemon's own cost per warm turn, counted exactly: instructions, not CPU time; or,
with --syscalls, the system calls it makes.

On a 2-core machine the CPU time of one short run moves by 15-30 % from run to run, more
than most changes to the daemon's hot path. Valgrind's callgrind counts the instructions the
daemon executes instead, which repeat to well under 1 % between runs, and says where they go.

What it runs: the scripted model (`copilot-pool scripted-model`), `copilot-pool serve` under
callgrind (instrumentation off), and the bench's own gateway (`workload.mjs`, mode `http`:
POST /v1/turns, SSE back, the gateway tool answered over HTTP) with one agent. A first pass
opens every conversation with one turn; then instrumentation goes on for a second pass of
warm turns on the same conversations, and off again at its end. Prints the instructions per
turn and the crate's functions that take the most, inclusive of what they call.

With --cold the first pass is counted instead (--turns is then unused): every
conversation's first turn, all at once on one process started for them (its spawn and
handshake shared by the turns; each turn's `session.create`, the agent's directories, the
binding), which the bench's CPU per turn includes and the warm pass does not. The figure per
turn includes one-time work divided by --conversations; --conversations 1 gives a spawn's.

With --syscalls the daemon runs natively and `strace -f -c` counts the system calls of the
warm pass instead (per turn, by name): the kernel's share of the daemon's CPU (socket and pipe
writes, wake-ups, file lookups) is not in the instruction count.

With --cpu PASSES the daemon runs natively and its CPU time per warm turn is read from
`/proc` (user and system apart, and its threads' context switches) over PASSES warm passes,
beside its runtimes' CPU over the same passes: the bench's ratio for warm turns alone. The
first pass (each conversation's first turn, the process's start shared by them) is printed
first, the same way.

    cargo build --release
    python3 scripts/pool-instructions.py [--bin target/release/copilot-pool]
        [--conversations 4] [--turns 10] [--top 25] [--save FILE] [--unix-socket]
        [--cold | --syscalls | --cpu PASSES]

Needs valgrind (`callgrind_control`, `callgrind_annotate`), or strace for --syscalls, and
Node.js; finds or installs the runtime with `copilot-pool install-cli`. Under callgrind the
daemon runs ~50x slower, so a run takes a minute or two. Nothing is asserted: the numbers are
for comparing two builds.
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


def run_workload(env, turns, children, at_load=None):
    """One pass of the bench's gateway: answers its `go` and, at its `load` line (every turn
    done), calls `at_load` before the gateway is stopped (its sockets' close is not counted);
    returns that line."""
    proc = subprocess.Popen(
        ["node", str(WORKLOAD)],
        env={**env, "TURNS": str(turns)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children.append(proc)
    for line in proc.stdout:
        try:
            step = json.loads(line)
        except json.JSONDecodeError:
            fail(f"the workload printed a line that is not JSON: {line.strip()[:200]}")
        if "error" in step:
            fail(f"the workload failed: {step['error']}")
        if step.get("step") == "start":
            proc.stdin.write("go\n")
            proc.stdin.flush()
        elif step.get("step") == "load":
            if at_load:
                at_load()
            stop(proc)
            return step
    fail("the workload ended before its load was done")


def stop(proc):
    """Stops `proc`'s process group: SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def processes():
    """Every process as (pid, the fields of its `/proc/<pid>/stat` after the command name:
    state, parent, group, session, ...)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        yield int(entry.name), stat.rsplit(")", 1)[-1].split()


def kill_session(sid):
    """SIGKILLs whatever is left of session `sid` (serve's runtimes lead process groups of
    their own, in serve's session)."""
    for pid, fields in processes():
        if len(fields) > 3 and fields[3] == str(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def count_syscalls(pid, env, turns, children, scratch):
    """Counts the system calls of the daemon's threads (and of nothing it starts: the warm
    pass starts nothing) over a pass of `turns` warm turns, with `strace -f -c`."""
    table = scratch / "syscalls"
    tracer = subprocess.Popen(
        ["strace", "-f", "-c", "-U", "calls,errors,name", "-o", str(table), "-p", str(pid)],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    children.append(tracer)
    # strace says it is attached to every thread before it counts.
    attached = tracer.stderr.readline()
    if "attached" not in attached:
        fail(f"strace could not attach to the daemon: {attached.strip()}")

    def detach():
        tracer.send_signal(signal.SIGINT)
        try:
            tracer.wait(timeout=STEP_LIMIT)
        except subprocess.TimeoutExpired:
            fail("strace did not stop")

    load = run_workload(env, turns, children, at_load=detach)
    done = load["turns"]
    rows = []
    for line in table.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].isdigit():
            calls, name = int(fields[0]), fields[-1]
            errors = int(fields[1]) if len(fields) == 3 else 0
            rows.append((calls, errors, name))
    total = sum(r[0] for r in rows if r[2] != "total")
    print(f"{done} warm tool turns, {turns} per conversation")
    print(f"system calls per turn: {total / done:.1f}")
    for calls, errors, name in sorted(rows, reverse=True):
        if name == "total":
            continue
        failed = f"  ({errors / done:.1f} failed)" if errors else ""
        print(f"{calls / done:>8.1f}  {name}{failed}")


def cpu_of(pid):
    """(user, system) CPU seconds of process `pid` (all its threads, in clock ticks), its
    threads' context switches, and their CPU seconds to the nanosecond (`schedstat`; threads
    that ended are not counted there)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    tick = os.sysconf("SC_CLK_TCK")
    switches = 0
    on_cpu_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
            on_cpu_ns += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return int(fields[11]) / tick, int(fields[12]) / tick, switches, on_cpu_ns / 1e9


def runtimes_of(pid):
    """The pids of the daemon's runtimes (its children)."""
    return [child for child, fields in processes() if len(fields) > 1 and fields[1] == str(pid)]


def measure_cpu(pid, env, turns, passes, children, perf_file=None):
    """The daemon's CPU time per warm turn, user and system apart, over `passes` passes of
    `turns` warm turns each, beside its runtimes' (their children's CPU is not counted);
    with `perf_file`, `perf record` samples the daemon's threads over the passes into it."""
    rows = []
    recorder = None
    if perf_file:
        recorder = subprocess.Popen(
            ["perf", "record", "-e", "cpu-clock", "-F", "4000", "--call-graph", "dwarf,16384",
             "-t", ",".join(t.name for t in Path(f"/proc/{pid}/task").iterdir()),
             "-o", perf_file],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        children.append(recorder)
    for _ in range(passes):
        runtimes = runtimes_of(pid)
        before = cpu_of(pid), [cpu_of(r) for r in runtimes]
        after = []
        load = run_workload(
            env, turns, children,
            at_load=lambda: after.extend([cpu_of(pid), [cpu_of(r) for r in runtimes]]),
        )
        done = load["turns"]
        user = (after[0][0] - before[0][0]) * 1000 / done
        system = (after[0][1] - before[0][1]) * 1000 / done
        switches = (after[0][2] - before[0][2]) / done
        precise = (after[0][3] - before[0][3]) * 1000 / done
        runtime = sum(
            (a[0] + a[1]) - (b[0] + b[1]) for a, b in zip(after[1], before[1])
        ) * 1000 / done
        rows.append((user, system, switches, runtime, precise))
        print(
            f"{done} warm turns: daemon {precise:.3f} ms a turn (user {user:.2f} + system "
            f"{system:.2f} in ticks), {switches:.1f} context switches; runtimes {runtime:.1f} ms "
            f"({precise / runtime * 100:.1f} %)"
        )
    if recorder:
        recorder.send_signal(signal.SIGINT)
        try:
            recorder.wait(timeout=STEP_LIMIT)
        except subprocess.TimeoutExpired:
            fail("perf record did not stop")
    mid = lambda values: sorted(values)[len(values) // 2]
    user, system = mid([r[0] for r in rows]), mid([r[1] for r in rows])
    total = mid([r[4] for r in rows])
    runtime = mid([r[3] for r in rows])
    print(
        f"median of {passes}: daemon {total:.3f} ms a turn (user {user:.2f}, system "
        f"{system:.2f} in ticks), {mid([r[2] for r in rows]):.1f} context switches; runtimes "
        f"{runtime:.1f} ms; daemon / runtimes {mid([r[4] / r[3] for r in rows]) * 100:.1f} %"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", default=str(REPO / "target" / "release" / "copilot-pool"))
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=10, help="warm turns per conversation")
    parser.add_argument("--top", type=int, default=25, help="functions to list")
    parser.add_argument(
        "--save", metavar="FILE", help="keep callgrind's profile there (for callgrind_annotate)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--syscalls", action="store_true",
        help="count the warm pass's system calls with strace instead of instructions",
    )
    mode.add_argument(
        "--cpu", type=int, metavar="PASSES",
        help="measure the daemon's CPU time (user and system) per warm turn natively, over "
        "PASSES warm passes, beside its runtimes'",
    )
    mode.add_argument(
        "--cold", action="store_true",
        help="count the first pass (each conversation's first turn, the process's start) instead",
    )
    parser.add_argument(
        "--unix-socket", action="store_true",
        help="the gateway reaches the API over a Unix socket (serve --listen unix:PATH, with an "
        "API token) instead of loopback TCP",
    )
    parser.add_argument(
        "--perf", metavar="FILE",
        help="with --cpu: `perf record` the daemon's threads over the passes into FILE",
    )
    args = parser.parse_args()
    if args.perf and not args.cpu:
        parser.error("--perf records the passes of --cpu: give --cpu PASSES too")
    if args.syscalls:
        tools = (("strace", "strace"), ("node", "Node.js"))
    elif args.cpu:
        tools = (("node", "Node.js"),) + ((("perf", "linux-perf"),) if args.perf else ())
    else:
        tools = (
            ("valgrind", "valgrind"),
            ("callgrind_control", "valgrind"),
            ("callgrind_annotate", "valgrind"),
            ("node", "Node.js"),
        )
    for tool, package in tools:
        if shutil.which(tool) is None:
            fail(f"{tool} is not on PATH; install {package}")
    # A SIGTERM or SIGHUP ends the script through its cleanup.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda number, _frame: sys.exit(128 + number))
    binary = Path(args.bin)
    if not binary.exists():
        fail(f"{binary} does not exist; build it with `cargo build --release` or pass --bin")

    try:
        installed = subprocess.run(
            [str(binary), "install-cli"], capture_output=True, text=True, timeout=STEP_LIMIT
        )
    except subprocess.TimeoutExpired:
        fail(f"install-cli did not finish within {STEP_LIMIT} s")
    lines = installed.stdout.strip().splitlines()
    if installed.returncode != 0 or not lines:
        fail(f"install-cli failed (exit {installed.returncode}):\n{installed.stderr}")
    runtime = lines[-1]

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
        under = [] if args.syscalls or args.cpu else [
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={profile}",
        ]
        # Over a Unix socket the API needs a token (the sandbox does not wall socket files).
        token = "pool-instructions-token"
        listen = f"unix:{scratch / 'api.sock'}" if args.unix_socket else "127.0.0.1:0"
        serve_env = {**os.environ, "COPILOT_POOL_HOME": str(scratch / "home"),
                     "COPILOT_POOL_LOG": "error"}
        if args.unix_socket:
            serve_env["COPILOT_POOL_API_TOKEN"] = token
        with open(serve_out, "w") as out:
            serve = subprocess.Popen(
                [
                    *under,
                    str(binary), "serve", "--config", str(config),
                    "--listen", listen, "--state-dir", str(scratch / "state"),
                    "--cli", runtime,
                ],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=serve_env,
            )
        children.append(serve)
        at = wait_for_line(serve_out, r"listening on (\S+)", serve, "serve")

        env = {
            **os.environ, "MODE": "http", "AGENTS": "1",
            "CONVERSATIONS": str(args.conversations), "TOOL": "1", "STREAMING": "0",
            "MODEL_URL": model_url, "MODEL_ID": "scripted-model", "ATTEMPT_MS": "120000",
            "HTTP_URL": at,
        }
        if args.unix_socket:
            env.update({"HTTP_URL": "http://localhost", "HTTP_SOCKET": at.removeprefix("unix:"),
                        "API_TOKEN": token})
        def control(*options):
            done = subprocess.run(
                ["callgrind_control", *options, str(serve.pid)], capture_output=True,
                text=True, timeout=STEP_LIMIT,
            )
            if done.returncode != 0:
                fail(f"callgrind_control {' '.join(options)} failed:\n{done.stdout}{done.stderr}")

        if args.cold:
            control("-i", "on")
            load = run_workload(env, 1, children, at_load=lambda: control("-i", "off"))
        else:
            before = cpu_of(serve.pid)
            first = run_workload(env, 1, children)
            if args.cpu:
                # The first pass too: each conversation's first turn, the process's start
                # shared by them (what the bench's CPU per turn mixes with warm turns).
                after = cpu_of(serve.pid)
                done = first["turns"]
                runtimes = sum(sum(cpu_of(r)[:2]) for r in runtimes_of(serve.pid))
                print(
                    f"{done} first turns: daemon {(after[3] - before[3]) * 1000 / done:.3f} ms a "
                    f"turn, {(after[2] - before[2]) / done:.1f} context switches; runtimes "
                    f"{runtimes * 1000 / done:.1f} ms a turn (their start included)"
                )
            if args.syscalls:
                count_syscalls(serve.pid, env, args.turns, children, scratch)
                return
            if args.cpu:
                measure_cpu(serve.pid, env, args.turns, args.cpu, children, args.perf)
                return
            control("-i", "on")
            load = run_workload(env, args.turns, children, at_load=lambda: control("-i", "off"))
        control("-d")
        turns = load["turns"]
        kind = "first (cold) tool turns," if args.cold else "warm tool turns,"

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
        print(f"{turns} {kind} {args.conversations} conversations on one process")
        print(f"instructions per turn: {instructions / turns:,.0f}")
        print(f"\nthe crate's functions, inclusive, per turn (of {instructions / turns:,.0f}):")
        seen = set()
        for line in annotated.splitlines():
            # `file:function [object]`, the function perhaps `<T as Trait>::f` or with spaces.
            match = re.match(
                r"^\s*([\d,]+) \(\s*([\d.]+)%\)\s+\S*?:(<?copilot_pool::.+?)(?: \[[^\]]*\])?$",
                line,
            )
            if not match or match.group(3) in seen:
                continue
            seen.add(match.group(3))
            count = int(match.group(1).replace(",", "")) / turns
            print(f"{count:>12,.0f}  {float(match.group(2)):5.1f} %  {match.group(3)}")
            if len(seen) >= args.top:
                break
    finally:
        for child in reversed(children):
            stop(child)
            # The daemon's runtimes are in its session, in process groups of their own.
            kill_session(child.pid)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
