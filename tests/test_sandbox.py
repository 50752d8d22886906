"""The jail of the executing environments: what a command can and cannot reach, and every limit."""

from __future__ import annotations

import os
import select
import socket
import time
from pathlib import Path

import pytest

from sinkflex_core.envs.bash_tasks import read_tree
from sinkflex_core.envs.sandbox import Limits, Sandbox, jail_available

JAIL_OK, JAIL_WHY = jail_available()
jailed = pytest.mark.skipif(not JAIL_OK, reason=f"no namespace jail here: {JAIL_WHY}")


@pytest.fixture(scope="module")
def box():
    b = Sandbox(Limits(wall_s=3.0, cpu_s=2, processes=32))
    yield b
    b.close()


@pytest.fixture()
def secret(tmp_path):
    """A file outside the sandbox that no command may read or change."""
    path = tmp_path / "secret.txt"
    path.write_text("the-host-secret\n")
    path.chmod(0o644)
    tmp_path.chmod(0o755)
    return path


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def _no_processes_left(box: Sandbox, bound_s: float = 10.0) -> bool:
    if box.uid is None:  # not root: the command ran as our own user; nothing to tell apart by id
        return True
    end = time.monotonic() + bound_s
    while _uid_processes(box.uid):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_refuses_to_run_unjailed_without_consent():
    with pytest.raises(RuntimeError, match="allow_unjailed=True"):
        Sandbox(jail=False)
    b = Sandbox(Limits(wall_s=5.0), jail=False, allow_unjailed=True)
    try:
        assert b.mode.startswith("unjailed")
        res = b.run("echo hi > f.txt; cat f.txt; echo $HOME")
        assert res.returncode == 0 and res.output.split() == ["hi", str(b.dir)]
        assert (b.dir / "f.txt").read_text() == "hi\n"
    finally:
        b.close()


def test_the_sandbox_folder_is_the_working_directory(box):
    box.clear()
    res = box.run("pwd; echo made > made.txt; mkdir -p a/b && echo deep > a/b/c.txt")
    assert res.returncode == 0 and res.output.strip() == ("/sandbox" if box.jailed else str(box.dir))
    assert (box.dir / "made.txt").read_text() == "made\n" and (box.dir / "a/b/c.txt").read_text() == "deep\n"


@jailed
def test_dotdot_and_absolute_paths_stay_inside(box, secret):
    box.clear()
    (box.base / "beside.txt").write_text("beside-the-sandbox\n")
    res = box.run(f"cat ../beside.txt ../../beside.txt {secret} {box.base}/beside.txt; ls / ..; "
                  f"echo pwned > ../pwned; echo pwned > {secret}; echo pwned > {secret.parent}/new.txt; "
                  "echo pwned > /pwned; echo pwned > /usr/pwned; echo pwned > /etc/passwd; cd /; cd ..; ls; true")
    assert "the-host-secret" not in res.output and "beside-the-sandbox" not in res.output
    assert secret.read_text() == "the-host-secret\n" and not (secret.parent / "new.txt").exists()
    assert not (box.base / "pwned").exists() and not Path("/usr/pwned").exists()
    assert set(res.output.split()) >= {"sandbox", "usr", "proc", "tmp"} and "work" not in res.output.split()


@jailed
def test_symlinks_pointing_outside_lead_nowhere(box, secret):
    box.clear()
    res = box.run(f"ln -s {secret} link; ln -s ../../../../../{secret} rel; ln -s / root; "
                  "cat link rel; ls root/; echo pwned > link; true")
    assert "the-host-secret" not in res.output and secret.read_text() == "the-host-secret\n"
    state = read_tree(box.dir)  # what the grader sees: the links themselves, never their targets
    assert state["link"] == ("l", str(secret)) and state["root"] == ("l", "/")
    assert not any(v[0] == "f" and "root/" in k for k, v in state.items())


@jailed
def test_proc_shows_only_the_commands_own_processes(box):
    res = box.run(f"ls /proc | grep -E '^[0-9]+$' | wc -l; cat /proc/{os.getpid()}/environ; "
                  "cat /proc/1/cmdline | tr '\\0' ' '; echo; echo x > /proc/sys/kernel/hostname; true")
    count = int(res.output.split()[0])
    assert 1 <= count <= 5, res.output
    assert "PYTEST" not in res.output and "PATH=" not in res.output
    assert socket.gethostname() != "x"


