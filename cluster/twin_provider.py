"""The local twin's node provider: Ray's fake_multinode, with each node's runtime_env files on its own.

Ray's fake nodes share one session folder, so their runtime_env agents unpack a job's working_dir into
one place. In Ray 2.60 an agent's first use of a working_dir deletes and re-unpacks that folder
(``WorkingDirPlugin.create`` passes ``overwrite=True``), so a node that joined deleted the code under the
workers another node was starting (seen as "oneMKL FATAL ERROR: Cannot load libtorch_cpu.so", a Train
worker group restart, and an extra node). A cloud node keeps these files on its own disk; here each fake
node gets its own folder for them.

They share the session's logs folder too, which the head's log monitor reads whole: as Ray's own
``cluster_utils.Cluster`` does, a fake node starts none of its own (one more printed every line of the workers
on the twin twice, in a job's logs and at a driver).
"""

import itertools

from ray._private import node as ray_node
from ray._private import ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

SHARED_DIR_NAME = ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME
RAY_NODE = ray_node.Node


def _node_without_log_monitor(ray_params, **kwargs) -> ray_node.Node:
    ray_params.include_log_monitor = False
    return RAY_NODE(ray_params, **kwargs)


class TwinNodeProvider(FakeMultiNodeProvider):
    def __init__(self, provider_config: dict, cluster_name: str):
        super().__init__(provider_config, cluster_name)
        self._node_numbers = itertools.count(1)

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        # The base method builds the fake node's RayParams, which take the folder's name from this constant, and
        # starts it as a Node. The autoscaler launches nodes from several threads: self.lock (an RLock, taken
        # again inside) keeps both in place until the node has started.
        with self.lock:
            ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME = f"{SHARED_DIR_NAME}_node{next(self._node_numbers)}"
            ray_node.Node = _node_without_log_monitor
            try:
                super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
            finally:
                ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME = SHARED_DIR_NAME
                ray_node.Node = RAY_NODE
