#!/usr/bin/env bash
# Checks the dashboard and the alert rules against a real Prometheus: starts the scripted
# model, `copilot-pool serve` and a Prometheus (Debian's `prometheus` package) scraping it,
# runs a short workload, then runs every PromQL expression of dashboards/copilot-pool.json and
# deploy/prometheus/alerts.yml through Prometheus' HTTP API, the dashboard's with every
# variable at All. Fails if an expression is invalid, or if a dashboard panel's query or a
# variable's label_values() selector returns no series.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo}"

prometheus="$(bash scripts/install-promtool.sh --prometheus)"
[[ -x "${prometheus}" ]] || { echo "error: scripts/install-promtool.sh --prometheus gave no prometheus executable" >&2; exit 1; }

venv="${repo}/target/tools/venv"
if [[ ! -x "${venv}/bin/python" ]]; then
    python3 -m venv "${venv}"
fi
# The version scripts/check-deploy.sh pins into the same environment.
if ! "${venv}/bin/python" -c 'import yaml' 2>/dev/null; then
    timeout 300 "${venv}/bin/pip" install -q --disable-pip-version-check pyyaml==6.0.4 || {
        echo "error: pip install pyyaml==6.0.4 into ${venv} failed or took over 5 minutes" \
            "(exit $?): check access to PyPI, then run this again" >&2
        exit 1
    }
fi

cargo build --quiet
bin="${CARGO_TARGET_DIR:-${repo}/target}/debug/copilot-pool"
runtime="$("${bin}" install-cli)" || {
    echo "error: copilot-pool install-cli failed (its error is above)" >&2
    exit 1
}

work="$(mktemp -d)"
pids=()
cleanup() {
    # SIGTERM drains serve; the scripted model stops on SIGINT.
    for pid in "${pids[@]}"; do kill -TERM "${pid}" 2>/dev/null || true; kill -INT "${pid}" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "${pid}" 2>/dev/null || true; done
    rm -rf "${work}"
}
trap cleanup EXIT

# Starts a command in the background (in this shell, so cleanup knows its pid), its stdout
# going to FILE.
start() {
    local file="$1"; shift
    "$@" >"${file}" 2>>"${work}/stderr.log" &
    pids+=("$!")
}

# Waits for a line starting with PREFIX in FILE and prints the rest of that line.
read_line() {
    local prefix="$1" file="$2"
    for _ in $(seq 1 300); do
        if grep -q "^${prefix}" "${file}" 2>/dev/null; then
            grep -m1 "^${prefix}" "${file}" | sed "s|^${prefix}||"
            return 0
        fi
        sleep 0.1
    done
    echo "error: no '${prefix}' line in ${file}" >&2
    cat "${work}/stderr.log" >&2
    return 1
}

start "${work}/model.out" "${bin}" scripted-model
model_url="$(read_line "model on " "${work}/model.out")"
# The scripted model is on loopback: the guarded model path lets it through only with
# allow_private_endpoints.
printf 'listen = "127.0.0.1:0"\nstate_dir = "%s/state"\nagents_dir = "%s/agents"\n[model]\nallow_private_endpoints = true\n' \
    "${work}" "${work}" >"${work}/serve.toml"
COPILOT_CLI_PATH="${runtime}" start "${work}/serve.out" "${bin}" serve --config "${work}/serve.toml"
serve_addr="$(read_line "listening on http://" "${work}/serve.out")"
prom_port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
cat >"${work}/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: copilot-pool
    static_configs:
      - targets: ["${serve_addr}"]
YAML
"${prometheus}" --config.file="${work}/prometheus.yml" --storage.tsdb.path="${work}/tsdb" \
    --web.listen-address="127.0.0.1:${prom_port}" --log.level=warn 2>>"${work}/stderr.log" &
pids+=("$!")

echo "workload: turns through ${serve_addr} (model ${model_url}, Prometheus on ${prom_port})"
"${venv}/bin/python" - "${serve_addr}" "${model_url}" <<'PY'
import json, sys, urllib.request
addr, model = sys.argv[1], sys.argv[2]
def turn(agent, key, prompt):
    body = {"agent_id": agent, "session_key": key, "prompt": prompt, "model": "scripted-model",
            "provider": {"type": "openai", "base_url": model, "api_key": "k"}}
    req = urllib.request.Request(f"http://{addr}/v1/turns?stream=false", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)
for i in range(3):
    for agent in ("agent-a", "agent-b"):
        out = turn(agent, f"conv-{i % 2}", f"REPLY=turn {i}")
        assert out["status"] == "idle", out
print("workload done")
PY

"${venv}/bin/python" - "${prom_port}" <<'PY'
import json, re, sys, time, urllib.parse, urllib.request, yaml
port = sys.argv[1]
def query(expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)
# Wait until two scrapes after the workload have landed (rates need two samples).
deadline = time.time() + 60
while time.time() < deadline:
    r = query('count_over_time(copilot_pool_conversations_attached[1m])')
    if r.get("status") == "success" and r["data"]["result"] and float(r["data"]["result"][0]["value"][1]) >= 3:
        break
    time.sleep(0.5)
else:
    sys.exit("error: Prometheus never scraped copilot-pool serve")
failures = []
dashboard = json.load(open("dashboards/copilot-pool.json"))
def panels(items):
    for p in items:
        yield p
        yield from panels(p.get("panels", []))
# The dashboard's variables (namespace, job, instance, backend) at All: `.*`.
variables = {v["name"] for v in dashboard.get("templating", {}).get("list", []) if v.get("type") in ("query", "custom")}
def at_all(expr):
    return re.sub(r"\$\{?(\w+)\}?", lambda m: ".*" if m.group(1) in variables else m.group(0), expr)
n = 0
for v in dashboard.get("templating", {}).get("list", []):
    q = v.get("query")
    q = q.get("query", "") if isinstance(q, dict) else (q or "")
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
    if v.get("type") != "query" or not m:
        continue
    n += 1
    r = query(at_all(m.group(1)))
    if r.get("status") != "success":
        failures.append(f"variable {v['name']!r}: invalid: {m.group(1)}: {r.get('error')}")
    elif not r["data"]["result"]:
        failures.append(f"variable {v['name']!r}: no series: {m.group(1)}")
for panel in panels(dashboard.get("panels", [])):
    for target in panel.get("targets", []):
        expr = target.get("expr")
        if not expr:
            continue
        n += 1
        expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "5m")
        expr = at_all(expr)
        r = query(expr)
        if r.get("status") != "success":
            failures.append(f"panel {panel.get('title')!r}: invalid: {expr}: {r.get('error')}")
            continue
        # The zero fallback keeps panels drawn before any event; the check runs the query
        # without it, so a wrong metric or label value cannot hide behind the fallback.
        bare = re.sub(r"\s+or\s+(on\s*\(\s*\)\s*)?vector\(0\)\s*$", "", expr)
        r = query(bare)
        if r.get("status") != "success":
            failures.append(f"panel {panel.get('title')!r}: invalid: {bare}: {r.get('error')}")
        elif not r["data"]["result"]:
            failures.append(f"panel {panel.get('title')!r}: no series: {bare}")
rules = yaml.safe_load(open("deploy/prometheus/alerts.yml"))
for group in rules.get("groups", []):
    for rule in group.get("rules", []):
        n += 1
        r = query(rule["expr"])
        if r.get("status") != "success":
            failures.append(f"alert {rule.get('alert')!r}: invalid: {rule['expr']}: {r.get('error')}")
print(f"{n} expressions checked against Prometheus")
if failures:
    print("\n".join(failures))
    sys.exit(1)
PY
echo "prometheus check: ok"