@jailed
def test_fork_bomb_stops_at_the_process_cap(box):
    before = len(_uid_processes(box.uid)) if box.uid is not None else 0
    res = box.run("bomb() { bomb | bomb & }; bomb; sleep 1; ls /proc | grep -cE '^[0-9]+$'")
    # the cap, not the wall clock, is what stops the bomb growing (the clock alone would let it fill the machine)
    assert any("process limit" in n for n in res.limits_hit), res.observation()[:500]
    numbers = [int(w) for w in res.output.split() if w.isdigit()]
    assert not numbers or numbers[-1] <= box.limits.processes + 2
    assert _no_processes_left(box) and before == 0
    # a plain burst of twice the cap in short sleepers: the forks past the cap fail, and the command counts
    # at most the cap in its own /proc
    res = box.run(f"for i in $(seq {2 * box.limits.processes}); do sleep 2 & done; ls /proc | grep -cE '^[0-9]+$'")
    assert any("process limit" in n for n in res.limits_hit), res.observation()[:500]
    numbers = [int(w) for w in res.output.split() if w.isdigit()]
    assert not numbers or numbers[-1] <= box.limits.processes + 2, res.output[-300:]
    assert _no_processes_left(box)


@jailed
def test_no_network_even_to_a_listening_local_socket(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    try:
        res = box.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)\"; "
                      f"echo hi > /dev/tcp/127.0.0.1/{port}; ip addr 2>/dev/null; cat /proc/net/dev | tail -n +3")
        readable, _, _ = select.select([server], [], [], 0.2)
        assert readable == [], "a command reached the test's socket"
        assert "unreachable" in res.output or "refused" in res.output
        assert "eth" not in res.output.split("/dev/tcp")[-1]
    finally:
        server.close()


def test_huge_output_is_cut_and_endless_output_killed(box):
    res = box.run("head -c 100000 /dev/zero | tr '\\0' a")
    assert res.returncode == 0 and res.output_cut and len(res.output) == box.limits.output_bytes
    res = box.run("yes")
    assert any("output over" in n for n in res.limits_hit) and len(res.output) <= box.limits.output_bytes
    assert "[output cut]" in res.observation()


def test_deadline_kills_the_whole_tree(box):
    box.clear()
    start = time.monotonic()
    res = box.run("(sleep 2; echo late > late.txt) & setsid sh -c 'sleep 2; echo late > late2.txt' & sleep 60",
                  wall_s=1.0)
    assert time.monotonic() - start < 30
    assert any("wall-clock limit of 1 s" in n for n in res.limits_hit)
    if box.jailed:  # the fallback cannot reach processes that left the group (setsid): documented
        assert _no_processes_left(box)
        time.sleep(2.5)
        assert not (box.dir / "late.txt").exists() and not (box.dir / "late2.txt").exists()


def test_file_size_memory_and_cpu_limits(box):
    box.clear()
    res = box.run("head -c 20M /dev/zero > big; python3 -c 'bytearray(3 << 30)'")
    assert (box.dir / "big").stat().st_size <= box.limits.file_mb << 20
    assert any("file size" in n for n in res.limits_hit) and "MemoryError" in res.output
    res = box.run("python3 -c 'while True: pass'; echo after", wall_s=30.0)  # CPU seconds, not wall: slack for busy hosts
    assert any("CPU" in n for n in res.limits_hit) and "after" in res.output


@jailed
def test_system_is_read_only_and_capabilities_dropped(box):
    res = box.run("touch /usr/x /bin/x /x; mount -t tmpfs t /tmp; umount /usr; chroot / true; "
                  "echo $(id -u) $(grep CapEff /proc/self/status)")
    assert "Read-only file system" in res.output and "CapEff: 0000000000000000" in res.output
    assert not Path("/usr/x").exists()


def test_nul_and_odd_bytes_are_handled(box):
    assert box.run("echo a\x00b").limits_hit == ["refused"]
    res = box.run("printf '\\377\\376 bad utf-8'")
    assert res.returncode == 0 and "bad utf-8" in res.output


def test_a_command_cannot_stop_the_folder_from_being_cleared(box):
    box.run("mkdir -p locked/deeper && touch locked/deeper/f && chmod 000 locked/deeper locked; chmod 555 .")
    box.clear()
    assert list(box.dir.iterdir()) == []


def test_environments_refuse_to_run_unjailed_without_consent():
    from sinkflex_core.envs.base import ToolEnv
    from sinkflex_core.envs.bash_env import BashBackend, BashExpert
    from sinkflex_core.envs.code_repair import CodeRepairBackend
    from sinkflex_core.envs.oracle import run_episode

    for backend in (BashBackend, CodeRepairBackend):
        with pytest.raises(RuntimeError, match="allow_unjailed=True"):
            backend(jail=False)
    env = ToolEnv(BashBackend(jail=False, allow_unjailed=True), split="test")
    try:
        assert env.backend.box.mode.startswith("unjailed")
        assert [run_episode(env, BashExpert(), i)[1] for i in range(3)] == [1.0, 1.0, 1.0]
    finally:
        env.close()
