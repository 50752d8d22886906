"""Run untrusted shell commands in a jail: the executor behind ``sinkflex/Bash-v0`` and
``sinkflex/CodeRepair-v0``.

Two modes, chosen once per process by a probe (:func:`jail_available`):

**Namespaces** (Linux with unprivileged user namespaces and util-linux ``unshare``; the default).
Each command starts ``unshare --user --map-root-user --net --mount --pid --fork`` and, inside, builds a
new root from a skeleton folder private to the :class:`Sandbox`: ``/usr`` (and the ``/bin``, ``/lib``
... links or folders beside it) bound read-only, the episode's folder bound read-write at
``/sandbox``, a fresh size-capped ``/tmp``, ``/etc/alternatives`` read-only (where it exists),
``/dev/null``, ``/dev/zero``, ``/dev/urandom``, a fresh ``/proc`` of the new PID namespace and a
two-line ``/etc/passwd`` and ``/etc/group``. It then ``pivot_root``\\ s into it, unmounts the old
root, remounts the new root read-only and drops every capability (``setpriv``) before running
``bash -c``. What holds:

- nothing outside the sandbox folder is readable or writable: the host's file system is not mounted
  in the command's namespace at all (``..``, absolute paths and symlinks resolve inside the new root);
- no network: a fresh network namespace has only a loopback interface, down; 127.0.0.1 of the host
  is a different stack;
- ``/proc`` lists only the command's own processes;
- limits: wall time (the whole process tree is killed at the deadline: killing the namespace's first
  process makes the kernel kill every other one, daemons included), CPU seconds, address space, open
  files, file size (``RLIMIT_FSIZE``), processes (``RLIMIT_NPROC``, counted per namespace, so a fork
  bomb stops at the cap without touching the host's other processes), output (read in chunks, kept up
  to a cap, the command killed past a hard cap).

When the caller is root, the command runs as an unprivileged user id of its own (outside the
namespace), because the kernel does not count processes of the real root against ``RLIMIT_NPROC``
and because an unprivileged id cannot write any host file even through a mount it could reach.

**Fallback** (no working ``unshare``): ``bash -c`` in the sandbox folder, in a process group of its
own, with the same resource limits, a scrubbed environment (``HOME``, ``TMPDIR`` in the sandbox) and
the same wall-time kill of that process group. It does NOT hide or protect the rest of the file system, does not
cut the network, does not kill processes that leave their process group (``setsid``), and counts the
process limit against the whole user id (outside root: all of that user's processes). It only runs
when the caller asks for it (``allow_unjailed=True``); otherwise :class:`Sandbox` raises.

Disk use is bounded per file by ``RLIMIT_FSIZE`` and per command only by the wall time; the
environments measure the folder after each command (:func:`tree_usage`) and end the episode when it
exceeds their quota.
"""

from __future__ import annotations

import os
import resource  # here, not in _preexec: the child may no longer be allowed to read the module
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MOUNT_POINT = "/sandbox"
_CMD_PATH = "/usr/local/bin:/usr/bin:/bin"
_UNSHARE_NOISE = "unshare: sigprocmask unblock failed: Invalid argument"
_HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The unprivileged ids a root caller runs commands as; one per Sandbox, drawn from a range no real
# account uses, so that two sandboxes rarely share the outer process count.
_UID_BASE, _UID_SPAN = 1_500_000, 400_000

