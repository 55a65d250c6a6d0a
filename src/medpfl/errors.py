"""The project's exception classes, in one module that imports nothing of the project.

Any module can raise or catch them without importing the module that raises them (and so
without its dependencies): ``medpfl.cli`` names them all for its one-line error report, the
method registry raises :class:`ParamsError` without importing ``medpfl.config``. Each is still
importable from the module that defined it before (``medpfl.config.ParamsError``,
``medpfl.data.partition.PartitionError``, ...).
"""

from __future__ import annotations


class ParamsError(ValueError):
    """A parameter file or value is invalid; the message names the file and the dotted key."""


class DataError(ValueError):
    """A data file is missing, corrupt or inconsistent; the message names the file."""


class PartitionError(ValueError):
    """The partition cannot be built with these parameters; the message names the key."""


class TableError(ValueError):
    """A table failed its schema; the message names the file and the failing checks."""


class InputFileError(ValueError):
    """An input file that exists but is not what the stage reading it expects (not valid JSON,
    unreadable parquet or CSV, a missing key or column); the message names the file and says
    how to recover. ``medpfl`` commands report it in one line and exit 2."""


class PaperTableError(ValueError):
    """A paper table file (``report.paper_table``) is missing, not YAML or not of the schema; the
    message names the file and the offending key."""


class DivergenceError(RuntimeError):
    """A run's model or state became non-finite (NaN or ±inf): training has diverged, usually
    because the learning rate is too large. Raised by :meth:`medpfl.fl.engine.Engine.run` in the
    round it happens, before that round is logged or checkpointed; the message names the method,
    the round, the first non-finite leaf (or the linear-algebra routine that met one, e.g. the SVD
    of FedKD's or FedMIC's low-rank upload) and what to change."""


class UploadSpecError(RuntimeError):
    """A client tried to send the server something other than what its method declares.

    The upload check enforces the declared keys, structure and shapes: what kind of tensor a
    method may send (so raw images, labels or per-sample tensors cannot pass). It is not a
    privacy guarantee: it does not bound what the declared values reveal about a client's data
    (no clipping, noise or accounting; a method with differential privacy says so itself)."""


class MissingWeightsError(RuntimeError):
    """A pretrained checkpoint is not in the local cache and cannot be downloaded."""


class TrackingError(RuntimeError):
    """The MLflow store cannot be reached or written; the message names the URI."""


class TrackingServerError(TrackingError):
    """``medpfl tracking-server`` cannot start, stop or read a tracking server
    (:mod:`medpfl.tracking_server`): a port in use, PostgreSQL missing, a folder not writable, a
    server that does not come up; the message names the folder, port or program."""


class PostgresUnavailable(TrackingServerError):
    """PostgreSQL cannot run here: its programs are missing (the message names the Debian
    package), ``initdb`` or ``pg_ctl start`` fails, or the ``postgres`` user cannot reach the folder."""


class GpuError(RuntimeError):
    """No GPU could be assigned to a training job (:mod:`medpfl.gpus`): a malformed
    ``MEDPFL_GPUS`` or ``MEDPFL_GPU_WAIT``, or every GPU still locked by other jobs when the wait
    ran out; the message names the variable or the lock folder."""


class DeploymentError(RuntimeError):
    """A deployed run (``medpfl.deploy``) cannot go on: a client held by no site or by two, sites
    that disagree on the data, a site that failed a request, a site process that did not start."""


#: what ``medpfl`` commands report in one line (exit status 2) instead of a traceback
#: (:func:`medpfl.cli.known_errors` adds the standard library's)
PROJECT_ERRORS = (ParamsError, DataError, PartitionError, TableError, TrackingError, DivergenceError, PaperTableError,
                  InputFileError, MissingWeightsError, GpuError, DeploymentError)

