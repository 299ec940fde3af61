"""The sandbox's seccomp filter: syscall numbers per architecture, the syscalls refused, and the BPF program.

Apart from sandbox_boot.py because it is a table and one pure function, not a step of the boot: the bootstrap
script loads this file from next to itself before it builds the new root, and its child installs the program
`filter_program` returns just before exec. Like the bootstrap it imports only the standard library (it runs between
fork and exec, where the project is hidden and would be slow to import), and importing it runs nothing.
"""

from __future__ import annotations

import errno
import struct

# clone(2) namespace flags: the bootstrap enters these namespaces; the filter keeps the program from making new ones
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWCGROUP = (
    0x20000,
    0x4000000,
    0x8000000,
    0x10000000,
    0x20000000,
    0x40000000,
    0x02000000,
)
CLONE_NS_FLAGS = NEWNS | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWCGROUP

# syscall numbers: x86_64 and the generic table (aarch64)
SYSCALLS = {
    "x86_64": dict(
        audit=0xC000003E,
        pivot_root=155,
        nr={
            "memfd_create": 319,
            "memfd_secret": 447,
            "userfaultfd": 323,
            "bpf": 321,
            "perf_event_open": 298,
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "mount": 165,
            "umount2": 166,
            "pivot_root": 155,
            "chroot": 161,
            "unshare": 272,
            "setns": 308,
            "init_module": 175,
            "finit_module": 313,
            "delete_module": 176,
            "kexec_load": 246,
            "kexec_file_load": 320,
            "reboot": 169,
            "swapon": 167,
            "swapoff": 168,
            "acct": 163,
            "open_by_handle_at": 304,
            "name_to_handle_at": 303,
            "fanotify_init": 300,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "move_mount": 429,
            "open_tree": 428,
            "mount_setattr": 442,
            "syslog": 103,
            "quotactl": 179,
            "lookup_dcookie": 212,
            "vhangup": 153,
            "kcmp": 312,
            "pidfd_getfd": 438,
            "process_madvise": 440,
            "settimeofday": 164,
            "clock_settime": 227,
            "clock_adjtime": 305,
            "adjtimex": 159,
            "clone": 56,
            "clone3": 435,
            "socket": 41,
            "setsid": 112,
            "setpgid": 109,
        },
    ),
    "aarch64": dict(
        audit=0xC00000B7,
        pivot_root=41,
        nr={
            "memfd_create": 279,
            "memfd_secret": 447,
            "userfaultfd": 282,
            "bpf": 280,
            "perf_event_open": 241,
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "mount": 40,
            "umount2": 39,
            "pivot_root": 41,
            "chroot": 51,
            "unshare": 97,
            "setns": 268,
            "init_module": 105,
            "finit_module": 273,
            "delete_module": 106,
            "kexec_load": 104,
            "kexec_file_load": 294,
            "reboot": 142,
            "swapon": 224,
            "swapoff": 225,
            "acct": 89,
            "open_by_handle_at": 265,
            "name_to_handle_at": 264,
            "fanotify_init": 262,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "move_mount": 429,
            "open_tree": 428,
            "mount_setattr": 442,
            "syslog": 116,
            "quotactl": 60,
            "lookup_dcookie": 18,
            "vhangup": 58,
            "kcmp": 272,
            "pidfd_getfd": 438,
            "process_madvise": 440,
            "settimeofday": 170,
            "clock_settime": 112,
            "clock_adjtime": 266,
            "adjtimex": 171,
            "clone": 220,
            "clone3": 435,
            "socket": 198,
            "setsid": 157,
            "setpgid": 154,
        },
    ),
}
# always refused with EPERM: memory outside the rlimits (memfd, userfaultfd), other namespaces and mounts,
# inspecting other processes, kernel attack surface nobody's solution needs
DENY = (
    "memfd_create",
    "memfd_secret",
    "userfaultfd",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "open_by_handle_at",
    "name_to_handle_at",
    "fanotify_init",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "syslog",
    "quotactl",
    "lookup_dcookie",
    "vhangup",
    "kcmp",
    "pidfd_getfd",
    "process_madvise",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
)


def filter_program(machine: str, *, allow_network: bool, pidns: bool) -> bytes | None:
    """The classic-BPF seccomp program for `machine` (os.uname().machine); None without a syscall table for it.

    Without the network, socket() is refused too; without a pid namespace (`pidns` false) so are setsid and
    setpgid, since the process group is then the only handle the host has on the program's children.
    """
    arch = SYSCALLS.get(machine)
    if arch is None:
        return None
    nr = arch["nr"]
    ld_w, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    errno_ret = lambda e: 0x00050000 | e
    ins: list[tuple[int, int, int, int]] = [
        (ld_w, 0, 0, 4),
        (jeq, 1, 0, arch["audit"]),
        (ret, 0, 0, kill),
        (ld_w, 0, 0, 0),
    ]
    if machine == "x86_64":
        ins += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # x32 ABI syscalls
    deny = [(n, errno.EPERM) for n in DENY] + [("clone3", errno.ENOSYS)]  # libc falls back to clone
    if not allow_network:
        deny.append(("socket", errno.EACCES))
    if not pidns:  # without a pid namespace the process group is the only handle on its children
        deny += [("setsid", errno.EPERM), ("setpgid", errno.EPERM)]
    for name, e in deny:
        ins += [(jeq, 0, 1, nr[name]), (ret, 0, 0, errno_ret(e))]
    # clone with a namespace flag; the flags are the first argument (low 32 bits at offset 16)
    ins += [
        (jeq, 0, 3, nr["clone"]),
        (ld_w, 0, 0, 16),
        (jset, 0, 1, CLONE_NS_FLAGS),
        (ret, 0, 0, errno_ret(errno.EPERM)),
        (ret, 0, 0, allow),
    ]
    return b"".join(struct.pack("HBBI", *i) for i in ins)
