#!/bin/sh
# Empty stand-ins for the crate's own targets, so deploy/Dockerfile can build the dependencies
# in a layer of their own from Cargo.toml and Cargo.lock alone: the library, the binary, and
# one `fn main() {}` per `[[bench]]` the manifest names (cargo refuses a manifest whose bench
# file is missing). Run in the directory holding Cargo.toml. scripts/check-dockerfile.sh runs
# it too and checks that cargo then reads the manifest.
set -eu
mkdir -p src/bin/copilot-pool benches
echo 'fn main() {}' > src/bin/copilot-pool/main.rs
: > src/lib.rs
awk '/^\[\[bench\]\]/ { bench = 1; next }
     bench && /^name *=/ { gsub(/[" ]/, ""); sub(/^name=/, ""); print; bench = 0 }' Cargo.toml |
    while read -r name; do
        echo 'fn main() {}' > "benches/${name}.rs"
    done
