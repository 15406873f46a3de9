"""Per-run containment: resource limits, namespaces, an unprivileged uid, a scrubbed environment.

Everything here runs in the forked child just before the user's code, except
:func:`probe_isolation`, which the fork server calls once at start-up to learn what this
kernel and user allow. What is enforced where (as root on Linux):

* wall clock: the fork server kills the run's process tree at ``run_timeout``;
* CPU time: ``RLIMIT_CPU`` per process (SIGXCPU, then SIGKILL one second later);
* memory: ``RLIMIT_AS`` = ``memory_limit_MB`` on top of the warm interpreter's own size;
* processes: ``RLIMIT_NPROC`` counted per uid, and every run slot has its own uid;
* nothing left running: each run is PID 1 of a new PID namespace, so the kernel kills
  every descendant (double-forked daemons included) when the run's main process ends;
* no network: the fork server lives in a new, empty network namespace (loopback down);
* files: the fork server's mount namespace has every file system read-only except a
  private tmpfs holding the run directories; a run's uid owns only its own directory;
  ``RLIMIT_FSIZE`` caps file size;
* reads: home directories (``/root``, ``/home``, the server's ``$HOME``) are covered by
  empty tmpfs mounts, and only the interpreter's own trees (prefixes, ``sys.path``) are
  bound back at their paths; no capability that bypasses file permissions is kept, so
  ``/etc/shadow``, keys and credentials stay unreadable.

Without root (or without namespaces) the fork server falls back to process-group kills and
reports which protections are missing in ``GET /v1/ping`` and its start-up log; the HTTP
server then refuses to start unless told ``--insecure`` (:func:`containment_gaps`).
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from dataclasses import dataclass, field

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class SandboxLimits:
    """Limits applied to every run (a request may lower the timeout or the memory)."""

    default_run_timeout: float = 10.0
    """Wall-clock seconds when the request gives no ``run_timeout`` (SandboxFusion: 10)."""
    max_run_timeout: float = 300.0
    """Largest ``run_timeout`` a request may ask for; larger values are refused."""
    default_memory_mb: int = 1024
    """Memory limit in MiB when the request gives no positive ``memory_limit_MB``."""
    max_memory_mb: int = 16384
    """Largest ``memory_limit_MB`` a request may ask for."""
    max_processes: int = 64
    """Most processes (and threads) one run may have at once (``RLIMIT_NPROC``, per uid)."""
    max_output_bytes: int = 1 << 20
    """Bytes kept of each of stdout and stderr; the rest is read and dropped, with a flag."""
    max_file_bytes: int = 64 << 20
    """Largest file a run may write (``RLIMIT_FSIZE``)."""
    tmpfs_mb: int = 4096
    """Size of the private tmpfs holding every run's directory (counts as memory when used)."""
    max_open_files: int = 256
    """Most open file descriptors per process (``RLIMIT_NOFILE``)."""
    base_uid: int = 2_000_000
    """Run slot ``i`` runs as uid/gid ``base_uid + i`` (when the server runs as root)."""


@dataclass
class Isolation:
    """What this machine lets the fork server enforce (probed once at start-up)."""

    setuid: bool = False
    """Runs use their own unprivileged uid (needs root); enables the per-run process limit."""
    pid_namespace: bool = False
    """Each run is PID 1 of its own PID namespace, so no descendant outlives it."""
    net_namespace: bool = False
    """The fork server and its runs live in a network namespace with no interfaces up."""
    private_mounts: bool = False
    """The fork server and its runs see ``/`` read-only and a private tmpfs on ``/tmp``."""
    homes_hidden: bool = False
    """Every home directory looks empty to runs, but for the interpreter's trees bound back."""
    hidden_paths: list[str] = field(default_factory=list)
    """The home directories so covered."""
    read_all_files: bool = False
    """Runs keep ``CAP_DAC_READ_SEARCH`` because the interpreter stayed unreadable to other
    uids even after hiding: they can read any file (only with ``--insecure``)."""
    notes: list[str] = field(default_factory=list)
    """Why a protection is missing, for the start-up log and ``/v1/ping``."""


