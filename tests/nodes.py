"""Simulated nodes on one machine: one torchrun agent per node, each with its own disk at the same path.

A multi-node torchrun job whose nodes each write their own local disk at one path is simulated with one mount
namespace per node: inside node k's namespace, `node_dirs[k]` is bound at `mount_at` (on the host `mount_at` stays
an empty folder). Agents meet with static rendezvous on 127.0.0.1, so global rank = node * nproc + local rank.

    result = run_nodes("nodes_smoke.py", "see", mount_at, reports, mount_at=mount_at, node_dirs=[d0, d1],
                       setup={1: tmpfs_disk(64 * 1024)}, kill=Kill(node=1, when_file="started-1"))
    result.nodes[0].returncode, result.nodes[0].stderr, result.kill_to_exit

Each node also gets its own PID namespace: torchrun starts every worker in a session of its own, so killing the
agent's process group would leave the workers running; killing a PID namespace's first process (the agent) makes
the kernel kill everything in it. The host's /proc stays mounted, so a worker's `os.readlink("/proc/self")` is its
host pid.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

RANK_SCRIPTS = Path(__file__).parent / "ranks"
SETUP_FAILED = 97  # the node's shell exits with it when a mount command fails, before torchrun starts
PORT_RACE = ("TCPStore", "EADDRINUSE")  # both in node 0's stderr: its agent could not listen on the master port
TAIL = 3000


@dataclass(frozen=True)
class NodeSetup:
    """Shell commands run in a node's namespace before torchrun, with `$MOUNT_AT` and `$NODE_DIR` set.

    `replaces_bind`: the commands mount something of their own at `$MOUNT_AT` instead of the bind of `$NODE_DIR`.
    """
    commands: tuple[str, ...]
    replaces_bind: bool = False


def node_disks(tmp_path: Path, nodes: int = 2) -> tuple[Path, list[Path], Path]:
    """`(mount_at, node_dirs, reports)`: the path every node writes (empty on the host), each node's own disk, and
    a host folder for the ranks' reports."""
    mount_at, reports = tmp_path / "disk", tmp_path / "reports"
    node_dirs = [tmp_path / f"node{k}" for k in range(nodes)]
    for folder in (mount_at, reports, *node_dirs):
        folder.mkdir()
    return mount_at, node_dirs, reports


def tmpfs_disk(size_bytes: int) -> NodeSetup:
    """A full disk: a tmpfs of `size_bytes` (rounded up to pages) at `mount_at`; its files vanish with the node."""
    return NodeSetup((f'mount -t tmpfs -o size={int(size_bytes)} node-disk "$MOUNT_AT"',), replaces_bind=True)


def read_only() -> NodeSetup:
    """The node's disk mounted read-only: writes fail with EROFS, even for root."""
    return NodeSetup(('mount -o remount,bind,ro "$MOUNT_AT"',))


@dataclass(frozen=True)
class Kill:
    """SIGKILL node `node` (agent and workers) once `when_file` exists in its `mount_at` (as that node sees it) or
    `after` seconds from launch, whichever comes first."""
    node: int
    when_file: str | None = None
    after: float | None = None


@dataclass
class NodeRun:
    returncode: int | None  # -9 for a node killed by `kill`
    stdout: str
    stderr: str
    seconds: float  # from launch to exit


