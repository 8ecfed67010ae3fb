"""Where a run's weights come from: the dataset, the corpus and the code.

The driver hands it to every worker (``LoopArgs``); each checkpoint (``RunRecord``) and each export
(``ExportProvenance``) records it. It loads neither torch nor DeepSpeed: Ray Train's controller reads it too.
"""

from train.schema import Section


class Provenance(Section):
    """The identities of what trained a run's weights."""

    data_manifest_sha256: str  # the prepared dataset's identity (``Manifest.sha256``)
    # The next two came on 2026-11-25: a checkpoint from before, and an export of one, have neither.
    data_source_sha256: str | None = None  # the corpus's, whatever the order of its documents
    code_version: str | None = None  # the git commit of the checkout, else the package version