def unshare(flags: int) -> None:
    """``unshare(2)`` through libc (``os.unshare`` only exists from Python 3.12)."""
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare({flags:#x}) failed: {os.strerror(err)}")


def setns(fd: int, nstype: int) -> None:
    """``setns(2)`` through libc."""
    if _libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({nstype:#x}) failed: {os.strerror(err)}")


def enter_empty_network_namespace(isolation: Isolation) -> None:
    """Move the calling process into a new network namespace (only loopback, and it is down)."""
    try:
        unshare(CLONE_NEWNET)
        isolation.net_namespace = True
    except OSError as exc:
        isolation.notes.append(f"network not isolated: {exc}")


_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
_O_PATH = getattr(os, "O_PATH", 0o10000000)


def _mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    if (
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode(),
            ctypes.c_ulong(flags),
            data.encode() or None,
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target} failed: {os.strerror(err)}")


_PSEUDO_FS = {
    "proc",
    "sysfs",
    "devtmpfs",
    "devpts",
    "cgroup",
    "cgroup2",
    "mqueue",
    "debugfs",
    "tracefs",
    "securityfs",
    "pstore",
    "bpf",
    "configfs",
    "fusectl",
    "hugetlbfs",
}


def enter_private_mounts(isolation: Isolation, runs_dir: str, tmpfs_mb: int) -> None:
    """New mount namespace: every file system read-only except a fresh tmpfs on ``runs_dir``.

    ``runs_dir`` (an empty directory the caller created) holds the run directories; it is
    the only place runs can write, and its tmpfs vanishes with the fork server, so nothing
    a run wrote survives it. ``/dev/shm`` becomes an empty read-only tmpfs. Needs root.
    """
    if not isolation.setuid:
        isolation.notes.append("file systems not made read-only (needs root)")
        return
    try:
        unshare(CLONE_NEWNS)
        _mount("none", "/", "", _MS_REC | _MS_PRIVATE)
        hide_home_directories(isolation, [runs_dir])
        _mount("tmpfs", runs_dir, "tmpfs", 0, f"mode=0711,size={tmpfs_mb}m")
        if os.path.isdir("/dev/shm"):
            _mount("tmpfs", "/dev/shm", "tmpfs", _MS_RDONLY, "mode=0755,size=4k")
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
        for target, fstype in mounts:
            target = target.replace("\\040", " ")
            if fstype in _PSEUDO_FS or target in (runs_dir, "/dev/shm"):
                continue
            try:
                _mount("none", target, "", _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
            except OSError as exc:
                if target == "/":
                    raise
                isolation.notes.append(f"{target} stays writable: {exc}")
    except OSError as exc:
        isolation.notes.append(f"file systems not fully confined: {exc}")
        return
    isolation.private_mounts = True


def home_directories() -> list[str]:
    """Directories that hold users' private files: ``/root``, ``/home``, the server's ``$HOME``."""
    found: list[str] = []
    for path in ("/root", "/home", os.path.expanduser("~")):
        path = os.path.realpath(path)
        if path != "/" and os.path.isdir(path) and path not in found:
            found.append(path)
    return _outermost(found)


def interpreter_trees() -> list[str]:
    """What a run's interpreter reads: its prefixes and every ``sys.path`` directory.

    ``sys.path[0]`` of ``python -m`` (the server's working directory) is left out.
    """
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    paths.append(os.path.dirname(os.path.realpath(sys.executable)))
    cwd = os.path.realpath(os.getcwd())
    for entry in sys.path:
        if entry and os.path.exists(entry) and os.path.realpath(entry) != cwd:
            paths.append(entry if os.path.isdir(entry) else os.path.dirname(entry))
    return _outermost([os.path.realpath(p) for p in paths])


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _outermost(paths: list[str]) -> list[str]:
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(_inside(path, k) for k in kept):
            kept.append(path)
    return kept


def hide_home_directories(isolation: Isolation, keep: list[str]) -> None:
    """Cover each home directory with an empty tmpfs, then bind back what runs need.

    Kept are the interpreter's trees and ``keep`` (the runs directory), each at its own path;
    a home directory that is itself needed (the interpreter's prefix is ``/home``) stays
    visible, with a note. Called in the fork server's new mount namespace, as root.
    """
    needed = _outermost(interpreter_trees() + [os.path.realpath(k) for k in keep])
    homes = home_directories()
    for home in homes:
        if any(_inside(home, n) for n in needed):
            isolation.notes.append(f"{home} not hidden: the interpreter or runs live there")
            continue
        inner = [n for n in needed if _inside(n, home)]
        fds = [os.open(n, _O_PATH | os.O_CLOEXEC) for n in inner]  # reachable once covered
        try:
            _mount("tmpfs", home, "tmpfs", 0, "mode=0755,size=1m")
            for path, fd in zip(inner, fds, strict=True):
                os.makedirs(path, mode=0o755, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", path, "", _MS_BIND | _MS_REC)
        finally:
            for fd in fds:
                os.close(fd)
        isolation.hidden_paths.append(home)
    isolation.homes_hidden = len(isolation.hidden_paths) == len(homes)


def check_interpreter(isolation: Isolation, uid: int) -> None:
    """After hiding: keep ``CAP_DAC_READ_SEARCH`` only if runs could not load Python otherwise."""
    if isolation.setuid and not interpreter_readable_by(uid):
        isolation.read_all_files = True
        isolation.notes.append(
            "the Python installation is unreadable to unprivileged uids; runs keep "
            "CAP_DAC_READ_SEARCH (they can read any file, writes stay confined)"
        )


def containment_gaps(isolation: dict[str, object]) -> list[str]:
    """The protections a fork server reported missing (empty when it contains fully)."""
    names = ("setuid", "pid_namespace", "net_namespace", "private_mounts", "homes_hidden")
    gaps = [name for name in names if not isolation.get(name)]
    if isolation.get("read_all_files"):
        gaps.append("read_all_files")
    return gaps


def probe_pid_namespace(isolation: Isolation) -> int | None:
    """Check that runs can get their own PID namespace; return an fd of ours to switch back."""
    try:
        own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        unshare(CLONE_NEWPID)
        setns(own, CLONE_NEWPID)
    except OSError as exc:
        isolation.notes.append(f"no PID namespace per run (process-group kill only): {exc}")
        return None
    isolation.pid_namespace = True
    return own


def probe_isolation() -> Isolation:
    """Probe uid switching; namespaces and the interpreter are probed by the fork server."""
    isolation = Isolation()
    if os.geteuid() == 0:
        isolation.setuid = True
    else:
        isolation.notes.append(
            "not root: runs keep the server's uid (no per-run process limit, writes outside "
            "the run's directory are only stopped by file permissions)"
        )
    return isolation


def apply_rlimits(limits: SandboxLimits, cpu_seconds: float, address_space: int | None) -> None:
    """Set the run's resource limits (in the child, before dropping privileges)."""
    cpu = max(1, int(cpu_seconds + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if address_space is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def drop_privileges(uid: int, keep_read_search: bool = False) -> None:
    """Become ``uid``/``gid`` with no supplementary groups (irreversible).

    With ``keep_read_search`` the process keeps only ``CAP_DAC_READ_SEARCH`` (also across
    ``execve``, as an ambient capability) so it can load an interpreter it could not read.
    """
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    if keep_read_search:
        _libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
    os.setresuid(uid, uid, uid)
    if keep_read_search:
        _keep_only_read_search()


_PR_SET_KEEPCAPS = 8
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 47, 2
_CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _keep_only_read_search() -> None:
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    bit = 1 << _CAP_DAC_READ_SEARCH
    data = (ctypes.c_uint32 * 6)(bit, bit, bit, 0, 0, 0)  # effective, permitted, inheritable x2
    if _libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    if _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "raising the ambient capability failed")


def interpreter_readable_by(uid: int) -> bool:
    """Whether ``uid`` can read this interpreter's standard library and site-packages."""
    import sysconfig

    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sys.executable]
    pid = os.fork()
    if pid == 0:
        try:
            drop_privileges(uid)
            for path in paths:
                if os.path.isdir(path):
                    os.listdir(path)
                else:
                    open(path, "rb").close()
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def scrubbed_env(workdir: str) -> dict[str, str]:
    """The whole environment a run sees: nothing inherited from the server."""
    return {
        "PATH": SAFE_PATH,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


def address_space_bytes() -> int:
    """Virtual size of the calling process (the warm interpreter's baseline for ``RLIMIT_AS``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
