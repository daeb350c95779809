"""Where the lab keeps its state, and what it trusts of it.

The state file names what `down` deletes and kills, so it lives only in a directory this user
owns and nobody else can write (made with mode 0700; another owner, a link, or group/other write
is refused), and a file whose names are not the ones the lab's naming scheme derives from its
name and subnet (cluster/lab.py: `Lab.plan`) is refused as a whole: the lab never deletes,
unlinks or kills anything it would not have made itself.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from pdcluster.cluster.lab_tc import LabError

DEFAULT_ROOT = "/tmp/pdc-lab"
# The fields of a lab (and of each host) that name what it made: they must be the plan's.
NAMED = ("name", "subnet", "head_address", "bridge", "state_dir")
HOST_NAMED = ("name", "index", "netns", "address", "label", "veth", "peer", "temp_dir")


def lab_root() -> Path:
    return Path(os.environ.get("PDC_LAB_DIR", DEFAULT_ROOT))


def private_dir(path: Path, create: bool = True) -> Path:
    """`path`, a directory of this user's that nobody else can write (made with mode 0700 if
    `create` and it is missing); LabError naming what is wrong otherwise."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise LabError(f"{path} is not a directory (a link, or a file): the lab keeps its state only in a "
                       "directory of its own (set PDC_LAB_DIR to one)")
    if st.st_uid != os.geteuid():
        raise LabError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): the lab will "
                       "not keep its state there (set PDC_LAB_DIR to a directory of your own)")
    if st.st_mode & 0o022:
        raise LabError(f"{path} can be written by others (mode {stat.S_IMODE(st.st_mode):o}): chmod 700 it, or set "
                       "PDC_LAB_DIR to a directory of your own")
    return path


def check_lab_name(name: str) -> None:
    """LabError unless `name` can name a lab (its interfaces, namespaces and directory carry it)."""
    if not re.fullmatch(r"[a-z][a-z0-9]*", name):
        raise LabError(f"lab name {name!r}: use lower-case letters and digits, starting with a letter")


def check_names(found: dict, planned: dict, path: Path) -> None:
    """LabError unless the state file's names (`found`, as read) are the plan's (`planned`,
    `dataclasses.asdict(Lab.plan(...))` for the same name, subnet and number of hosts)."""
    wrong = [f for f in NAMED if found.get(f) != planned[f]]
    hosts = found.get("hosts") or []
    if len(hosts) != len(planned["hosts"]):
        wrong.append("hosts")
    wrong += [f"hosts[{i}].{f}" for i, (h, p) in enumerate(zip(hosts, planned["hosts"]))
              for f in HOST_NAMED if h.get(f) != p[f]]
    if wrong:
        raise LabError(f"{path} names what this lab would not have made ({', '.join(wrong)}): not touching "
                       "anything it lists; remove the file by hand if it is stale")
