#!/usr/bin/env python3
"""Prints the dependencies between the crate's top-level modules (from `crate::x` paths in
code, comments and tests left out) and exits 1 if any of them form a cycle."""
import collections
import os
import re
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def code(text):
    text = text.split("#[cfg(test)]")[0]
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def main():
    modules = {}
    for entry in os.listdir(SRC):
        if entry in ("lib.rs", "bin"):
            continue
        path = os.path.join(SRC, entry)
        name = entry[:-3] if entry.endswith(".rs") else entry
        files = [path] if os.path.isfile(path) else [
            os.path.join(root, f) for root, _, fs in os.walk(path) for f in fs if f.endswith(".rs")
        ]
        modules[name] = files
    deps = collections.defaultdict(set)
    for name, files in modules.items():
        for f in files:
            with open(f, encoding="utf-8") as fh:
                for dep in re.findall(r"crate::([a-z_]+)", code(fh.read())):
                    if dep != name and dep in modules:
                        deps[name].add(dep)
    for name in sorted(modules):
        print(f"{name} -> {', '.join(sorted(deps[name])) or '-'}")
    # Tarjan's strongly connected components.
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in deps[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    if found:
        print("cycles between top-level modules:", found, file=sys.stderr)
        return 1
    print("no cycle between top-level modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
