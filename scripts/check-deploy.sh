#!/usr/bin/env bash
# Checks the deployment artefacts: the kustomize base and example overlay (rendered with
# `kubectl kustomize`, validated with `kubernetes-validate --strict`; only the Prometheus
# Operator kinds PodMonitor/PrometheusRule may warn, having no schema; the grace period covers
# the daemon's shutdown, the NetworkPolicy keeps HTTPS egress off private ranges), the alert
# rules (`promtool check rules`, `promtool test rules`), that the PrometheusRule carries exactly
# the rules of deploy/prometheus/alerts.yml, and the Grafana dashboard (lint, every selector
# scoped by the namespace/job/instance variables, every query parsed by promtool).
#
#   bash scripts/check-deploy.sh                 # run every check (from anywhere)
#   bash scripts/check-deploy.sh --update-rules  # regenerate the PrometheusRule from alerts.yml
#
# Tools: kubectl (must be installed), promtool ($PROMTOOL, else scripts/install-promtool.sh),
# kubernetes-validate and PyYAML (pinned below; installed with pip into target/tools/venv when
# missing or of another version).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$(pwd)"

alerts=deploy/prometheus/alerts.yml
alerts_test=deploy/prometheus/alerts.test.yml
rule_cr=deploy/kubernetes/base/prometheusrule.yaml
base=deploy/kubernetes/base
overlay=deploy/kubernetes/overlays/example
dashboard=dashboards/copilot-pool.json
metrics_rs=src/metrics.rs
venv="${repo}/target/tools/venv"
# Pinned (the versions these checks passed with), installed into ${venv} when it has others.
KUBERNETES_VALIDATE_VERSION="1.37.0"
PYYAML_VERSION="6.0.4"

step() { printf '\n==> %s\n' "$*"; }
fail() {
    echo "error: $*" >&2
    exit 1
}

# The PrometheusRule is alerts.yml's groups under `spec:`, comments and all.
render_rule_cr() {
    cat <<'EOF'
# GENERATED from deploy/prometheus/alerts.yml by `scripts/check-deploy.sh --update-rules`:
# edit that file, not this one (scripts/check-deploy.sh fails when they differ).
# Add the label your Prometheus' ruleSelector expects (e.g. release: ...).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: copilot-pool
spec:
EOF
    sed -n '/^groups:/,$p' "${alerts}" | sed 's/^\(.\)/  \1/'
}

case "${1:-}" in
    --update-rules)
        render_rule_cr >"${rule_cr}.tmp"
        mv -f "${rule_cr}.tmp" "${rule_cr}"
        echo "wrote ${rule_cr}"
        exit 0
        ;;
    "") ;;
    *) fail "unknown argument '$1' (use --update-rules or nothing)" ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

step "tools"
command -v kubectl >/dev/null 2>&1 ||
    fail "kubectl is not on PATH; install it (https://kubernetes.io/docs/tasks/tools/) - it renders the kustomizations"
command -v python3 >/dev/null 2>&1 || fail "python3 is not on PATH"
kubectl version --client 2>/dev/null | head -n 2
PROMTOOL="${PROMTOOL:-$(bash scripts/install-promtool.sh)}"
"${PROMTOOL}" --version 2>&1 | head -n 1
pinned=("kubernetes-validate==${KUBERNETES_VALIDATE_VERSION}" "pyyaml==${PYYAML_VERSION}")
if ! "${venv}/bin/python" -c 'import sys, yaml, kubernetes_validate
from importlib.metadata import version
sys.exit(version("kubernetes-validate") != sys.argv[1] or version("pyyaml") != sys.argv[2])' \
    "${KUBERNETES_VALIDATE_VERSION}" "${PYYAML_VERSION}" >/dev/null 2>&1; then
    echo "installing ${pinned[*]} into ${venv}"
    python3 -m venv "${venv}"
    timeout 300 "${venv}/bin/python" -m pip install --quiet --disable-pip-version-check \
        "${pinned[@]}" ||
        fail "pip install ${pinned[*]} into ${venv} failed or took over 5 minutes (exit $?):" \
            "check access to PyPI, then run this again"
fi
py="${venv}/bin/python"
echo "kubernetes-validate $("${venv}/bin/kubernetes-validate" --version)"