@dataclass
class NodesResult:
    nodes: list[NodeRun]
    port: int
    attempts: int  # 2 when the first master port was taken before node 0's agent could listen on it
    killed_at: float | None = None  # seconds from launch to the kill; None when the condition never held
    kill_to_exit: float | None = None  # seconds from the kill to the last node's exit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require_namespaces() -> None:
    """Fail (never skip): CI runs as root, and a harness that silently skips would hide every node test."""
    if os.geteuid() != 0:
        pytest.fail("run_nodes needs root: it mounts a disk per node in mount namespaces (CI runs as root)")
    if shutil.which("unshare") is None:
        pytest.fail("run_nodes needs util-linux's `unshare` on PATH to give each node its own mount namespace")
    probe = subprocess.run(["unshare", "--mount", "--pid", "--fork", "true"], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0:
        pytest.fail(f"`unshare --mount --pid` does not work here (no CAP_SYS_ADMIN?): {probe.stderr.strip()}")


def _dying_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` run so that the node dies too if the test process dies (even by SIGKILL): util-linux's `setpriv
    --pdeathsig` execs it. Not a `preexec_fn`: Python code between fork and exec in a process with threads can crash
    the child."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else cmd


def _node_shell(setup: Sequence[NodeSetup]) -> str:
    """The script each namespace runs: mount the node's disk, the setup commands, then exec torchrun ($@). A failed
    command exits SETUP_FAILED at once: the other nodes' agents would wait for this one until the timeout."""
    commands = [] if any(s.replaces_bind for s in setup) else ['mount --bind "$NODE_DIR" "$MOUNT_AT"']
    commands += [c for s in setup for c in s.commands]
    guarded = [f"{{ {c} ; }} || {{ echo {shlex.quote('node setup failed: ' + c)} >&2; exit {SETUP_FAILED}; }}"
               for c in commands]
    return "\n".join(['MOUNT_AT=$1 NODE_DIR=$2', 'shift 2', *guarded, 'exec "$@"'])


def _as_setups(value) -> list[NodeSetup]:
    items = [value] if isinstance(value, (NodeSetup, str)) else list(value or [])
    return [NodeSetup((item,)) if isinstance(item, str) else item for item in items]


class _Launch:
    """One attempt: the node processes, their output files, and the kill."""

    def __init__(self, cmds: list[list[str]], env: dict, kill: Kill | None, mount_at: Path):
        self.kill, self.mount_at = kill, mount_at
        self.outs = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in cmds]
        self.start = time.monotonic()
        self.procs: list[subprocess.Popen] = []
        try:
            for cmd, (out, err) in zip(cmds, self.outs):
                self.procs.append(subprocess.Popen(_dying_with_parent(cmd), stdout=out, stderr=err, env=env,
                                                   start_new_session=True))
        except BaseException:
            self.kill_all()
            raise
        self.exits: dict[int, float] = {}
        self.killed_at: float | None = None

    def text(self, k: int, which: int) -> str:
        f = self.outs[k][which]
        f.flush()
        f.seek(0)
        return f.read().decode(errors="replace")

    def kill_due(self) -> bool:
        if self.kill is None or self.killed_at is not None or self.kill.node in self.exits:
            return False
        if self.kill.after is not None and time.monotonic() - self.start >= self.kill.after:
            return True
        # /proc/PID/root walks PID's mount namespace: the node's own disk, whatever is mounted there
        pid = self.procs[self.kill.node].pid
        return self.kill.when_file is not None and os.path.exists(
            f"/proc/{pid}/root{self.mount_at}/{self.kill.when_file}")

    def poll(self) -> None:
        if self.kill_due():
            os.killpg(self.procs[self.kill.node].pid, signal.SIGKILL)
            self.killed_at = time.monotonic()
        for k, proc in enumerate(self.procs):
            if k not in self.exits and proc.poll() is not None:
                self.exits[k] = time.monotonic()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()

    def report(self) -> str:
        return "\n".join(f"--- node {k} (exit {p.returncode}) stdout:\n{self.text(k, 0)[-TAIL:]}\n"
                         f"--- node {k} stderr:\n{self.text(k, 1)[-TAIL:]}" for k, p in enumerate(self.procs))

    def close(self) -> None:
        for out, err in self.outs:
            out.close()
            err.close()


def _torchrun(script: str, args: Sequence, nodes: int, nproc: int, node: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={nproc}",
            f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", "--monitor-interval=0.5",
            str(RANK_SCRIPTS / script), *map(str, args)]


def _wait(launch: _Launch, timeout: float, what: str) -> str:
    """Poll until every node exits: 'done', or 'port race' (node 0 could not listen: the others would wait for
    it forever). Fails the test on the timeout or a node's failed setup."""
    while len(launch.exits) < len(launch.procs):
        launch.poll()
        if 0 in launch.exits and all(s in launch.text(0, 1) for s in PORT_RACE):
            return "port race"
        if any(launch.procs[k].returncode == SETUP_FAILED for k in launch.exits):
            launch.kill_all()
            pytest.fail(f"{what}: a node's setup failed\n{launch.report()}")
        if time.monotonic() - launch.start > timeout:
            launch.kill_all()
            pytest.fail(f"{what} did not finish within {timeout}s (hang?)\n{launch.report()}")
        time.sleep(0.05)
    return "done"


def run_nodes(script: str, *args, nodes: int = 2, nproc: int = 2, mount_at: Path, node_dirs: Sequence[Path],
              timeout: float = 180, env: dict | None = None, setup: dict | None = None, kill: Kill | None = None,
              port: int | None = None) -> NodesResult:
    """Run `tests/ranks/<script> args...` as a `nodes` x `nproc` torchrun job, node k seeing `node_dirs[k]` at
    `mount_at`. `setup`: {node: NodeSetup, shell command or a list of them}. `kill`: SIGKILL a node mid-run.
    `port`: the first attempt's master port (else a free one); a port taken before node 0's agent listens on it
    makes one retry on a fresh port. Any node's exit code is returned, not checked: the caller asserts on it.
    """
    _require_namespaces()
    mount_at, node_dirs = Path(mount_at).resolve(), [Path(d).resolve() for d in node_dirs]
    if not mount_at.is_dir():
        pytest.fail(f"mount_at {mount_at} must be an existing folder on the host")
    if len(node_dirs) != nodes or not all(d.is_dir() for d in node_dirs):
        pytest.fail(f"node_dirs must be {nodes} existing folders, one per node: {node_dirs}")
    setup = setup or {}
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
    what = f"{script} on {nodes} nodes x {nproc}"
    for attempt in (1, 2):
        port = port if port is not None and attempt == 1 else free_port()
        cmds = [["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
                 "bash", "-c", _node_shell(_as_setups(setup.get(k))), "node", str(mount_at), str(node_dirs[k]),
                 *_torchrun(script, args, nodes, nproc, k, port)] for k in range(nodes)]
        launch = _Launch(cmds, full_env, kill, mount_at)
        try:
            outcome = _wait(launch, timeout, what)
            if outcome == "port race" and attempt == 1:
                continue
            if outcome == "port race":
                pytest.fail(f"{what}: master port taken twice\n{launch.report()}")
            runs = [NodeRun(p.returncode, launch.text(k, 0), launch.text(k, 1), launch.exits[k] - launch.start)
                    for k, p in enumerate(launch.procs)]
            killed = launch.killed_at
            return NodesResult(runs, port, attempt, killed_at=None if killed is None else killed - launch.start,
                               kill_to_exit=None if killed is None else max(launch.exits.values()) - killed)
        finally:
            launch.kill_all()
            launch.close()
    raise AssertionError("unreachable")
