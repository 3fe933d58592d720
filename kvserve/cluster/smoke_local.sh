#!/usr/bin/env bash
# Smoke test of kvserve/cluster/local.yaml, for real (not in CI: it needs root and sshd):
#   `ray up` a two-node cluster on this machine, deploy kvserve with `serve deploy`, send one chat
#   request with curl, `ray down`.
#
# The two "machines" are two network namespaces on this host (head 10.x.y.1 and worker 10.x.y.2,
# joined by a veth pair), each with its own sshd, PID namespace (so the config's `ray stop` only
# sees that node's processes), private /root and /tmp (so nothing touches this host's ~/.ray,
# ~/kvserve or other Ray instances' /tmp/ray). `ray up` runs from the head's network namespace
# with a home of its own (its Ray token made by `python -m kvserve.cluster.ray_auth`), as one would on a
# jump host. The config is kvserve/cluster/local.yaml with only what this host needs changed: the node
# IPs, root over SSH with a throw-away key, and instead of `make setup` on each node a link to
# this checkout's .venv (same machine: no second install). Token auth, file mounts, start commands
# and everything else come from local.yaml unchanged; `ray up` runs with RAY_UP_enable_autoscaler_v2=0
# as local.yaml says (Ray 2.60's autoscaler v2 never starts a local-provider worker). Everything
# started here is gone when the script exits (the namespaces' init processes are killed, which ends
# every process inside).
#
# Needs: root, sshd (openssh-server), rsync, iproute2, util-linux (unshare), curl, and this
# checkout's .venv (`make setup`). Debian/Ubuntu: apt-get install openssh-server rsync iproute2 curl
#
#   sudo kvserve/cluster/smoke_local.sh           # KVSERVE_SMOKE_KEEP=1 keeps the work folder (logs)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${KVSERVE_VENV:-$REPO/.venv}
PY="$VENV/bin/python"
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
MODEL_CACHE=${KVSERVE_CACHE:-$HOME/.cache/kvserve}