# The init of the jail (POSIX sh, run by unshare inside the new namespaces). $1 the new root (a
# skeleton the Sandbox made: mount points, links, /etc/passwd), $2 the sandbox folder, $3 the user's
# command; PRLIMITS is the prlimit option list. Each line is one exec at most: this is the fixed cost
# of every command. The command runs under eval so that bash stays the namespace's first process
# (bash -c would exec a lone command in its place, and a first process ignores SIGXCPU).
_INIT = r"""set -e
PATH=/usr/sbin:/usr/bin:/sbin:/bin
R=$1
mount --bind "$R" "$R"
cd "$R"
for d in usr $REAL_DIRS; do mount -o bind,ro "/$d" "$d"; done
if [ -d etc/alternatives ]; then mount -o bind,ro /etc/alternatives etc/alternatives; fi
mount --bind "$2" sandbox
mount -t tmpfs -o "size=${TMP_BYTES},mode=1777" sinkflex-tmp tmp
for f in null zero urandom; do mount --bind "/dev/$f" "dev/$f"; done
mount -t proc proc proc
pivot_root . .old
umount -l /.old
mount -o remount,bind,ro /
cd /sandbox
PATH=$CMD_PATH; L=$PRLIMITS
unset TMP_BYTES CMD_PATH PRLIMITS REAL_DIRS
exec prlimit $L -- setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- /bin/bash -c 'c=$1; set --; eval "unset c
$c"' bash "$3"
"""
_TOP_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def _skeleton(root: Path) -> list[str]:
    """Make the jail's root folder; return the top-level folders (not links) to bind besides /usr."""
    for name in ("usr", "sandbox", "tmp", "dev", "proc", "etc", ".old"):
        (root / name).mkdir()
    real = []
    for name in _TOP_DIRS:
        host = Path("/") / name
        if host.is_symlink():
            (root / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (root / name).mkdir()
            real.append(name)
    if Path("/etc/alternatives").is_dir():  # Debian's program links (awk -> mawk ...)
        (root / "etc/alternatives").mkdir()
    for dev in ("null", "zero", "urandom"):
        (root / "dev" / dev).touch()
    (root / "dev/fd").symlink_to("/proc/self/fd")
    (root / "etc/passwd").write_text("root:x:0:0:root:/sandbox:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    return real


@dataclass(frozen=True)
class Limits:
    """Per-command limits. ``output_bytes`` is what the observation keeps; past ``kill_output_bytes``
    the command is killed."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 1024
    processes: int = 64
    file_mb: int = 16
    open_files: int = 256
    tmp_mb: int = 16
    output_bytes: int = 8_000
    kill_output_bytes: int = 1 << 20

    def prlimit_args(self) -> list[str]:
        return [f"--cpu={self.cpu_s}:{self.cpu_s + 1}", f"--as={self.memory_mb << 20}", f"--nproc={self.processes}",
                f"--fsize={self.file_mb << 20}", f"--nofile={self.open_files}", "--core=0"]


@dataclass
class RunResult:
    """What one command did: exit status (negative: killed by that signal; after a kill by a
    limit, the status ``unshare`` reports), output (stdout and stderr interleaved, cut to the cap),
    which limits it hit (the reliable record of a kill), and its wall time in seconds."""

    returncode: int
    output: str
    limits_hit: list[str] = field(default_factory=list)
    seconds: float = 0.0
    output_cut: bool = False

    def observation(self) -> str:
        """The text an agent sees: the exit status, the output, and a line per limit hit."""
        lines = [f"exit code: {self.returncode}"]
        lines += [f"[{note}]" for note in self.limits_hit]
        if self.output_cut:
            lines.append("[output cut]")
        return "\n".join(lines) + ("\n" + self.output if self.output else "")


_PROBE: dict[str, tuple[bool, str]] = {}
_PROBE_LOCK = threading.Lock()


def _outer_id() -> int | None:
    return _UID_BASE + int.from_bytes(os.urandom(4), "little") % _UID_SPAN if os.geteuid() == 0 else None


def jail_available() -> tuple[bool, str]:
    """Whether commands can run in namespaces here, and why not (cached for the process)."""
    with _PROBE_LOCK:
        if "jail" not in _PROBE:
            _PROBE["jail"] = _probe()
        return _PROBE["jail"]


def _probe() -> tuple[bool, str]:
    missing = [b for b in ("unshare", "prlimit", "setpriv", "pivot_root", "mount")
               if shutil.which(b, path=_HOST_PATH) is None]
    if missing:
        return False, f"missing programs: {', '.join(missing)}"
    try:
        box = Sandbox(Limits(wall_s=20.0), jail=True, _probing=True)
    except OSError as err:
        return False, f"cannot make a sandbox folder: {err}"
    try:
        res = box.run("echo ok")
        if res.returncode != 0 or res.output.strip() != "ok":
            return False, f"unshare failed: {res.output.strip()[:300] or res.returncode}"
        return True, "user, mount, PID and network namespaces"
    finally:
        box.close()


class Sandbox:
    """A private folder and a way to run commands in it (see the module docstring).

    ``jail=None`` uses namespaces when the probe says they work and otherwise raises, unless
    ``allow_unjailed`` is true, in which case it falls back with a warning in :attr:`mode`.
    ``jail=False`` forces the fallback (it too needs ``allow_unjailed``).
    """

    def __init__(self, limits: Limits | None = None, jail: bool | None = None, allow_unjailed: bool = False,
                 _probing: bool = False):
        self.limits = limits or Limits()
        if not _probing:
            ok, why = jail_available()
            if jail is None:
                jail = ok
            elif jail and not ok:
                raise RuntimeError(f"the namespace jail does not work here ({why})")
            if not jail and not allow_unjailed:
                raise RuntimeError(
                    f"the namespace jail does not work here ({why}) or was turned off; commands would run "
                    "unjailed (resource limits only, the rest of the file system and the network reachable). "
                    "Pass allow_unjailed=True to accept that.")
        self.jailed = bool(jail)
        self.mode = "namespaces" if self.jailed else "unjailed (resource limits only)"
        self.uid = _outer_id()
        self.base = Path(tempfile.mkdtemp(prefix="sinkflex-sandbox-"))
        self.root = self.base / "root"
        self.root.mkdir()
        self._real_dirs = _skeleton(self.root) if self.jailed else []
        self.dir = self.base / "work"
        self.dir.mkdir()
        if self.uid is not None:  # the skeleton stays root's: even a writable mount of it would refuse writes
            os.chown(self.base, self.uid, self.uid)
        self._own(self.dir)

    def _own(self, path: Path) -> None:
        """Hand ``path`` (recursively) to the command's user id, so the jailed root may change it."""
        if self.uid is None:
            return
        os.chown(path, self.uid, self.uid, follow_symlinks=False)
        if path.is_dir() and not path.is_symlink():
            for dirpath, dirnames, filenames in os.walk(path):
                for name in dirnames + filenames:
                    os.chown(os.path.join(dirpath, name), self.uid, self.uid, follow_symlinks=False)

    def clear(self) -> None:
        """Empty the sandbox folder (files the jailed user made included, whatever their modes)."""
        _remove(self.dir)
        self.dir.mkdir()
        self._own(self.dir)

    def handover(self) -> None:
        """Give everything written into the folder by this process to the command's user id."""
        self._own(self.dir)

    def _argv(self, command: str) -> tuple[list[str], dict]:
        lim = self.limits
        if self.jailed:
            env = {"PATH": _HOST_PATH, "HOME": MOUNT_POINT, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                   "TMP_BYTES": str(lim.tmp_mb << 20), "CMD_PATH": _CMD_PATH,
                   "PRLIMITS": " ".join(lim.prlimit_args()), "REAL_DIRS": " ".join(self._real_dirs)}
            argv = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child",
                    "--propagation", "private", "/bin/sh", "-c", _INIT, "sinkflex-init", str(self.root),
                    str(self.dir), command]
        else:
            env = {"PATH": _CMD_PATH, "HOME": str(self.dir), "TMPDIR": str(self.dir), "LANG": "C.UTF-8"}
            argv = ["/bin/bash", "-c", command]
        return argv, env

    def _preexec(self):  # fallback only: the jail sets its limits with prlimit inside the namespaces
        lim = self.limits
        for res, value in ((resource.RLIMIT_CPU, lim.cpu_s), (resource.RLIMIT_AS, lim.memory_mb << 20),
                           (resource.RLIMIT_NPROC, lim.processes), (resource.RLIMIT_FSIZE, lim.file_mb << 20),
                           (resource.RLIMIT_NOFILE, lim.open_files), (resource.RLIMIT_CORE, 0)):
            hard = resource.getrlimit(res)[1]  # this runs after the switch of user id: only lowering works
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(res, (value, value))

    def run(self, command: str, wall_s: float | None = None) -> RunResult:
        """Run ``command`` with ``bash -c`` in the sandbox; never raises for anything the command does."""
        if not isinstance(command, str):
            raise TypeError(f"a command must be a str, got {type(command).__name__}")
        if "\x00" in command:
            return RunResult(-1, "the command contains a NUL character", ["refused"])
        lim = self.limits
        wall = lim.wall_s if wall_s is None else wall_s
        argv, env = self._argv(command)
        ids = {} if self.uid is None else {"user": self.uid, "group": self.uid, "extra_groups": []}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=env, cwd=None if self.jailed else self.dir, start_new_session=True,
                                    preexec_fn=None if self.jailed else self._preexec, **ids)
        except OSError as err:
            return RunResult(-1, f"could not start the command: {err}", ["not started"])
        kept, total, hit = bytearray(), 0, []
        fd = proc.stdout.fileno()
        try:
            while True:
                left = start + wall - time.monotonic()
                if left <= 0:
                    hit.append(f"killed: wall-clock limit of {wall:g} s")
                    break
                ready, _, _ = select.select([fd], [], [], min(left, 0.5))
                if not ready:
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                total += len(chunk)
                if len(kept) < lim.output_bytes:
                    kept += chunk[: lim.output_bytes - len(kept)]
                if total > lim.kill_output_bytes:
                    hit.append(f"killed: output over {lim.kill_output_bytes} bytes")
                    break
        finally:
            self._kill(proc)
            proc.stdout.close()
        code = proc.returncode
        if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or b"CPU time limit exceeded" in kept:
            hit.append(f"CPU time limit of {lim.cpu_s} s")
        if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or b"File too large" in kept \
                or b"File size limit exceeded" in kept:
            hit.append(f"file size limit of {lim.file_mb} MiB")
        text = kept.decode("utf-8", errors="replace")
        if _UNSHARE_NOISE in text:  # unshare cannot re-raise SIGKILL (the CPU hard limit hit the first process)
            text = text.replace(_UNSHARE_NOISE + "\n", "").replace(_UNSHARE_NOISE, "")
            if not hit:
                hit.append(f"CPU time limit of {lim.cpu_s} s")
        if "fork: retry" in text or "fork: Resource temporarily unavailable" in text:
            hit.append(f"process limit of {lim.processes}")
        if code is not None and code < 0 and code != -signal.SIGKILL and not hit:
            hit.append(f"killed by signal {-code}")
        return RunResult(code if code is not None else -signal.SIGKILL, text, hit, time.monotonic() - start,
                         total > len(kept))

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """Kill everything the command started. In the jail, the first process of the PID namespace
        goes first: the kernel then kills every other process in it and ``unshare``, which waits for
        that first process, exits only once all are gone; so nothing outlives :meth:`run`. The
        process group follows (the fallback's only handle, and a backstop)."""
        if proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                children = []
            for child in children:
                try:
                    os.kill(child, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - the kernel did not reap it in 10 s
            proc.kill()
            proc.wait()

    def close(self) -> None:
        _remove(self.base, missing_ok=True)

    def __del__(self):
        base = getattr(self, "base", None)
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)


def _remove(path: Path, missing_ok: bool = False) -> None:
    """``rm -rf``, even of folders a command made unreadable (``chmod 000``): a non-root caller needs
    the owner's permissions back first."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass
    for dirpath, dirnames, _ in os.walk(path):  # top-down: each folder is opened up before it is listed
        for name in dirnames:
            sub = os.path.join(dirpath, name)
            try:
                if not os.path.islink(sub):  # never through a link: it could point at a host folder
                    os.chmod(sub, 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path) and not missing_ok:
        raise RuntimeError(f"cannot empty the sandbox folder {path}")


def tree_usage(root: Path, max_entries: int = 100_000) -> tuple[int, int]:
    """``(bytes, entries)`` under ``root`` without following symlinks (stops counting at ``max_entries``)."""
    size = count = 0
    stack = [str(root)]
    while stack and count < max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    count += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    size += st.st_size if not entry.is_dir(follow_symlinks=False) else 0
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue
    return size, count