step "kubectl kustomize | kubernetes-validate --strict"
for dir in "${base}" "${overlay}"; do
    name="$(basename "${dir}")"
    kubectl kustomize "${dir}" >"${work}/${name}.yaml" || fail "kubectl kustomize ${dir} failed"
    rc=0
    "${venv}/bin/kubernetes-validate" --strict - <"${work}/${name}.yaml" >"${work}/${name}.validate" 2>&1 || rc=$?
    cat "${work}/${name}.validate"
    [[ ${rc} -eq 0 ]] || fail "kubernetes-validate rejected ${dir} (exit ${rc})"
    if grep -v -E '^INFO ' "${work}/${name}.validate" |
        grep -v -E "^WARN .*Couldn't find schema for kind (PodMonitor|PrometheusRule) with api version monitoring\.coreos\.com/" |
        grep -q .; then
        fail "kubernetes-validate reported more than the monitoring CRDs' missing schemas for ${dir}"
    fi
    grep -q -E '^INFO .*statefulset/copilot-pool' "${work}/${name}.validate" ||
        fail "${dir}: the StatefulSet was not validated"
done

step "promtool check rules ${alerts}"
"${PROMTOOL}" check rules "${alerts}"

step "promtool test rules ${alerts_test}"
"${PROMTOOL}" test rules "${alerts_test}"

step "PrometheusRule == ${alerts}"
if ! render_rule_cr | diff -u "${rule_cr}" - >"${work}/rule.diff"; then
    cat "${work}/rule.diff"
    fail "${rule_cr} is stale: run scripts/check-deploy.sh --update-rules"
fi
echo "${rule_cr} is up to date"

step "consistency of manifests, rules, tests and dashboard"
"${py}" - "${work}" "${alerts}" "${alerts_test}" "${dashboard}" "${metrics_rs}" <<'PY'
import ipaddress
import json
import re
import sys
import tomllib

import yaml

work, alerts_path, tests_path, dashboard_path, metrics_rs = sys.argv[1:]
errors = []


def err(msg):
    errors.append(msg)
    print(f"  FAIL {msg}")


def ok(msg):
    print(f"  ok   {msg}")


# --- metric names -----------------------------------------------------------------------------
metrics_src = open(metrics_rs).read()
consts = dict(re.findall(r'pub const (\w+): &str = "(copilot_pool_\w+)";', metrics_src))
names = set(consts.values())
hist_block = re.search(r"pub const HISTOGRAMS: &\[&str\] = &\[(.*?)\];", metrics_src, re.S)
histograms = {consts[c] for c in re.findall(r"\b([A-Z_]+)\b", hist_block.group(1)) if c in consts}
if len(names) < 10 or not histograms:
    err(f"could not read the metric names from {metrics_rs}")


def unknown_metrics(expr):
    bad = []
    for token in set(re.findall(r"\bcopilot_pool_[a-z0-9_]+", expr)):
        base = token
        for suffix in ("_bucket", "_sum", "_count"):
            if token.endswith(suffix) and token[: -len(suffix)] in histograms:
                base = token[: -len(suffix)]
        if base not in names:
            bad.append(token)
    return sorted(bad)


# --- rendered manifests -----------------------------------------------------------------------
def load(name):
    return [d for d in yaml.safe_load_all(open(f"{work}/{name}.yaml")) if d]


def quantity(q):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    return float(m.group(1)) * units.get(m.group(2), 1)


def threshold(expr):
    m = re.search(r">\s*([0-9.]+)\s*\*\s*1024\s*\^\s*3\s*$", expr)
    if m:
        return float(m.group(1)) * 2**30
    m = re.search(r">\s*([0-9.e+]+)\s*$", expr)
    return float(m.group(1)) if m else None


plain = yaml.safe_load(open(alerts_path))
plain_rules = [r for g in plain["groups"] for r in g["rules"]]
MEMORY = "CopilotPoolMemoryNearLimit"

