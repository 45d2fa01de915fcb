#!/usr/bin/env bash
# Brings the Rust crates this workspace builds with into .deps/registry, from Debian's packages.
#
# Why: crates.io is not reachable from this project's machines (nor from CI); Debian's archive
# is, and Debian packages each crate's source as librust-NAME-dev. We download exactly the
# versions in scripts/debian/crates.lock with apt-get (a private apt configuration under
# .deps/apt: nothing is installed on the system, no root needed beyond apt's own), unpack them,
# and .cargo/config.toml points cargo at the unpacked registry.
#
# Usage: scripts/deps.sh            fetch what crates.lock names (quick no-op when present)
#        scripts/deps.sh --update   re-resolve crates.txt into crates.lock (then rebuild the
#                                   build: cargo adds the new crates to Cargo.lock)
set -euo pipefail
cd "$(dirname "$0")/.."

suite=trixie
list=scripts/debian/crates.txt
lock=scripts/debian/crates.lock
deps=.deps
stamp=$deps/registry/.hspipe-stamp

if [ "${1:-}" != "--update" ] && [ -f "$stamp" ] && cmp -s "$stamp" "$lock"; then
    exit 0
fi
command -v apt-get >/dev/null || {
    echo "error: scripts/deps.sh needs apt-get (a Debian or Ubuntu machine) to fetch the crates" >&2
    exit 1
}

apt="$PWD/$deps/apt"
mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" >"$apt/sources.list"
: >"$apt/status"
opts=(-q -oDir::State::Lists="$apt/lists" -oDir::Etc::SourceList="$apt/sources.list"
    -oDir::Etc::SourceParts=/nonexistent -oDir::Cache="$apt/cache" -oDir::State::status="$apt/status"
    -oAPT::Install-Recommends=false -oDebug::NoLocking=1 -oAPT::Sandbox::User=root)

echo "== deps: Debian $suite package lists"
apt-get "${opts[@]}" update >"$apt/update.log" 2>&1 || {
    cat "$apt/update.log" >&2
    echo "error: could not read Debian's package lists (is deb.debian.org reachable?)" >&2
    exit 1
}

if [ "${1:-}" = "--update" ]; then
    # Resolve the wanted packages and everything they depend on, as if installing on an empty
    # system, and keep the Rust source packages with their exact versions.
    apt-get "${opts[@]}" install -s $(grep -v '^#' "$list") 2>/dev/null |
        awk '/^Inst librust-/ { v = $3; gsub(/[()]/, "", v); print $2 "=" v }' | sort >"$lock.new"
    [ -s "$lock.new" ] || { echo "error: resolving $list found nothing" >&2; exit 1; }
    mv "$lock.new" "$lock"
    echo "== deps: $(wc -l <"$lock") packages in $lock"
fi

echo "== deps: downloading $(wc -l <"$lock") crate packages"
rm -f "$apt/debs"/*.deb
(cd "$apt/debs" && apt-get "${opts[@]}" download $(cat "../../../$lock")) >"$apt/download.log" 2>&1 || {
    grep -E '^(E|W):' "$apt/download.log" >&2 || cat "$apt/download.log" >&2
    echo "error: could not download the packages in $lock; if Debian moved a version on," >&2
    echo "       run scripts/deps.sh --update, build, then commit crates.lock and Cargo.lock" >&2
    exit 1
}
rm -rf "$deps/unpack" "$deps/registry"
mkdir -p "$deps/unpack"
for f in "$apt/debs"/*.deb; do dpkg-deb -x "$f" "$deps/unpack"; done
mv "$deps/unpack/usr/share/cargo/registry" "$deps/registry"
rm -rf "$deps/unpack"
cp "$lock" "$stamp"
echo "== deps: $(ls "$deps/registry" | wc -l) crates in $deps/registry"
