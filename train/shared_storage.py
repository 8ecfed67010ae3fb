"""A local storage path on a Ray cluster of several machines must be one folder that every machine mounts.

Otherwise each machine writes its part (a dataset's shards, a checkpoint's) to a disk of its own, and the run fails
later with an error that names something else (a corpus that "gives no train sequence": its shards went to the
other machine). So before anything is written there, the driver puts a file in the folder and asks each other
machine whether it sees it. Machines that join later (an autoscaler's) are asked where work reaches them: a dataset
being prepared asks again once its nodes are up, and training workers look for a file that the driver holds there
(a run's lease, a sweep's settings: ``shared_folder``, checked in train/loop.py).
"""

import os
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from train import storage
from train.config import TrainConfig
from train.data import dataset_path
from train.loop_args import SharedFolder
from train.schema import ConfigError

# A node that has not answered by then (busy starting, or going away) is not judged: only what a node says counts.
ANSWER_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0)
def _sees(path: str) -> bool:
    return os.path.exists(path)


def check_nodes_share(paths: list[tuple[str, str]]) -> None:
    """Raise ConfigError naming the key where a local path of ``paths`` (config key, path) is not the same folder
    on every alive node at another address than this driver's (a node at its address shares its disk)."""
    local = [(key, path) for key, path in paths if storage.is_local(path)]
    if not local:  # object storage, as on cluster.yaml: nothing to ask
        return
    here = ray.util.get_node_ip_address()
    others = {
        node["NodeID"]: node["NodeManagerAddress"]
        for node in ray.nodes()
        if node["Alive"] and node["NodeManagerAddress"] != here
    }
    if not others:
        return
    asked: set[str] = set()  # a run's storage and its dataset often come down to one existing folder: asked once
    for key, path in local:
        folder = storage.nearest_existing(storage.absolute(path))
        if folder in asked:
            continue
        asked.add(folder)
        blind = _nodes_not_seeing(folder, others)
        if blind:
            raise ConfigError(not_seen(key, path, here, blind))


def not_seen(key: str, path: str, here: str, blind: list[str]) -> str:
    """What a check says of the folder ``path`` of the machine at ``here`` that the nodes at ``blind`` cannot see."""
    nodes = f"node{'s' if len(blind) > 1 else ''} at {', '.join(blind)}"
    return (
        f"{key}: {path} is a folder of this machine ({here}) that the {nodes} of this Ray cluster cannot see; on a "
        "cluster of several machines use object storage (s3://...) or a folder every node mounts"
    )


def shared_folder(setting: str, path: str, file: str) -> SharedFolder | None:
    """``path``, the value of ``setting``, as workers check it: each must see ``file``, which this driver holds
    there while they run; None on object storage."""
    if not storage.is_local(path):
        return None
    return SharedFolder(
        setting=setting, path=path, file=storage.absolute(file), driver_ip=ray.util.get_node_ip_address()
    )


def dataset_setting(cfg: TrainConfig, storage_key: str = "run.storage_path") -> tuple[str, str]:
    """The prepared dataset's path, and the setting that places it: ``data.path``, else the storage path's."""
    return ("data.path" if cfg.data.path else storage_key), dataset_path(cfg)


def _nodes_not_seeing(folder: str, nodes: dict[str, str]) -> list[str]:
    """The addresses of ``nodes`` (id -> address) that do not see a file put in ``folder``; none where it cannot
    be written (a dataset on read-only storage: nothing to tell by)."""
    marker = os.path.join(folder, f".raywright-shared-check-{uuid.uuid4().hex}")
    try:
        open(marker, "x").close()
    except OSError:
        return []
    try:
        asked = {
            _sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(marker): node
            for node in nodes
        }
        answered, unanswered = ray.wait(list(asked), num_returns=len(asked), timeout=ANSWER_TIMEOUT_S)
        for ref in unanswered:
            ray.cancel(ref, force=True)
        return sorted({nodes[asked[ref]] for ref in answered if _answer(ref) is False})
    finally:
        os.unlink(marker)


def _answer(ref: ray.ObjectRef) -> bool | None:
    """What a node answered; None where it went away meanwhile (not judged)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None
