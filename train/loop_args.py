"""What the driver hands each training worker: Ray Train's ``train_loop_config``.

On the wire it is a plain dict (Ray keeps it in its state and shows it on its dashboard); both ends read it
as ``LoopArgs``. It loads neither torch nor DeepSpeed: Ray Train's controller reads it too.
"""

from typing import Any

from train.config import TrainConfig
from train.provenance import Provenance
from train.schema import Section


class SharedFolder(Section):
    """A local folder that every worker must see as the driver does: on a Ray cluster of several machines, one
    they all mount. Workers on a node that joined after the driver asked (an autoscaler's) check it themselves."""

    setting: str  # the config key that places it
    path: str  # as that setting gives it
    file: str  # absolute: a file the driver holds there while the workers run (a run's lease, a sweep's settings)
    driver_ip: str


class LoopArgs(Section):
    """A run's settings for ``train_loop`` on every worker."""

    config: TrainConfig
    run_uri: str
    data_path: str  # the prepared dataset, absolute
    timeline: str | None  # the name of the RunTimeline actor rank 0 reports to; None: no timeline (a sweep trial)
    tokens_per_byte: float  # of the dataset, end-of-text tokens included: for bits per byte
    provenance: Provenance
    shared_folder: SharedFolder | None = None  # None: object storage (or a caller that holds no file there)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