for name in ("base", "example"):
    docs = load(name)
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    for kind in ("StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "PodMonitor", "PrometheusRule"):
        if kind not in by_kind:
            err(f"{name}: no {kind}")
    if len(by_kind.get("Service", [])) != 2:
        err(f"{name}: expected a headless and a regular Service")
    sts = by_kind["StatefulSet"][0]
    pod = sts["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    # The pool config and the grace period. After the drain (drain_grace_secs) the daemon
    # takes up to ~30 s more: 5 s for aborted turns, 9 s to stop the workers (detach 2 s +
    # kill grace 5 s + 2 s margin, in parallel), up to 5 s each for the API's turns, the SDK
    # endpoint's turns and the servers (src/pool/mod.rs Pool::shutdown, serve's shutdown).
    # Below drain + 30 a slow stop is SIGKILLed mid-teardown, leaving runtimes' tools behind.
    TEARDOWN = 30
    cm = by_kind["ConfigMap"][0]
    serve = tomllib.loads(cm["data"]["serve.toml"])
    drain = serve.get("drain_grace_secs", 30)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if not grace >= drain + TEARDOWN:
        err(f"{name}: terminationGracePeriodSeconds {grace} must be at least drain_grace_secs "
            f"{drain} + {TEARDOWN} (the shutdown after the drain)")
    else:
        ok(f"{name}: terminationGracePeriodSeconds {grace} >= drain_grace_secs {drain} + {TEARDOWN}")
    if serve.get("listen") != "0.0.0.0:7878":
        err(f"{name}: serve.toml listen is {serve.get('listen')!r}, expected 0.0.0.0:7878")
    # The API token reaches the daemon as a 0600 file (an init container copies it out of the
    # Secret into a memory volume), never as an environment variable (/proc/<pid>/environ).
    envs = {e["name"]: e for e in ctr.get("env", [])}
    if "COPILOT_POOL_API_TOKEN" in envs:
        err(f"{name}: the API token is in the environment; pass it with --api-token-file")
    args = ctr.get("args", [])
    token_file = args[args.index("--api-token-file") + 1] if "--api-token-file" in args[:-1] else None
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    secret_vols = [n for n, v in vols.items()
                   if v.get("secret", {}).get("secretName", "").startswith("copilot-pool-api-token")]
    inits = pod.get("initContainers", [])
    copier = next((c for c in inits if c.get("command", [])[:3] == ["install", "-m", "0600"]), None)
    if token_file is None or copier is None or not secret_vols:
        err(f"{name}: the API token must come from secret copilot-pool-api-token through an init "
            f"container (install -m 0600) and --api-token-file")
    elif copier["command"][-1] != token_file:
        err(f"{name}: the init container writes {copier['command'][-1]}, serve reads {token_file}")
    else:
        ok(f"{name}: API token from secret copilot-pool-api-token as a 0600 file ({token_file})")
    sc, psc = ctr.get("securityContext", {}), pod.get("securityContext", {})
    checks = {
        "runAsNonRoot": psc.get("runAsNonRoot") is True,
        "runAsUser 10001": psc.get("runAsUser") == 10001,
        "fsGroup 10001": psc.get("fsGroup") == 10001,
        "readOnlyRootFilesystem": sc.get("readOnlyRootFilesystem") is True,
        "allowPrivilegeEscalation false": sc.get("allowPrivilegeEscalation") is False,
        "drop ALL": sc.get("capabilities", {}).get("drop") == ["ALL"],
        "seccomp RuntimeDefault": psc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
        "liveness /healthz": ctr.get("livenessProbe", {}).get("httpGet", {}).get("path") == "/healthz",
        "readiness /readyz": ctr.get("readinessProbe", {}).get("httpGet", {}).get("path") == "/readyz",
        "startupProbe": "startupProbe" in ctr,
        "port http 7878": {"name": "http", "containerPort": 7878, "protocol": "TCP"} in ctr.get("ports", []),
        "volume for /var/lib/copilot-pool": any(
            m["mountPath"] == "/var/lib/copilot-pool"
            and m["name"] in [v["metadata"]["name"] for v in sts["spec"].get("volumeClaimTemplates", [])]
            for m in ctr.get("volumeMounts", [])
        ),
        "/tmp writable": any(m["mountPath"] == "/tmp" for m in ctr.get("volumeMounts", [])),
        "config at /etc/copilot-pool": any(m["mountPath"] == "/etc/copilot-pool" for m in ctr.get("volumeMounts", [])),
    }
    bad = [k for k, v in checks.items() if not v]
    if bad:
        err(f"{name}: StatefulSet lacks {', '.join(bad)}")
    else:
        ok(f"{name}: StatefulSet security context, probes, ports and volumes")
    # The PrometheusRule equals alerts.yml (the overlay may change the memory threshold only).
    cr_rules = [r for g in by_kind["PrometheusRule"][0]["spec"]["groups"] for r in g["rules"]]
    cr_groups = [{k: v for k, v in g.items() if k != "rules"} for g in by_kind["PrometheusRule"][0]["spec"]["groups"]]
    if cr_groups != [{k: v for k, v in g.items() if k != "rules"} for g in plain["groups"]]:
        err(f"{name}: PrometheusRule groups differ from {alerts_path}")
    if len(cr_rules) != len(plain_rules):
        err(f"{name}: PrometheusRule has {len(cr_rules)} rules, {alerts_path} {len(plain_rules)}")
    same = len(cr_rules) == len(plain_rules)
    for a, b in zip(cr_rules, plain_rules):
        if name != "base" and a.get("alert") == MEMORY == b.get("alert"):
            a = {k: v for k, v in a.items() if k != "expr"}
            b = {k: v for k, v in b.items() if k != "expr"}
        if a != b:
            same = False
            err(f"{name}: PrometheusRule rule {a.get('alert')} differs from {alerts_path}")
    if same:
        ok(f"{name}: PrometheusRule rules equal {alerts_path}" + ("" if name == "base" else f" (but {MEMORY}'s threshold)"))
    # The memory alert's threshold against the container's memory limit.
    mem = [r for r in cr_rules if r.get("alert") == MEMORY]
    limit = ctr.get("resources", {}).get("limits", {}).get("memory")
    if not mem or not limit:
        err(f"{name}: no {MEMORY} rule or no memory limit")
    else:
        t = threshold(mem[0]["expr"])
        ratio = t / quantity(limit) if t else 0
        if not 0.75 <= ratio <= 0.9:
            err(f"{name}: {MEMORY} threshold {t} is {ratio:.2f} of the memory limit {limit} (want 0.75-0.9)")
        else:
            ok(f"{name}: {MEMORY} threshold is {ratio:.2f} of the memory limit {limit}")
    pm = by_kind["PodMonitor"][0]["spec"]["podMetricsEndpoints"][0]
    if pm.get("port") != "http" or pm.get("path") != "/metrics":
        err(f"{name}: PodMonitor must scrape port http path /metrics")
    # Egress: an ipBlock that spans a private range must except it (agents' tools reach
    # whatever the pod may reach: the cluster's pods and services, the node, the metadata
    # service). A block narrowed to the provider's public ranges overlaps none of them.
    private = [ipaddress.ip_network(n) for n in (
        "10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
        "fc00::/7", "fe80::/10")]
    holes = []
    for np in by_kind.get("NetworkPolicy", []):
        # Without Egress in policyTypes the egress rules do not apply: everything is open.
        if "Egress" not in np["spec"].get("policyTypes", []):
            holes.append("policyTypes lacks Egress")
        for rule in np["spec"].get("egress", []):
            # A rule with no `to` (or an empty one) reaches every destination on its ports.
            if not rule.get("to"):
                holes.append(f"a rule without `to` reaches everything on {rule.get('ports', 'every port')}")
            for peer in rule.get("to", []):
                block = peer.get("ipBlock")
                if not block:
                    continue
                cidr = ipaddress.ip_network(block["cidr"])
                excepted = [ipaddress.ip_network(e) for e in block.get("except", [])]
                for net in private:
                    if net.version != cidr.version or not net.overlaps(cidr):
                        continue
                    if not any(net.version == e.version and net.subnet_of(e) for e in excepted):
                        holes.append(f"{cidr} lets {net} through")
    if holes:
        err(f"{name}: NetworkPolicy egress reaches private ranges: {'; '.join(holes)}")
    else:
        ok(f"{name}: NetworkPolicy egress excepts the private, CGNAT, link-local and unique-local ranges")

# --- alerts and their tests -------------------------------------------------------------------
alert_names = [r["alert"] for r in plain_rules if "alert" in r]
for r in plain_rules:
    bad = unknown_metrics(r["expr"])
    if bad:
        err(f"alert {r.get('alert')}: unknown metrics {bad}")
fires, quiet = set(), set()
for t in yaml.safe_load(open(tests_path))["tests"]:
    for a in t.get("alert_rule_test", []):
        (fires if a.get("exp_alerts") else quiet).add(a["alertname"])
for a in alert_names:
    if a not in fires:
        err(f"{tests_path}: no test where {a} fires")
    if a not in quiet:
        err(f"{tests_path}: no test where {a} does not fire")
for a in sorted((fires | quiet) - set(alert_names)):
    err(f"{tests_path}: tests an unknown alert {a}")
if set(alert_names) <= fires & quiet:
    ok(f"{len(alert_names)} alerts, each with a firing and a non-firing test")

# --- dashboard --------------------------------------------------------------------------------
DS = {"type": "prometheus", "uid": "${datasource}"}
try:
    dash = json.load(open(dashboard_path))
except ValueError as e:
    err(f"{dashboard_path} is not valid JSON: {e}")
    dash = None
if dash is not None:
    if dash.get("id") is not None:
        err("dashboard id must be null")
    if not isinstance(dash.get("uid"), str) or not dash["uid"]:
        err("dashboard uid must be set")
    if not isinstance(dash.get("schemaVersion"), int):
        err("dashboard schemaVersion must be pinned")
    variables = dash.get("templating", {}).get("list", [])
    if not any(v.get("name") == "datasource" and v.get("type") == "datasource" and v.get("query") == "prometheus" for v in variables):
        err("dashboard lacks the datasource variable `datasource` (type datasource, query prometheus)")
    # One Prometheus may scrape several installs: every selector is scoped by these target
    # label variables (multi-select with All, values from copilot_pool_processes).
    SCOPE = ("namespace", "job", "instance")
    by_name = {v.get("name"): v for v in variables}
    for label in SCOPE:
        v = by_name.get(label, {})
        query = v.get("query", {})
        query = query.get("query", "") if isinstance(query, dict) else query
        if not (v.get("type") == "query" and v.get("multi") is True and v.get("includeAll") is True
                and re.match(rf"label_values\(copilot_pool_processes\b.*,\s*{label}\)$", query)):
            err(f"dashboard lacks the variable `{label}` (query label_values(copilot_pool_processes..., {label}), multi, includeAll)")
    query_vars = {v.get("name") for v in variables if v.get("type") in ("query", "custom")}

    # Every uid anywhere but the dashboard's own must be the variable.
    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "uid" and path and v not in ("${datasource}", "$datasource"):
                    err(f"dashboard: literal uid {v!r} at {'.'.join(path)}")
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [str(i)])

    walk(dash, [])
    panels = []
    for p in dash.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))
    ids = [p.get("id") for p in panels]
    if None in ids or len(set(ids)) != len(ids):
        err(f"dashboard panel ids must be set and unique: {ids}")
    exprs = []
    for p in panels:
        if p.get("type") == "row":
            continue
        if p.get("datasource") != DS:
            err(f"panel {p.get('id')} {p.get('title')!r}: datasource must be {DS}")
        if not p.get("targets"):
            err(f"panel {p.get('id')} {p.get('title')!r}: no targets")
        for t in p.get("targets", []):
            if t.get("datasource") != DS:
                err(f"panel {p.get('id')} target {t.get('refId')}: datasource must be {DS}")
            expr = t.get("expr", "")
            bad = unknown_metrics(expr)
            if bad:
                err(f"panel {p.get('id')} target {t.get('refId')}: unknown metrics {bad}")
            windows = set(re.findall(r"\[([^\]]+)\]", expr))
            if windows - {"$__rate_interval"}:
                err(f"panel {p.get('id')} target {t.get('refId')}: use [$__rate_interval], not {sorted(windows)}")
            # A counter with labels has no series before its first event: every query needs a
            # fallback so it always returns a series.
            if not re.search(r"\bor\s+(on\s*\(\s*\)\s*)?vector\(0\)\s*$", expr):
                err(f"panel {p.get('id')} target {t.get('refId')}: end the query with `or vector(0)` (or `or on() vector(0)` after a `by`)")
            grouped = {l.strip() for g in re.findall(r"\bby\s*\(([^)]*)\)", expr) for l in g.split(",")} - {"le", ""}
            for sel in re.finditer(r"\b(copilot_pool_[a-z0-9_]+|up)\b(\{[^}]*\})?", expr):
                matchers = sel.group(2) or ""
                missing = [l for l in SCOPE if f'{l}=~"${l}"' not in matchers]
                if missing:
                    err(f"panel {p.get('id')} target {t.get('refId')}: {sel.group(1)} lacks "
                        + ", ".join(f'{l}=~"${l}"' for l in missing))
            if grouped and not re.search(r"\bor\s+on\s*\(\s*\)\s*vector\(0\)\s*$", expr):
                err(f"panel {p.get('id')} target {t.get('refId')}: a grouped query needs `or on() vector(0)` (plain `or vector(0)` adds a stray series)")
            exprs.append((p["id"], t.get("refId"), expr))
    # promtool parses every query (as a recording rule) as Prometheus gets it with every
    # variable at All: $__rate_interval -> 5m, each query variable ($job, ${job}) -> .*.
    def interpolate(e):
        e = e.replace("$__rate_interval", "5m")
        return re.sub(r"\$\{?(\w+)\}?", lambda m: ".*" if m.group(1) in query_vars else m.group(0), e)

    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{pid}_{ref}", "expr": interpolate(e)} for pid, ref, e in exprs
    ]}]}
    with open(f"{work}/dashboard-rules.yml", "w") as f:
        yaml.safe_dump(rules, f, sort_keys=False)
    ok(f"dashboard: {len(panels)} panels, {len(exprs)} queries linted")

if errors:
    print(f"{len(errors)} problem(s)")
    sys.exit(1)
PY

step "promtool parses every dashboard query"
"${PROMTOOL}" check rules "${work}/dashboard-rules.yml"

step "all deployment checks passed"
