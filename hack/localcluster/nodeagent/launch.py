"""Starts one container process: what runc does between "create" and "start", in a few syscalls.

Run by the agent as ``python -I -S launch.py`` with a JSON spec on stdin and fd ``errfd`` open
for writing; it becomes the container's process by exec, so its pid is the container's. Steps:
a new session (the container's process group); the pod's network namespace; new mount and UTS
namespaces with the pod's hostname; every mount private (nothing propagates to the host); /sys
remounted for the netns; masked directories (tmpfs) and the bind mounts in order, read-only ones
remounted read-only, the root too with ``readOnlyRootFilesystem``; the working directory; the
capability bounding set dropped (``capabilities.drop: [ALL]``), no_new_privs
(``allowPrivilegeEscalation: false``); groups, gid and uid; then exec with the executable
looked up on the container's PATH. With ``join`` it instead enters the namespaces of that
container's process (exec probes and hooks, like ``runc exec``).

Any failure before exec is written to ``errfd`` and the process exits 128; a successful exec
closes ``errfd`` (close-on-exec), which is how the agent tells the two apart.

Not done (a runtime would): pid, IPC and user namespaces, cgroups, seccomp, pivot_root into an
image filesystem. Standard library only: it runs with ``-I -S``.
"""

import ctypes
import json
import os
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _b(value):
    return None if value is None else os.fsencode(value)


def mount(source, target, fstype, flags, data=None):
    _check(
        _libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
        f"mount {target}",
    )


def setns(path, nstype=0):
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, nstype), f"setns {path}")
    finally:
        os.close(fd)


def prepare(spec):
    if spec.get("join"):
        pid = spec["join"]
        for ns in ("net", "uts", "mnt"):
            setns(f"/proc/{pid}/ns/{ns}")
        return
    if spec.get("netns"):
        setns(spec["netns"], CLONE_NEWNET)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    name = spec["hostname"].encode()
    _check(_libc.sethostname(name, len(name)), "sethostname")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # /sys/class/net of the pod's netns
    if spec.get("netns") and os.path.ismount("/sys") and _libc.umount2(b"/sys", MNT_DETACH) == 0:
        mount("sysfs", "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # Sources are opened before any mask hides them, and mounted from /proc/self/fd.
    sources = {}
    for m in spec["mounts"]:
        if m["source"] is not None:
            sources[m["target"]] = os.open(m["source"], os.O_PATH | os.O_CLOEXEC)
    for mask in spec.get("masks", []):
        mount("tmpfs", mask, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    for m in spec["mounts"]:
        target, fd = m["target"], sources.get(m["target"])
        is_dir = fd is None or stat.S_ISDIR(os.fstat(fd).st_mode)
        if m.get("create") == "inside" and not os.path.lexists(target):
            if is_dir:
                os.makedirs(target, 0o755)
            else:
                os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
                open(target, "a").close()
        if fd is None:
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        else:
            mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        if m.get("readOnly"):
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    for fd in sources.values():
        os.close(fd)
    if spec.get("readOnlyRoot"):
        mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def main():
    spec = json.loads(sys.stdin.read())
    errfd = spec["errfd"]
    try:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.setsid()
        prepare(spec)
        cwd = spec.get("cwd") or "/"
        if not os.path.isdir(cwd):
            os.makedirs(cwd, 0o755)  # runc creates a missing working directory
        os.chdir(cwd)
        if spec.get("dropCaps"):
            for cap in range(64):
                if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    break  # past the last capability the kernel knows
        if spec.get("noNewPrivs"):
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        os.setgroups(spec.get("groups", []))
        os.setgid(spec.get("gid", 0))
        os.setuid(spec.get("uid", 0))
        argv = spec["argv"]
        if not argv:
            raise RuntimeError("no command specified")
        os.set_inheritable(errfd, False)
        try:
            os.execvpe(argv[0], argv, spec["env"])
        except FileNotFoundError:
            where = "" if "/" in argv[0] else " in $PATH"
            raise RuntimeError(f'exec: "{argv[0]}": executable file not found{where}') from None
        except PermissionError:
            raise RuntimeError(f'exec: "{argv[0]}": permission denied') from None
    except BaseException as exc:
        message = str(exc) or type(exc).__name__
        os.write(errfd, message.encode(errors="replace"))
        os._exit(128)


if __name__ == "__main__":
    main()