say() { printf '[smoke %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { say "FAILED: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, sshd)"
[ -x "$SSHD" ] || die "sshd not found: apt-get install openssh-server"
for c in rsync ip unshare ssh ssh-keygen curl; do
  command -v "$c" >/dev/null || die "$c not found (apt-get install openssh-server rsync iproute2 util-linux curl)"
done
[ -x "$PY" ] || die "no $PY: run \`make setup\` first"
BASE_PREFIX=$("$PY" -c 'import sys; print(sys.base_prefix)')

TAG="kvs$$"
NET="10.213.$(( $$ % 250 + 1 ))"
HEAD_IP="$NET.1"
WORKER_IP="$NET.2"
WORK=$(mktemp -d /var/tmp/kvserve-smoke.XXXXXX)
chmod 700 "$WORK"
NODE_PIDS=()

cleanup() {
  local rc=$?
  set +e
  say "cleanup: stopping both nodes (every process in their namespaces) and removing the network"
  # unshare --fork ignores SIGTERM; SIGKILL makes it (--kill-child) kill the namespace's init, which ends
  # every process in that PID namespace
  for pid in "${NODE_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  for pid in "${NODE_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  ip netns del "${TAG}h" 2>/dev/null
  ip netns del "${TAG}w" 2>/dev/null
  if [ "${KVSERVE_SMOKE_KEEP:-0}" = 1 ]; then say "logs kept in $WORK"; else rm -rf "$WORK"; fi
  [ "$rc" -eq 0 ] && say "PASSED" || say "exit status $rc"
}
trap cleanup EXIT

say "network: head $HEAD_IP (netns ${TAG}h), worker $WORKER_IP (netns ${TAG}w)"
ip netns add "${TAG}h"
ip netns add "${TAG}w"
ip link add "${TAG}a" type veth peer name "${TAG}b"
ip link set "${TAG}a" netns "${TAG}h"
ip link set "${TAG}b" netns "${TAG}w"
for side in "h a $HEAD_IP" "w b $WORKER_IP"; do
  set -- $side
  ip -n "${TAG}$1" addr add "$3/24" dev "${TAG}$2"
  ip -n "${TAG}$1" link set "${TAG}$2" up
  ip -n "${TAG}$1" link set lo up
  ip -n "${TAG}$1" route add default dev "${TAG}$2"   # Ray finds its node IP through the default route
done

say "ssh: a throw-away key; one sshd per node (root, key only)"
ssh-keygen -q -t ed25519 -N '' -C kvserve-smoke -f "$WORK/id_ed25519"
cp "$WORK/id_ed25519.pub" "$WORK/authorized_keys"
ssh-keygen -q -t ed25519 -N '' -f "$WORK/host_key"
mkdir -p /run/sshd
start_node() {  # name ip
  local name=$1 ip=$2
  mkdir -p "$WORK/$name-home/.cache"
  cat > "$WORK/sshd-$name.conf" <<EOF
ListenAddress $ip
HostKey $WORK/host_key
AuthorizedKeysFile $WORK/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
Subsystem sftp internal-sftp
EOF
  # The node's /root is private, but host paths under /root it needs stay visible at the same place:
  # the venv's base interpreter (e.g. pyenv's) and the converted default model (no second conversion).
  local binds="" p rel
  for p in "$BASE_PREFIX" "$MODEL_CACHE"; do
    case "$p" in
      /root/*) [ -d "$p" ] || continue
               rel=${p#/root/}
               mkdir -p "$WORK/$name-home/$rel"
               binds+="mount --bind '$p' '$WORK/$name-home/$rel' && " ;;
    esac
  done
  ip netns exec "${TAG}${name:0:1}" unshare --pid --fork --kill-child --mount-proc --propagation private \
    bash -c "mount -t tmpfs -o mode=1777 tmpfs /tmp && $binds mount --rbind '$WORK/$name-home' /root \
             && '$SSHD' -D -e -f '$WORK/sshd-$name.conf' & wait" > "$WORK/sshd-$name.log" 2>&1 &
  NODE_PIDS+=($!)
}
start_node head "$HEAD_IP"
start_node worker "$WORKER_IP"

in_launcher() {  # run "$@" where `ray up` runs: the head's network namespace, a private /tmp, a home of its own
  ip netns exec "${TAG}h" env HOME="$WORK/launcher" RAY_USAGE_STATS_ENABLED=0 RAY_UP_enable_autoscaler_v2="${RAY_UP_enable_autoscaler_v2:-0}" PATH="$VENV/bin:$PATH" "$@"
}
mkdir -p "$WORK/launcher"
for ip in "$HEAD_IP" "$WORKER_IP"; do
  for _ in $(seq 50); do
    in_launcher ssh -q -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
      -i "$WORK/id_ed25519" "root@$ip" true 2>/dev/null && break
    sleep 0.2
  done || true
  in_launcher ssh -q -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
    -i "$WORK/id_ed25519" "root@$ip" true || die "sshd on $ip does not answer (see $WORK/sshd-*.log)"
done

say "the cluster's Ray token, made on the launcher: python -m kvserve.cluster.ray_auth"
(cd "$REPO" && in_launcher "$PY" -m kvserve.cluster.ray_auth)

say "cluster config: kvserve/cluster/local.yaml with this host's IPs, key and .venv"
(cd "$REPO" && "$PY" - "$WORK" "$TAG" "$HEAD_IP" "$WORKER_IP" "$VENV" <<'EOF'
import sys, yaml
from kvserve.cluster.launcher_config import check_cluster_config
work, tag, head_ip, worker_ip, venv = sys.argv[1:]
c = yaml.safe_load(open("kvserve/cluster/local.yaml"))
c["cluster_name"] = f"kvserve-smoke-{tag}"
c["provider"].update(head_ip=head_ip, worker_ips=[worker_ip])
c["auth"] = {"ssh_user": "root", "ssh_private_key": f"{work}/id_ed25519"}
install = [i for i, cmd in enumerate(c["setup_commands"]) if "make setup" in cmd]
assert len(install) == 1, "local.yaml's `make setup` step not found"
c["setup_commands"][install[0]] = f"ln -sfn {venv} ~/kvserve/.venv"  # same machine: this checkout's venv
check_cluster_config(c)
yaml.safe_dump(c, open(f"{work}/cluster.yaml", "w"), sort_keys=False)
EOF
)
CFG="$WORK/cluster.yaml"

# Everything from here runs in one launcher shell: `ray up` keeps the local provider's cluster
# state in its /tmp/ray, which `ray down` needs.
cat > "$WORK/launch.sh" <<EOF
set -euo pipefail
mount -t tmpfs -o mode=1777 tmpfs /tmp
cd '$REPO'
say() { printf '[smoke %s] %s\n' "\$(date +%H:%M:%S)" "\$*"; }
down() {
  say "ray down"
  ray down -y '$CFG' 2>&1 | tail -n 5 || true
  say "ray stop on the worker (ray down of the local provider stops Ray on the head only; docs/deployment.md)"
  ssh -q -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -i '$WORK/id_ed25519' \
    root@$WORKER_IP '~/kvserve/.venv/bin/ray stop' 2>&1 | tail -n 2 || true
}
trap down EXIT
say "ray up (head: setup + ray start; its autoscaler then starts the worker over ssh)"
ray up -y --no-config-cache '$CFG' > '$WORK/ray-up.log' 2>&1 || { tail -n 40 '$WORK/ray-up.log'; exit 1; }
tail -n 12 '$WORK/ray-up.log'
say "waiting for the worker to join"
for i in \$(seq 90); do
  n=\$(ray exec '$CFG' "python -c 'import ray; ray.init(address=\"auto\", logging_level=\"ERROR\"); print(\"ALIVE\", sum(x[\"Alive\"] for x in ray.nodes()))'" 2>/dev/null | awk '/^ALIVE/ {print \$2}' | tail -n 1)
  [ "\${n:-0}" -ge 2 ] && break
  sleep 5
done
[ "\${n:-0}" -ge 2 ] || { say "the worker never joined"; ray exec '$CFG' 'tail -n 30 /tmp/ray/session_latest/logs/monitor.log' || true; exit 1; }
ray exec '$CFG' 'ray status' 2>/dev/null | sed -n '/Node status/,/Demands/p'
say "token auth on the head (its environment for ray exec, the token file's mode):"
ray exec '$CFG' 'echo RAY_AUTH_MODE=\$RAY_AUTH_MODE; stat -c "%a %n" ~/.ray/auth_token' 2>/dev/null | grep -v '^Shared connection'
say "serve deploy kvserve/deployments/serve_config.yaml (on the head)"
ray exec '$CFG' 'cd ~/kvserve && serve deploy kvserve/deployments/serve_config.yaml' 2>&1 | tail -n 3
say "waiting for the app (the replica loads SmolLM2 on the worker)"
for i in \$(seq 120); do
  curl -sf http://127.0.0.1:8000/v1/models >/dev/null 2>&1 && break
  sleep 3
done
curl -sf http://127.0.0.1:8000/v1/models || { ray exec '$CFG' 'serve status' || true; exit 1; }
echo
say "one chat request through the head's Serve proxy"
curl -sS --max-time 120 http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}' \
  | tee '$WORK/chat.json'
echo
"$PY" -c "import json,sys; r=json.load(open('$WORK/chat.json')); print('reply:', repr(r['choices'][0]['message']['content']), '| usage:', r['usage'])"
ray exec '$CFG' 'serve status' 2>/dev/null | grep -E 'status|LLMServer|OpenAIIngress' | head -n 8 || true
say "where it runs: the head has no CPUs (--num-cpus=0), so the ingress and the replica use the worker's"
ray exec '$CFG' 'ray status' 2>/dev/null | sed -n '/Total Usage/,/memory/p'
EOF
in_launcher unshare --mount --propagation private bash "$WORK/launch.sh"

ray_left() {  # Ray processes (raylet, GCS, workers) still running in the PID namespace of node $1
  local init ns n=0 p
  init=$(ps -o pid= --ppid "$1" | head -n 1 | tr -d ' ')
  ns=$(readlink "/proc/$init/ns/pid")
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/pid" 2>/dev/null)" = "$ns" ] || continue
    tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -qE 'raylet|gcs_server|ray::|default_worker' && n=$((n + 1))
  done
  echo "$n"
}
left_head=$(ray_left "${NODE_PIDS[0]}")
left_worker=$(ray_left "${NODE_PIDS[1]}")
say "Ray processes left after the teardown: head $left_head, worker $left_worker"
[ "$left_head" -eq 0 ] && [ "$left_worker" -eq 0 ] || die "Ray still runs after the teardown"
