"""The params schema: one pydantic model for ``params.yaml`` and the study overlays in ``config/``.

Every section forbids unknown keys, so a typo such as ``train.particpation`` fails at once with
the key's dotted name instead of silently keeping a default. Per-method hyper-parameters are
validated by each algorithm's own ``Config`` model (see :mod:`medpfl.algorithms`).

This module is schemas only: it imports no other part of the project but :mod:`medpfl.errors`.
The checks that need the rest of the project (the model zoo's names and arguments, the data-set
catalogue, the method registry, which methods a server optimizer or an upload transform can run
with) are asked of a :class:`Catalogue` passed as pydantic's validation context,
``{"catalogue": ...}``, at the very place of the schema they always ran at, so their errors name
the same keys. :mod:`medpfl.compose` holds the project's catalogue and is where params are read
for the pipeline and the CLI (``medpfl.compose.load_params`` / ``validate_params``). Validated
without a catalogue (``Params.model_validate(data)``), a params mapping is checked against the
schema alone.

Errors: :class:`ParamsError` (a ``ValueError``, :mod:`medpfl.errors`) whose message names the
file and the dotted key.
"""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError,
                      ValidationInfo, field_validator, model_serializer, model_validator)

from medpfl.errors import ParamsError

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$"
#: ``<data set><GENERATED_SUFFIX><generator seed>``: the files of a generated data set drawn with
#: another generator seed for a run seed (``data.synthetic.<name>.seed_per_run``, Params.data_name).
GENERATED_SUFFIX = ".gen"


class Catalogue(Protocol):
    """What validating params needs to know of the rest of the project; the project's is
    :data:`medpfl.compose.CATALOGUE`. Each check raises ``ValueError`` (or :class:`ParamsError`,
    one) with a message relative to the key it is asked about."""

    def check_model_name(self, name: str) -> str:
        """``name`` if it is a model of the zoo (``train.model``)."""

    def resolve_model_args(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        """The model's validated arguments with every default filled in (``train.model_args``)."""

    def check_dataset_name(self, name: str) -> None:
        """Raises unless ``name`` is a known data set (MedMNIST, MNIST, CIFAR, synthetic)."""

    def is_synthetic_name(self, name: str) -> bool:
        """``name`` is a generated ``synthetic_<alpha>_<beta>`` data set's."""

    def folder_dataset_kind(self, name: str) -> str | None:
        """The sample kind (``tokens``, ``timeseries``, ``waveform``) of a folder data set of the
        registry (:mod:`medpfl.data.multimodal`), or None when ``name`` is not one."""

    def resolve_method(self, name: str, method_params: dict[str, Any]) -> tuple[type, BaseModel]:
        """``(algorithm class, validated method config)`` of a method name (raises naming ``methods``
        or ``method_params.<name>.<key>``)."""

    def check_server_optimizer(self, method: str, algo_cls: type, cfg: BaseModel, key: str, optimizer: str) -> None:
        """Raises, naming ``key``, when server optimizer ``optimizer`` cannot run with the method."""

    def check_upload(self, method: str, algo_cls: type, key: str) -> None:
        """Raises, naming ``key`` (``train.dp`` or ``train.upload``), when the method cannot take it."""


def catalogue_of(info: ValidationInfo) -> Catalogue | None:
    """The :class:`Catalogue` a validation was given (``context={"catalogue": ...}``), or None."""
    return info.context.get("catalogue") if isinstance(info.context, dict) else None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalTestConfig(_Strict):
    """How each client's data is split into local train and local test.

    rule:
      ``stratified``: per class, ``fraction * n_kc`` rounded half up (``floor(fraction * n_kc
      + 1/2)``, exact on the decimal value of ``fraction``: 0.25 of a class of 2 is 1 test
      sample, of 6 is 2, of 10 is 3) go to test; a client whose classes all round to 0 gives one
      sample of its largest class (at least one test sample per client).
      ``random``: a uniformly random ``max(1, int(fraction * n_k))`` of the client's samples.
      ``fedkper``: the FedKPer authors' class-balanced rule (``create_local`` in
      olivesgatech/FedKPer ``datasetter.py``, as read in ``../shared/docs/fedkper-protocol.md``
      §2; ``docs/methods.md``): ``int(fraction*n_k)/|classes|`` per present class,
      ``int(fraction*n_kc)`` where a class is too small.
      ``ordered``: no draw: the first ``int((1 - fraction) * n_k)`` samples of the client, in
      the client's (already shuffled) order, are local train and the rest local test (the
      pFedKD-WCL code's ``split = int(0.75 * len(X))``; the default of ``per_client_dirichlet``).
      ``official_test``: the client's whole share of the train pool is its local train split,
      and its local test split is drawn from the data set's OFFICIAL TEST split in proportion
      to its training class distribution (the PFPS-LWC spec's reading, B.4): per class c, the
      test samples of c are shuffled and cut among the clients in proportion to their numbers
      of class-c training samples (largest remainder: the shares sum to the class's test count;
      a client without class-c training samples gets none). The clients' local test sets then
      partition the official test set (a class absent from the train pool is left out);
      ``fraction`` does not apply. The global test set is still the whole official test split.
      ``ratios``: a three-way split into local **train, test and val** by ``ratios = [r_train,
      r_test, r_val]`` (summing to 1), per class c of the client: with ``rounding: floor`` (the
      default) the first ``floor(r_train * n_kc)`` of the client's class-c samples (in the
      client's order) are train, the next ``floor(r_test * n_kc)`` test and the remainder val
      (the FHBench code's ``define_val_dataset``, 4:3:3: a class of 10 gives 4/3/3, of 7 gives
      2/2/3; ``../shared/docs/methods-pfedkdwcl-epfl.md`` B.4, C.14). The products are exact on
      the decimal value of each ratio (the code's float ``int(0.4 * n)`` and ``int(0.3 * n)``
      agree with it for every n up to 200,000; ``int(0.7 * 90)`` in floats would be 62).
      ``rounding: nearest`` instead gives each part its largest-remainder share of n_kc (ties to
      the earlier part: train, then test), an OPTION for FedMIC's 7:2:1, whose paper states no
      rounding (``../shared/docs/methods-fedmic-pfpslwc.md`` A.10: "train : test : val = 7 : 2
      : 1", "stratified by class where possible"); with floor a class of 4 at 7:2:1 gives
      2/0/2, with nearest 3/1/0. ``fraction`` does not apply. A client whose classes give no
      test (or no train) sample stops the partition naming the key; an empty val is allowed.
    """

    fraction: float = Field(0.2, gt=0.0, lt=1.0)
    rule: Literal["stratified", "random", "fedkper", "ordered", "official_test", "ratios"] = "stratified"
    ratios: list[float] | None = Field(None, validate_default=True,
                                       description="rule ratios: [train, test, val] shares, summing to 1")
    rounding: Literal["floor", "nearest"] = Field("floor", description="rule ratios: floor (FHBench code: "
                                                                       "int() for train and test, the rest "
                                                                       "val) or nearest (largest remainder)")

    @field_validator("ratios")
    @classmethod
    def _ratios(cls, v: list[float] | None, info) -> list[float] | None:
        rule = info.data.get("rule")
        if v is None:
            if rule == "ratios":
                raise ValueError("is required for rule: ratios ([train, test, val], e.g. [0.4, 0.3, 0.3])")
            return v
        if rule != "ratios":
            raise ValueError(f"applies to rule: ratios only (rule is {rule!r}); remove it or set rule: ratios")
        if len(v) != 3:
            raise ValueError(f"must be three shares [train, test, val], got {v}")
        if any(not (r >= 0) for r in v):
            raise ValueError(f"shares must be >= 0, got {v}")
        if not v[0] > 0 or not v[1] > 0:
            raise ValueError(f"the train and test shares must be > 0, got {v}")
        if abs(float(sum(Fraction(repr(float(r))) for r in v)) - 1.0) > 1e-9:
            raise ValueError(f"must sum to 1, got {v} (sum {sum(v)!r})")
        return [float(r) for r in v]

    @model_serializer(mode="wrap")
    def _drop_later_defaults(self, handler):
        """``ratios`` and ``rounding`` (added after partitions existed) are not dumped unless the
        rule uses them, so existing job descriptions and ``client_stats.json`` stay as they were."""
        out = handler(self)
        if isinstance(out, dict):
            if out.get("ratios") is None:
                out.pop("ratios", None)
            if out.get("rounding") == "floor":
                out.pop("rounding", None)
        return out


class ServerDataConfig(_Strict):
    """Unlabeled data held by the server (FedBE's distillation set), drawn from the data set's
    official **validation** split and kept out of every client.

    Exactly one of ``fraction`` (in (0, 1]: ``floor(fraction * N_val)`` samples, exact on the
    decimal value) and ``count`` (a number of samples, at most N_val). The draw is
    ``choice(N_val, m, replace=False)`` from its own ``RandomState`` seeded with ``[seed, 1]``
    (the partition's seed; ``init_by_array``), so the clients' draws are those of the same
    partition without server data when the pool is the train split; with ``pool: all`` the
    drawn samples are removed from the pool before ``data_fraction`` and the partitioner run.
    The rows are stored in the partition table with ``client_id = -1`` and ``local_split =
    "server"``; their labels are kept in the table (statistics) but never reach a method: the
    server sees the images only (``docs/contract.md``, server data)."""

    source: Literal["val"] = Field("val", description="the official split the server data come from (only val: "
                                                      "train belongs to the clients, test is the global test set)")
    fraction: float | None = Field(None, gt=0.0, le=1.0, description="share of the val split held by the server")
    count: int | None = Field(None, ge=1, description="number of val samples held by the server")

    @model_validator(mode="after")
    def _one_size(self) -> "ServerDataConfig":
        if (self.fraction is None) == (self.count is None):
            raise ValueError("give exactly one of fraction (a share of the val split) or count (a number of samples)")
        return self


class PartitionConfigBase(_Strict):
    """The keys every partition scheme takes; one subclass per scheme (:data:`PartitionConfig`).

    A ``partitions`` entry is validated by the class of its ``scheme`` (default ``dirichlet``),
    and a key that class does not declare is rejected, the error naming the scheme and the key
    (:func:`format_validation_error`). The partitioner of each scheme is in
    :mod:`medpfl.data.partition` (``PARTITIONERS``); this module holds the schemas only.

    server_data:
      null (default): none. ``{source: val, fraction: f}`` or ``{source: val, count: m}``:
      unlabeled server data (FedBE's distillation set) held out of the official val split
      (:class:`ServerDataConfig`); with ``pool: all`` they are removed from the pool first. A
      data set without a val split stops the partition naming the key.

    :meth:`job_dict` is the partition's job description (the partition rule's ``params``):
    the flat mapping the single ``PartitionConfig`` model dumped before the schemes had their
    own classes, kept byte for byte so that Snakemake does not re-run existing partitions (and,
    by modification time, every training job after them).
    """

    scheme: str
    num_clients: int = Field(20, ge=1, description="number of clients K (default 20: the FedKPer paper's "
                                                   "BloodMNIST setting)")
    seed: int = Field(1, description="partition seed, fixed across training seeds (default 1: the FedKPer authors' "
                                     "code builds its partition once, with seed 1; fedkper-protocol.md §2)")
    datasets: list[str] | None = Field(None, description="the data sets this partition applies to (those of "
                                                         "data.datasets among them); null (default) = all")
    server_data: ServerDataConfig | None = Field(None, description="unlabeled server data held out of the val "
                                                                   "split (FedBE); null (default) = none")

    @classmethod
    def scheme_keys(cls) -> list[str]:
        """The keys a ``partitions`` entry of this scheme takes besides ``name`` and ``scheme``,
        in declaration order (``alpha`` of the schemes that only tolerate ``alpha: null`` left out)."""
        return [k for k in cls.model_fields if k != "scheme" and not (k == "alpha" and issubclass(cls, _NoAlpha))]

    def job_dict(self) -> dict[str, Any]:
        """The partition's job description: the keys and values the flat ``PartitionConfig``
        (one model for every scheme, before this module had one class per scheme) dumped, so
        that the partition rule's description (:func:`partition_job`), ``client_stats.json``
        (which copies it) and the report rule's study description (:meth:`Params.study_dict`)
        stay byte-identical for every config that was valid then, and Snakemake re-runs nothing.

        Keys in :data:`LEGACY_JOB_KEYS` order: the scheme's own values, and for a key the scheme
        does not take, the flat model's default (``alpha`` stays null where the config wrote
        ``alpha: null``, the one foreign key still accepted). Keys added after partitions
        existed (:data:`LATER_JOB_KEYS`) are left out at their default, as the flat model's
        serializer did; a key added to a scheme from now on is written only when it is not at
        its default, so that adding it re-runs nothing. Read back by
        :func:`partition_from_job`."""
        own = self.model_dump()
        out: dict[str, Any] = {}
        for key, default in LEGACY_JOB_KEYS.items():
            value = own[key] if key in own else default
            if key in LATER_JOB_KEYS and value == LATER_JOB_KEYS[key]:
                continue
            out[key] = value
        for key, value in own.items():
            if key not in out and key not in LEGACY_JOB_KEYS:
                default = type(self).model_fields[key].get_default(call_default_factory=True)
                if value != (default.model_dump() if isinstance(default, BaseModel) else default):
                    out[key] = value
        return out


class DrawnPartitionConfig(PartitionConfigBase):
    """The keys of every scheme that draws its clients from a pool (all but ``natural``).

    pool:
      ``train`` (default): the official train split is partitioned; the official test split is
      the global test set. ``all``: the official train, test and val splits are merged, in that
      order (the FHBench code's concatenation, ``ViT_Lora/datautil/prepare_data.py``) and
      partitioned (FHBench; FedMIC's reading, ``methods-fedmic-pfpslwc.md`` A.10): every
      sample may go to a client, so there is **no global test set** (the training stage scores
      local splits only; global-test columns read "not applicable"). Not with
      ``local_test.rule: official_test``.

    data_fraction:
      in (0, 1]; below 1, a random ``floor(data_fraction * N)`` of the pool (after ``pool``)
      is drawn first, without replacement, with the partition's seeded RandomState (``choice(N,
      m, replace=False)``, kept in the drawn order, as FHBench's ``datapercent``: 0.2 for
      OrganA/C/S), and only it is partitioned. The partition draws continue from the same
      RandomState. 1.0 (default) draws nothing.

    local_test: each client's split into local train and test (and val): :class:`LocalTestConfig`.
    """

    pool: Literal["train", "all"] = Field("train", description="train (default, as the FedKPer paper): the official "
                                                               "train split, the official test split being the "
                                                               "global test set; all: train, test and val merged "
                                                               "(FHBench, FedMIC; no global test set)")
    data_fraction: float = Field(1.0, gt=0.0, le=1.0, description="share of the pool drawn (seeded) before "
                                                                  "partitioning (default 1: all; FHBench's "
                                                                  "datapercent: 0.2)")
    local_test: LocalTestConfig = Field(LocalTestConfig(), description="the local split (default: rule stratified, "
                                                                       "ours; fraction 0.2, the FedKPer authors' "
                                                                       "create_local(amount=0.20))")

    @model_validator(mode="after")
    def _pool(self) -> "DrawnPartitionConfig":
        if self.pool == "all" and self.local_test.rule == "official_test":
            raise ValueError("local_test.rule: official_test draws local test splits from the official test split, "
                             "which pool: all merges into the partitioned pool; choose one of them")
        return self


class _DirichletAlpha(_Strict):
    """The ``alpha`` checks of the schemes with a Dirichlet draw (each declares the field with
    its own default and source): null (before type coercion) and anything not > 0, NaN
    included (after it), are rejected naming the scheme, as the flat model did."""

    @field_validator("alpha", mode="before", check_fields=False)
    @classmethod
    def _alpha_not_null(cls, v: Any) -> Any:
        if v is None:
            raise ValueError(f"must be > 0 for the {cls.model_fields['scheme'].default} scheme, got None")
        return v

    @field_validator("alpha", check_fields=False)
    @classmethod
    def _alpha_positive(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"must be > 0 for the {cls.model_fields['scheme'].default} scheme, got {v}")
        return v


class _NoAlpha(_Strict):
    """``alpha: null`` on a scheme without a Dirichlet draw (iid, pathological, shards,
    natural): accepted and ignored, because configs written while one flat model served every
    scheme set it to say "not applicable" (``config/pfedkd-synthetic.yaml``); the job
    description keeps the null they gave (:meth:`PartitionConfigBase.job_dict`). Any other
    value is rejected: the scheme draws no Dirichlet proportions."""

    alpha: None = Field(None, description="not used by this scheme; only null is accepted (configs written "
                                          "before the schemes had their own keys)")

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha_null(cls, v: Any) -> None:
        if v is not None:
            scheme = cls.model_fields["scheme"].default
            raise ValueError(f"the {scheme} scheme takes no alpha (it draws no Dirichlet proportions); remove "
                             "the key (alpha: null is accepted, as written before the schemes had their own keys)")
        return v

    @model_serializer(mode="wrap")
    def _alpha_if_given(self, handler):
        """``alpha`` is dumped only when the config gave it (as null), so a dump validates back
        to the same config and the same :meth:`job_dict`."""
        out = handler(self)
        if isinstance(out, dict) and "alpha" not in self.model_fields_set:
            out.pop("alpha", None)
        return out


class DirichletPartitionConfig(DrawnPartitionConfig, _DirichletAlpha):
    """``scheme: dirichlet`` (the default): per class, proportions over clients drawn from
    Dir(alpha * 1_K) (Hsu et al. 2019; NIID-Bench "hetero-dir"; the FedKPer authors' code,
    ``../shared/docs/fedkper-protocol.md`` §2). ``self_balancing`` stops giving samples to a
    client that already holds >= N/K samples (the FedKPer/MOON variant); the draw is repeated
    until every client holds at least ``min_samples``, at most ``max_draws`` times.
    Partitioner: :class:`medpfl.data.partition.DirichletPartitioner`."""

    scheme: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.1, validate_default=True,
                         description="Dirichlet concentration, > 0; smaller = more label skew (default 0.1: the "
                                     "FedKPer paper's Dir(0.1))")
    self_balancing: bool = Field(True, description="zero the share of a client already holding >= N/K samples "
                                                   "(default true: the FedKPer and MOON code)")
    min_samples: int = Field(10, ge=1, description="redraw until every client holds at least this many (default "
                                                   "10: the FedKPer/MOON code's min_require_size)")
    max_draws: int = Field(1000, ge=1, description="redraws before the partition stops with an error (default "
                                                   "1000: ours; the FedKPer code loops until it succeeds)")


class IIDPartitionConfig(DrawnPartitionConfig, _NoAlpha):
    """``scheme: iid``: a uniform random split of the pool into K parts whose sizes differ by
    at most one. Partitioner: :class:`medpfl.data.partition.IIDPartitioner`."""

    scheme: Literal["iid"] = "iid"
    min_samples: int = Field(10, ge=1, description="the partition stops when a client would hold fewer (default "
                                                   "10: the dirichlet scheme's, the FedKPer/MOON code's "
                                                   "min_require_size)")


class PathologicalPartitionConfig(DrawnPartitionConfig, _NoAlpha):
    """``scheme: pathological``: every client holds exactly ``classes_per_client`` classes,
    dealt round-robin over a shuffled class order; each class is split evenly among its
    holders (the PFPS-LWC spec's OPTION for its pathological partition,
    ``../shared/docs/methods-fedmic-pfpslwc.md`` B.4). Partitioner:
    :class:`medpfl.data.partition.PathologicalPartitioner`."""

    scheme: Literal["pathological"] = "pathological"
    classes_per_client: int | None = Field(None, ge=1, validate_default=True,
                                           description="classes per client (required; no default)")
    min_samples: int = Field(10, ge=1, description="the partition stops when a client would hold fewer (default "
                                                   "10: the dirichlet scheme's, the FedKPer/MOON code's "
                                                   "min_require_size)")

    @field_validator("classes_per_client")
    @classmethod
    def _cpc(cls, v: int | None) -> int | None:
        if v is None:
            raise ValueError("is required for the pathological scheme")
        return v


class ShardsPartitionConfig(DrawnPartitionConfig, _NoAlpha):
    """``scheme: shards``: McMahan et al. 2017's shards (the PFPS-LWC spec's READING, B.4): the
    pool, sorted by label (random order within a class), is cut into ``num_clients *
    shards_per_client`` shards and each client gets ``shards_per_client`` random ones, so it
    holds at most ``shards_per_client`` classes. Shards never straddle two classes: each class
    is cut into its own shards (sizes differing by at most one), the shard counts per class as
    equal in shard size as possible (one shard per class at least); when every class size is a
    multiple of the shard size (CIFAR-10, 10 clients x 5) this is exactly cutting the sorted
    pool into equal shards. Needs ``num_classes <= num_clients * shards_per_client <= pool
    size``. Partitioner: :class:`medpfl.data.partition.ShardsPartitioner`."""

    scheme: Literal["shards"] = "shards"
    shards_per_client: int | None = Field(None, ge=1, validate_default=True,
                                          description="shards per client, so the client holds at most this many "
                                                      "classes (required; no default)")
    min_samples: int = Field(10, ge=1, description="the partition stops when a client would hold fewer (default "
                                                   "10: the dirichlet scheme's, the FedKPer/MOON code's "
                                                   "min_require_size)")

    @field_validator("shards_per_client")
    @classmethod
    def _spc(cls, v: int | None) -> int | None:
        if v is None:
            raise ValueError("is required for the shards scheme")
        return v


class SubjectPartitionConfig(DrawnPartitionConfig, _NoAlpha):
    """``scheme: subject``: FHBench's "natural" partition of its EEG, ECG and audio sets
    (``../shared/docs/methods-pfedkdwcl-epfl.md`` B, "Partitioning": "natural: by patient or
    recording-session ID, for ADFTD, PTB-XL, ICBHI and SPRSound"): whole subjects (the sample
    table's ``subject_id``) are assigned to clients, so no subject is in two clients; each
    client's samples are then split by ``local_test`` as in every drawn scheme. The paper gives
    no assignment rule (its code has none: every reported run uses Dirichlet 0.1), so ours:

    - ``assign: balanced`` (default): the subjects in a seeded random order
      (``rng.permutation``), each to the client holding the fewest samples so far (ties: the
      lowest client id), so client sizes differ by at most about one subject's samples;
    - ``assign: round_robin``: the same seeded order dealt round-robin (subject i of the
      permutation to client i mod K), equal subject counts, sizes as the subjects come.

    Needs at least ``num_clients`` subjects; the partition stops when a client holds fewer than
    ``min_samples``. ``pool`` and ``data_fraction`` apply as in every drawn scheme (the fraction
    drops samples, never moves a subject). Partitioner:
    :class:`medpfl.data.partition.SubjectPartitioner`."""

    scheme: Literal["subject"] = "subject"
    assign: Literal["balanced", "round_robin"] = Field(
        "balanced", description="balanced (default, ours): subjects in a seeded order, each to the client with the "
                                "fewest samples; round_robin: the seeded order dealt round-robin")
    min_samples: int = Field(10, ge=1, description="the partition stops when a client would hold fewer (default "
                                                   "10: the dirichlet scheme's)")


class PerClientDirichletPartitionConfig(DrawnPartitionConfig, _DirichletAlpha):
    """``scheme: per_client_dirichlet``: the pFedKD-WCL partition (Hsu et al. 2019 per-client
    Dirichlet; HengruiH/pFedKD ``utils/MNIST_dirichlet.py``): client k holds
    ``linspace(size_start, size_stop, K, dtype=int)[k]`` samples whose class proportions are its
    own draw ``q_k ~ Dir(alpha * 1_C)`` (optionally cut to its ``top_k`` largest), sampled per
    client from the whole pool, so **clients may share samples**; ``clustered`` is the code's
    other variant (``load_mnist_clustered``: ``n_clusters`` groups of clients, each group
    drawing from one random pair of classes). Its local split defaults to ``ordered`` with
    fraction 0.25 (the code's first 75 % train). Partitioner:
    :class:`medpfl.data.partition.PerClientDirichletPartitioner`."""

    scheme: Literal["per_client_dirichlet"] = "per_client_dirichlet"
    alpha: float = Field(0.1, validate_default=True,
                         description="concentration of each client's Dir(alpha * 1_C), > 0 (default 0.1, shared "
                                     "with the dirichlet scheme; the pFedKD-WCL paper runs 0.5 and 0.05)")
    size_start: int = Field(1165, ge=1, description="size of client 0 (linspace start; default 1165: HengruiH/pFedKD "
                                                    "MNIST_dirichlet.py)")
    size_stop: int = Field(3834, ge=1, description="size of client K-1 (linspace stop; default 3834: HengruiH/pFedKD "
                                                   "MNIST_dirichlet.py)")
    top_k: int | None = Field(None, ge=1, description="keep each client's top_k largest proportions and renormalise; "
                                                      "null (default) = no truncation (the code's top-2 runs: 2)")
    clustered: bool = Field(False, description="the code's load_mnist_clustered variant (default false: "
                                               "MNIST_dirichlet.py)")
    n_clusters: int | None = Field(None, ge=1, description="with clustered: number of client groups, each sharing "
                                                           "one random pair of classes (required then; no default)")
    local_test: LocalTestConfig = Field(LocalTestConfig(fraction=0.25, rule="ordered"),
                                        description="the local split (default: ordered, fraction 0.25: the "
                                                    "pFedKD-WCL code's split = int(0.75 * len(X)), first 75 % train)")

    @model_validator(mode="after")
    def _per_client(self) -> "PerClientDirichletPartitionConfig":
        if self.size_stop < self.size_start:
            raise ValueError(f"size_stop={self.size_stop} is below size_start={self.size_start}; client sizes are "
                             "linspace(size_start, size_stop, num_clients)")
        if self.clustered:
            if self.n_clusters is None:
                raise ValueError("n_clusters is required when clustered is true")
            if self.num_clients % self.n_clusters:
                raise ValueError(f"num_clients={self.num_clients} must be a multiple of n_clusters={self.n_clusters} "
                                 "(every cluster holds num_clients / n_clusters clients)")
            if self.top_k is not None:
                raise ValueError("top_k does not apply to clustered (each cluster holds exactly two classes); "
                                 "set one of them")
        return self


class DirichletPairsPartitionConfig(DrawnPartitionConfig, _DirichletAlpha):
    """``scheme: dirichlet_pairs``: FHBench's partitioner (``build_non_iid_by_dirichlet`` of
    epfml/quasi-global-momentum as used in microsoft/PersonalizedFL and wph6/FHBench;
    ``../shared/docs/methods-pfedkdwcl-epfl.md`` B.4, C.14). **Not** the usual global per-class
    Dir(alpha * 1_K): the pool is shuffled and cut into ``ceil(K/2)`` contiguous chunks of
    ``int(2/K * N)`` samples (the last chunk takes the rest); chunk j belongs to clients 2j and
    2j+1 (with an odd K the last chunk to the last client alone). Within a chunk, per class,
    proportions ``Dir(alpha, alpha)`` split the class between the pair, zeroing a client that
    already holds >= chunk/2 samples; the draw of the whole chunk is repeated until both hold at
    least ``int(0.5 * chunk / 2)`` (at most ``max_draws`` times). Label skew is therefore between
    the two clients of a pair, each client's data comes from its pair's chunk only, and every
    pair has about the same class mix (that of the pool). ``pair_sizes: equal`` (default, the
    code) then concatenates the drawn client lists (each grouped by class) and cuts them into K
    equal blocks of ``int(N / K)`` samples, so every client holds exactly ``int(N / K)`` samples
    and the last ``N - K * int(N / K)`` (< K) samples are left out; a block may straddle two
    drawn lists (the second client of a pair takes the first's highest classes beyond ``int(N /
    K)``), and where ``int(2N/K) != 2 int(N/K)`` the blocks drift from the chunks by one sample
    per pair. ``pair_sizes: drawn`` keeps the drawn lists as the clients (sizes between about
    0.5 and 1.5 N/K; no sample left out). Each client's samples are listed in pool order (the
    code re-enumerates a client's samples in data-set order before its local split). Usually
    with ``local_test: {rule: ratios, ratios: [0.4, 0.3, 0.3]}``, ``pool: all`` and
    ``data_fraction`` (FHBench's OrganA/C/S: 0.2). Partitioner:
    :class:`medpfl.data.partition.PairwiseDirichletPartitioner`."""

    scheme: Literal["dirichlet_pairs"] = "dirichlet_pairs"
    alpha: float = Field(0.1, validate_default=True,
                         description="concentration of each pair's Dir(alpha, alpha), > 0 (default 0.1: FHBench's "
                                     "image setting)")
    max_draws: int = Field(1000, ge=1, description="redraws of a chunk before the partition stops with an error "
                                                   "(default 1000: ours; the FHBench code loops forever)")
    pair_sizes: Literal["equal", "drawn"] = Field("equal", description="equal (default: the FHBench code's "
                                                                       "DataPartitioner, K equal blocks of "
                                                                       "int(N/K)) or drawn (the Dirichlet lists "
                                                                       "as drawn)")

    @model_validator(mode="after")
    def _pairs(self) -> "DirichletPairsPartitionConfig":
        if self.num_clients < 2:
            raise ValueError(f"num_clients={self.num_clients}: dirichlet_pairs needs at least 2 clients (one pair)")
        return self


class NaturalPartitionConfig(PartitionConfigBase, _NoAlpha):
    """``scheme: natural``: the data set's own clients and local splits (a generated federated
    data set such as ``synthetic_0.5_0.5``); nothing is drawn. ``num_clients`` must equal the
    data set's client count. ``pool``, ``data_fraction`` and ``local_test`` do not apply (the
    data set's clients and splits are used as they are) and are rejected as keys; the
    properties below answer for them. Partitioner:
    :class:`medpfl.data.partition.NaturalPartitioner`."""

    scheme: Literal["natural"] = "natural"

    @property
    def pool(self) -> Literal["train"]:
        """Always the train split (a generated federated set has no other)."""
        return "train"

    @property
    def data_fraction(self) -> float:
        """Always 1.0: every sample of the data set's clients."""
        return 1.0

    @property
    def local_test(self) -> None:
        """None: the data set's own local splits are used."""
        return None


#: One config class per scheme, by scheme name (the tags of :data:`PartitionConfig`).
PARTITION_CONFIGS: dict[str, type[PartitionConfigBase]] = {
    cls.model_fields["scheme"].default: cls
    for cls in (DirichletPartitionConfig, IIDPartitionConfig, PathologicalPartitionConfig, ShardsPartitionConfig,
                PerClientDirichletPartitionConfig, NaturalPartitionConfig, DirichletPairsPartitionConfig,
                SubjectPartitionConfig)
}

#: The keys of the flat partition model every scheme shared before they had their own classes,
#: in its field order, with its defaults (the value a scheme without the key dumped), as
#: :meth:`PartitionConfigBase.job_dict` writes them. Frozen: existing job descriptions depend on it.
LEGACY_JOB_KEYS: dict[str, Any] = {
    "scheme": "dirichlet", "num_clients": 20, "alpha": 0.1, "self_balancing": True, "min_samples": 10,
    "max_draws": 1000, "classes_per_client": None, "shards_per_client": None, "size_start": 1165, "size_stop": 3834,
    "top_k": None, "clustered": False, "n_clusters": None, "pair_sizes": "equal", "pool": "train",
    "data_fraction": 1.0, "seed": 1, "local_test": {"fraction": 0.2, "rule": "stratified"}, "datasets": None,
    "server_data": None,
}
#: Keys added to the flat model after partitions existed, left out of the job description at
#: these defaults (the flat model's ``_drop_later_defaults``).
LATER_JOB_KEYS: dict[str, Any] = {"shards_per_client": None, "pair_sizes": "equal", "pool": "train",
                                  "data_fraction": 1.0, "server_data": None}


def _scheme_tag(v: Any) -> str | None:
    """The discriminator of :data:`PartitionConfig`: an entry's ``scheme`` (default
    ``dirichlet``); None (an "unknown scheme" error) for a scheme that is not a string."""
    if isinstance(v, dict):
        scheme = v.get("scheme", "dirichlet")
        return scheme if isinstance(scheme, str) else None
    return getattr(v, "scheme", "dirichlet")


#: A ``partitions`` entry: the config class of its ``scheme``, a pydantic discriminated union
#: (an unknown scheme fails with the error type ``partition_scheme``).
PartitionConfig = Annotated[
    Union[
        Annotated[DirichletPartitionConfig, Tag("dirichlet")],
        Annotated[IIDPartitionConfig, Tag("iid")],
        Annotated[PathologicalPartitionConfig, Tag("pathological")],
        Annotated[ShardsPartitionConfig, Tag("shards")],
        Annotated[PerClientDirichletPartitionConfig, Tag("per_client_dirichlet")],
        Annotated[NaturalPartitionConfig, Tag("natural")],
        Annotated[DirichletPairsPartitionConfig, Tag("dirichlet_pairs")],
        Annotated[SubjectPartitionConfig, Tag("subject")],
    ],
    Discriminator(_scheme_tag, custom_error_type="partition_scheme",
                  custom_error_message=f"unknown partition scheme; one of {', '.join(PARTITION_CONFIGS)}"),
]
_PARTITION_ADAPTER: TypeAdapter = TypeAdapter(PartitionConfig)


def partition_config(data: dict[str, Any] | None = None, /, **keys: Any) -> PartitionConfigBase:
    """Validate one partition entry (without its ``name``) into its scheme's config class:
    ``partition_config(scheme="iid", num_clients=10)`` or ``partition_config({...})``.

    Raises pydantic's ``ValidationError`` (locations start with the scheme tag, e.g.
    ``iid.alpha``); :func:`validate_params` turns those of ``params.yaml`` into
    :class:`ParamsError` lines naming ``partitions.<name>.<key>``."""
    return _PARTITION_ADAPTER.validate_python({**(data or {}), **keys})


def partition_from_job(config: dict[str, Any]) -> PartitionConfigBase:
    """The partition config of a job description (:meth:`PartitionConfigBase.job_dict`, the
    partition stage's ``--job``): the keys of the flat legacy mapping that the scheme does not
    take are dropped after checking that they hold the legacy filler value (anything else
    cannot come from ``job_dict`` and is rejected). ``alpha: null`` is kept where the scheme
    accepts it. Raises :class:`ParamsError` naming the key, or pydantic's ``ValidationError``
    for the scheme's own keys."""
    scheme = config.get("scheme", "dirichlet")
    cls = PARTITION_CONFIGS.get(scheme) if isinstance(scheme, str) else None
    if cls is None:
        raise ParamsError(f"partition job: unknown scheme {scheme!r}; one of {', '.join(PARTITION_CONFIGS)}")
    keep = {}
    for key, value in config.items():
        if key in cls.model_fields and not (key == "alpha" and value is not None and issubclass(cls, _NoAlpha)):
            keep[key] = value
        elif key not in LEGACY_JOB_KEYS or value != LEGACY_JOB_KEYS[key]:
            raise ParamsError(f"partition job: key {key}={value!r} does not belong to the {scheme} scheme")
    return cls.model_validate(keep)


_ADAM_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "decoupled_weight_decay": False}


class OptimizerConfig(_Strict):
    """The client optimizer of every phase that does not declare its own (``medpfl.fl.optim``).

    ``sgd``: ``torch.optim.SGD`` (dampening 0, no Nesterov): ``d = g + wd*w; b = m*b + d;
    w -= lr*b``. ``adam``: ``torch.optim.Adam`` (Kingma & Ba, ICLR 2015, Alg. 1, bias-corrected,
    eps outside the square root) with ``betas`` and ``eps``; ``weight_decay`` is added to the
    gradient (L2, torch's Adam) or, with ``decoupled_weight_decay: true``, decoupled as AdamW
    (Loshchilov & Hutter, ICLR 2019; ``torch.optim.AdamW``). ``momentum`` is SGD's only: an
    adam run sets it to null (or leaves it out). Set ``lr`` for Adam too (the paper's and
    PyTorch's default is 1e-3). ``betas``, ``eps`` and ``decoupled_weight_decay`` are Adam's
    only."""

    name: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0.0)
    momentum: float | None = Field(0.9, ge=0.0, lt=1.0, validate_default=True,
                                   description="sgd: heavy-ball momentum (torch.optim.SGD); adam: null")
    weight_decay: float = Field(1e-5, ge=0.0)
    betas: tuple[float, float] = Field(_ADAM_DEFAULTS["betas"], validate_default=True,
                                       description="adam: (beta1, beta2), the moments' decay rates (Kingma & Ba "
                                                   "2015 Sec. 2 and torch: 0.9, 0.999)")
    eps: float = Field(_ADAM_DEFAULTS["eps"], ge=0.0, validate_default=True,
                       description="adam: added to sqrt(v_hat) (Kingma & Ba 2015 and torch: 1e-8)")
    decoupled_weight_decay: bool = Field(_ADAM_DEFAULTS["decoupled_weight_decay"], validate_default=True,
                                         description="adam: weight decay decoupled from the gradient (AdamW, "
                                                     "Loshchilov & Hutter 2019)")
    lr_decay: float = Field(0.99, gt=0.0, le=1.0, description="lr multiplier per round (StepLR(1, gamma)); "
                                                             "schedule: exponential only")
    schedule: Literal["exponential", "cosine"] = Field(
        "exponential", description="per-round lr: exponential = lr * lr_decay**r; cosine = CosineAnnealingLR(T_max, "
                                   "eta_min) stepped once per round (FHBench code: T_max = rounds = 200, eta_min 1e-6)")
    min_lr: float = Field(1e-6, ge=0.0, description="cosine: eta_min (FHBench code: 1e-6)")
    t_max: int | None = Field(None, ge=1, description="cosine: T_max in rounds (null: train.rounds)")

    @model_validator(mode="before")
    @classmethod
    def _adam_momentum_unset(cls, data: Any) -> Any:
        """An adam run that does not mention momentum has none (not SGD's default 0.9)."""
        if isinstance(data, dict) and data.get("name") == "adam" and "momentum" not in data:
            return {**data, "momentum": None}
        return data

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, v: float | None, info) -> float | None:
        name = info.data.get("name")
        if name == "adam" and v is not None:
            raise ValueError(f"applies to name: sgd only (Adam has no heavy-ball momentum; its first-moment decay "
                             f"is betas[0]); set momentum: null for adam (got {v:g})")
        if name == "sgd" and v is None:
            raise ValueError("name: sgd needs a number (0 for plain SGD); null is for adam")
        return v

    @field_validator("betas", "eps", "decoupled_weight_decay")
    @classmethod
    def _adam_only(cls, v: Any, info) -> Any:
        if info.field_name == "betas" and not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {v}")
        if info.data.get("name") == "sgd" and v != _ADAM_DEFAULTS[info.field_name]:
            raise ValueError(f"applies to name: adam only (got {v} with name: sgd)")
        return v

    def round_lr(self, r: int, rounds: int) -> float:
        """The learning rate of round ``r`` (0-based) of ``rounds``: ``lr * lr_decay**r``, or with
        ``schedule: cosine`` ``min_lr + (lr - min_lr) * (1 + cos(pi * r / T_max)) / 2`` (PyTorch
        ``CosineAnnealingLR`` after r steps, closed form; r beyond T_max follows the cosine on)."""
        if self.schedule == "cosine":
            t = self.t_max or rounds
            return self.min_lr + (self.lr - self.min_lr) * (1 + math.cos(math.pi * r / t)) / 2
        return self.lr * self.lr_decay**r

    @model_serializer(mode="wrap")
    def _drop_later_defaults(self, handler):
        """The schedule keys and Adam's (added after runs existed) are not dumped at their
        defaults, nor an adam run's null momentum, so the job descriptions of SGD runs with
        exponential decay stay as they were."""
        out = handler(self)
        if isinstance(out, dict):
            if out.get("schedule") == "exponential":
                for k in ("schedule", "min_lr", "t_max"):
                    out.pop(k, None)
            for k, default in _ADAM_DEFAULTS.items():
                if k in out and (tuple(out[k]) if isinstance(out[k], list) else out[k]) == default:
                    out.pop(k)  # betas: a list in mode="json"
            if out.get("momentum", 0.0) is None:
                out.pop("momentum")
        return out


class SamplingConfig(_Strict):
    """Which clients take part in each round; pre-sampled once and shared by every method.

    ``round_seeded``: ``RandomState(round).choice(K, m, replace=False)``, as in the FedKPer and
    FedNTD code: the same schedule for every seed and method, so an interval over seeds leaves
    out the variance of client sampling (the paper studies keep it, as their authors did).
    ``seed_round``: round r of seed s draws from a generator seeded by (s, r)
    (:func:`medpfl.fl.sampling.client_schedule`): the schedule varies with the training seed, so
    intervals over seeds include client-sampling variance, and is shared by every method of one
    seed, so comparisons paired by seed stay paired (the default study's scheme).
    ``stream``: one ``numpy.random.default_rng(seed)`` stream for all rounds (FL-bench style).
    ``seed``: for ``seed_round`` and ``stream``, a fixed seed for the schedule instead of the
    run seed (then every seed shares one schedule); ``round_seeded`` ignores it.
    The key's default stays ``round_seeded``; ``params.yaml`` sets ``seed_round``, so an overlay
    that keeps an author's schedule names its scheme.
    """

    scheme: Literal["round_seeded", "seed_round", "stream"] = "round_seeded"
    seed: int | None = None
    plans: Literal["host", "device"] = Field(
        "host", description="how each client's mini-batch order is drawn: host (default): per client, "
                            "torch.randperm from a CPU generator keyed by (seed, round, client), copied to the device "
                            "(medpfl.fl.program.phase_plan); device: every client's plan of a phase in one batched "
                            "computation on the device (medpfl.fl.program.device_plans: a keyed hash per position, "
                            "argsort per epoch), the same layout, another sample of batches; both executors draw the "
                            "same plans either way. Passes and subset windows stay on the host")

    @model_serializer(mode="wrap")
    def _drop_default_plans(self, handler):
        """``plans: host`` is not dumped: job descriptions from before the key are unchanged."""
        out = handler(self)
        if isinstance(out, dict) and out.get("plans") == "host":
            out.pop("plans")
        return out


class TransformConfig(_Strict):
    """How image samples are turned into model input, on the fly in the training stage
    (:meth:`medpfl.fl.data.FederatedData.x`; images stay uint8 on the device).

    channels: ``null`` (default): as stored; ``3``: a 1-channel (grayscale) image is repeated
    to 3 channels at batch time, as PIL's ``convert("RGB")`` does (3-channel images are left as
    they are); the model is then built for 3 input channels.
    normalize: ``dataset`` (default): the data set's own normalisation (``Normalize(0.5, 0.5)``,
    or its stored mean/std: MNIST); ``imagenet``: ``ToTensor()`` + ``Normalize(mean=(0.485,
    0.456, 0.406), std=(0.229, 0.224, 0.225))`` per channel, the input of ImageNet-pretrained
    backbones (FHBench's ViT transform, ``ViT_Lora/datautil/prepare_data.py``; needs 3 channels,
    so 1-channel images need ``channels: 3``).
    Vector samples (Synthetic(alpha, beta)) take no transform."""

    channels: Literal[3] | None = Field(None, description="null: as stored; 3: grayscale repeated to 3 channels")
    normalize: Literal["dataset", "imagenet"] = "dataset"

    def is_default(self) -> bool:
        return self.channels is None and self.normalize == "dataset"


#: Per server optimizer: its keys and their defaults, each with its source (``docs/methods.md``,
#: "Server optimizers"). Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (arXiv
#: 2003.00295): Algorithm 2 (FedAdagrad, FedYogi, FedAdam), Sec. 5 (β1 = 0.9, β2 = 0.99 for FedAdam
#: and FedYogi; FedAvgM = server SGD with momentum 0.9). The authors' code, google-research/federated
#: ``optimization/``: README.md (τ, its "epsilon": 1e-3 "worked well across task and optimizers"),
#: docs/hyperparameters.md (FedAvgM ``--server_sgd_momentum=0.9``; the best server learning rate
#: per task and optimizer from its grid: η here is the value most often best over its six tasks,
#: for FedAdagrad the median of a tie between 10^-1 and 10^-1.5); FedAdagrad β1 = 0: the code's
#: Keras Adagrad has no momentum. The paper tunes η per task: tune it for a new task.
SERVER_OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    "fedavgm": {"lr": 1.0, "momentum": 0.9},
    "fedadagrad": {"lr": 0.1, "beta1": 0.0, "tau": 1e-3},
    "fedadam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
    "fedyogi": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
}


class ServerOptimizerConfig(_Strict):
    """A server optimizer applied to the aggregated update of a method with a global model
    (:mod:`medpfl.fl.server_opt`): Δ_t = (the method's new global model) − (the previous one),
    on the model's trainable parameters.

    name: ``fedavgm`` (server momentum, Hsu et al. 2019: ``u = momentum u + Δ; x += lr u``),
    ``fedadagrad``, ``fedadam``, ``fedyogi`` (Reddi et al., ICLR 2021, Algorithm 2: ``m = beta1 m
    + (1 - beta1) Δ``; v by Adagrad / Adam / Yogi; ``x += lr m / (sqrt(v) + tau)``, ``v`` starting
    at ``tau**2``). A name alone (``server_optimizer: fedadam``) takes every default.

    Keys, each only where its optimizer has it (another key is an error): ``lr`` (η, server
    learning rate, > 0), ``momentum`` (fedavgm, in [0, 1)), ``beta1`` (adaptive ones, in [0, 1)),
    ``beta2`` (fedadam, fedyogi, in [0, 1)), ``tau`` (adaptive ones, > 0). Defaults:
    :data:`SERVER_OPTIMIZER_DEFAULTS`; the dump holds every key of the optimizer, resolved."""

    name: Literal["fedavgm", "fedadagrad", "fedadam", "fedyogi"] = Field(
        description="fedavgm (Hsu et al. 2019), fedadagrad, fedadam, fedyogi (Reddi et al., ICLR 2021, Alg. 2)")
    lr: float | None = Field(None, gt=0.0, description="η, the server learning rate (paper: tuned per task)")
    momentum: float | None = Field(None, ge=0.0, lt=1.0, description="fedavgm: server momentum β (0.9, paper Sec. 5)")
    beta1: float | None = Field(None, ge=0.0, lt=1.0, description="adaptive: first-moment decay β1 (Alg. 2)")
    beta2: float | None = Field(None, ge=0.0, lt=1.0, description="fedadam, fedyogi: second-moment decay β2 (Alg. 2)")
    tau: float | None = Field(None, gt=0.0, description="adaptive: τ, the degree of adaptivity; v starts at τ²")

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        """A bare name becomes ``{name: ...}``; a key the optimizer does not have is an error;
        the missing ones get the optimizer's defaults."""
        if isinstance(data, str):
            data = {"name": data}
        if not isinstance(data, dict) or data.get("name") not in SERVER_OPTIMIZER_DEFAULTS:
            return data  # the field validators report it
        defaults = SERVER_OPTIMIZER_DEFAULTS[data["name"]]
        known = set(cls.model_fields) - {"name"}
        wrong = sorted(k for k in data if k in known and k not in defaults and data[k] is not None)
        if wrong:
            raise ValueError(f"{', '.join(wrong)} does not apply to {data['name']} (its keys: "
                             f"{', '.join(['name', *defaults])})")
        return {**defaults, **{k: v for k, v in data.items() if v is not None}}

    @model_serializer(mode="wrap")
    def _only_its_keys(self, handler):
        """Dumps the name and the optimizer's own keys (the others are None)."""
        out = handler(self)
        if isinstance(out, dict):
            out = {k: v for k, v in out.items() if v is not None}
        return out


class ClipTransformConfig(_Strict):
    """``{name: clip, max_norm: S}``: each client's update Δ = (uploaded model) − (received model)
    scaled to L2 norm at most S, flat over its floating-point tensors (McMahan et al., ICLR 2018,
    Alg. 1 ``FlatClip``; :func:`medpfl.fl.upload.clip_by_norm`)."""

    name: Literal["clip"]
    max_norm: float = Field(gt=0.0, description="S, the L2 bound of each client's update")


class GaussianTransformConfig(_Strict):
    """``{name: gaussian, std: τ}``: τ N(0, I) added by each client to every floating-point entry of
    its update (the FedMIC paper's DP variant, Sec. 6.6, spec A.7: noise injection, not an (ε, δ)
    guarantee; :func:`medpfl.fl.upload.gaussian_noise`)."""

    name: Literal["gaussian"]
    std: float = Field(gt=0.0, description="τ, the noise's standard deviation per entry")


class LowRankTransformConfig(_Strict):
    """``{name: low_rank, energy: α}``: every update tensor of >= 2 dims sent as its truncated SVD
    at the smallest rank with energy > α (FedKD's and FedMIC's codec, :func:`medpfl.fl.payload.
    svd_encode`); the last transform of a chain."""

    name: Literal["low_rank"]
    energy: float = Field(gt=0.0, lt=1.0, description="α, the energy the kept singular values exceed")


#: One item of ``train.upload``, by its ``name``.
UploadTransformConfig = Annotated[Union[ClipTransformConfig, GaussianTransformConfig, LowRankTransformConfig],
                                  Field(discriminator="name")]


class DPConfig(_Strict):
    """``train.dp``: client-level differential privacy by DP-FedAvg (McMahan, Ramage, Talwar & Zhang,
    "Learning Differentially Private Recurrent Language Models", ICLR 2018, Algorithm 1 with the
    fixed-denominator estimator f̃_f and uniform weights; :mod:`medpfl.fl.privacy`).

    Each sampled client's update is clipped to L2 norm ``clip_norm`` (S); the server averages the m
    clipped updates with the fixed denominator m = qK and adds N(0, σ² I), σ = ``noise_multiplier``
    · S / m. The privacy spent, ε at ``delta``, is computed every round by opacus' ``accountant``
    (``rdp``: Rényi DP of the sampled Gaussian mechanism, Mironov et al. 2019; ``prv``: privacy
    random variables, Gopi, Lee & Wutschitz, NeurIPS 2021; its ε is an upper bound at
    ``eps_error`` 0.01) with sample rate q = m/K and one step per round. Every key but
    ``accountant`` must be given: a privacy setting has no default."""

    clip_norm: float = Field(gt=0.0, description="S, the L2 bound of each client's model update (McMahan et al. 2018)")
    noise_multiplier: float = Field(gt=0.0, description="z: the server's noise std is z·S/m (McMahan et al. 2018, Alg. 1)")
    delta: float = Field(gt=0.0, lt=1.0, description="δ of the reported (ε, δ); must be below 1/K (the number of clients)")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="opacus' RDPAccountant or PRVAccountant")


class TrainConfig(_Strict):
    """Local training and the model. ``model`` names a zoo model (:mod:`medpfl.models.zoo`);
    ``model_args`` holds that model's own arguments (``mlp``: ``hidden``), checked against it:
    an unknown model or argument fails with the key's name and the known values."""

    rounds: int = Field(20, ge=1)
    participation: float = Field(0.1, gt=0.0, le=1.0, description="fraction of clients per round")
    local_epochs: int = Field(5, ge=1)
    batch_size: int = Field(12, ge=1)
    optimizer: OptimizerConfig = OptimizerConfig()
    sampling: SamplingConfig = SamplingConfig()
    model: str = Field("cnn4", description="a model of the zoo by name (medpfl.models.MODEL_NAMES): cnn4, cnn4bn, "
                                           "simplecnn, resnet18, resnet101, resnet18_3d, vit, vit_lora, roberta-lora, "
                                           "wav2vec2-lora, moment-lora, mlr, mlp")
    model_args: dict[str, Any] = Field(
        default_factory=dict, validate_default=True,
        description="the model's own arguments, validated per model (medpfl.models.zoo), e.g. mlp: {hidden: 20}; "
                    "stored with every default filled in")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    executor: Literal["auto", "sequential", "stacked"] = "auto"
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16: autocast the local forward/backward")
    checkpoint_every: int = Field(10, ge=0, description="rounds between checkpoints; 0 = never")
    stack_clients: int | None = Field(
        None, ge=1, description="stacked executor: at most this many clients train (and are evaluated) at once; a "
                                "round's clients run in consecutive chunks of this size (null: all at once). Bounds "
                                "memory for large backbones; records equal the unchunked run within float tolerance")
    cuda_graphs: bool = Field(
        False, description="stacked executor on CUDA: fixed-shape local steps (every step runs all of a round's "
                           "clients, finished ones masked) captured as CUDA graphs on buffers allocated once per run "
                           "and replayed (docs/contract.md, 'Fixed-shape steps and CUDA graphs'); records equal the "
                           "eager run within float tolerance. Needs executor auto or stacked, a CUDA device and a "
                           "stackable method")
    # How seeds are grouped into processes, not what a run computes: excluded from the dump (the job
    # descriptions), so turning it on or off re-runs nothing by itself (Snakemake: a finished run
    # made by the other rule may still be re-run for its changed rule code, docs/pipeline.md).
    stack_seeds: bool = Field(
        False, exclude=True,
        description="true: the seeds of each method train as one computation (medpfl.fl.seed_stack): one "
                    "process per method (Snakemake rule train_seeds), every round's local training of all seeds "
                    "one stacked program (executor auto then picks stacked wherever the method and model allow), "
                    "each seed's outputs, MLflow run and checkpoint its own; records equal the separate "
                    "stacked runs within float tolerance. Study-wide; not for data drawn per seed "
                    "(data.synthetic.<name>.seed_per_run), whose seeds train apart. For a GPU")
    deterministic: bool = Field(True, description="on CUDA: deterministic algorithms where torch has them "
                                                  "(warn_only), CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN deterministic, "
                                                  "no cuDNN benchmark (medpfl.environment); no effect on a CPU")
    transform: TransformConfig = Field(TransformConfig(), description="image input transform: channels (null | 3), "
                                                                     "normalize (dataset | imagenet)")
    server_optimizer: ServerOptimizerConfig | None = Field(
        None, description="null (default): the method's aggregate is the next global model; else a server "
                          "optimizer on the aggregated update (fedavgm, fedadagrad, fedadam, fedyogi; "
                          "medpfl.fl.server_opt), for methods with a global model")
    upload: list[UploadTransformConfig] = Field(
        default_factory=list, description="upload transforms applied in order to each client's model update before it "
                                          "is sent (medpfl.fl.upload): clip {max_norm}, gaussian {std}, low_rank "
                                          "{energy} (last); for methods that declare a model upload")
    dp: DPConfig | None = Field(
        None, description="null (default): no differential privacy; else DP-FedAvg {clip_norm, noise_multiplier, delta, "
                          "accountant} (McMahan et al., ICLR 2018; medpfl.fl.privacy), ε per round by opacus")

    @field_validator("model")
    @classmethod
    def _model(cls, v: str, info: ValidationInfo) -> str:
        cat = catalogue_of(info)
        return v if cat is None else cat.check_model_name(v)  # ValueError: unknown model, listing the known ones

    @field_validator("model_args", mode="before")
    @classmethod
    def _model_args_none(cls, v: Any) -> Any:
        return {} if v is None else v

    @field_validator("model_args")
    @classmethod
    def _model_args(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        cat = catalogue_of(info)
        if cat is None or "model" not in info.data:  # the model name itself failed; that error is reported
            return v
        return cat.resolve_model_args(info.data["model"], v)

    @model_serializer(mode="wrap")
    def _drop_later_defaults(self, handler):
        """Keys added after runs existed are not dumped at their default: a model without
        arguments dumps no ``model_args``, and ``deterministic: true``, the default
        ``transform``, ``server_optimizer: null``, ``upload: []``, ``dp: null``,
        ``stack_clients: null`` and ``cuda_graphs: false`` are not dumped. The job
        descriptions (and so the Snakemake params triggers and checkpoint fingerprints) of such
        runs stay as they were before these keys existed; a non-default value is dumped and
        re-runs exactly the jobs it applies to."""
        out = handler(self)
        if isinstance(out, dict):
            if not out.get("model_args"):
                out.pop("model_args", None)
            if out.get("deterministic") is True:
                out.pop("deterministic")
            if self.transform.is_default():
                out.pop("transform", None)
            if out.get("server_optimizer", False) is None:
                out.pop("server_optimizer")
            if out.get("upload", None) == []:
                out.pop("upload")
            if out.get("dp", False) is None:
                out.pop("dp")
            if out.get("stack_clients", False) is None:
                out.pop("stack_clients")
            if out.get("cuda_graphs") is False:
                out.pop("cuda_graphs")
        return out

    @model_validator(mode="after")
    def _stack_seeds_needs_stacked(self) -> "TrainConfig":
        """``stack_seeds: true`` with ``executor: sequential``: a ValueError naming both keys
        (the seeds' local training is merged on the stacked executor)."""
        if self.stack_seeds and self.executor == "sequential":
            raise ValueError("train.stack_seeds: true merges the seeds' local training on the stacked executor and "
                             "train.executor is sequential: set executor auto or stacked, or stack_seeds false")
        return self

    @model_validator(mode="after")
    def _cuda_graphs_needs_stacked_cuda(self) -> "TrainConfig":
        """``cuda_graphs: true`` only with the stacked executor (``auto`` or ``stacked``) on a device
        that can be CUDA (``auto``, ``cuda``, ``cuda:N``): a ValueError naming ``train.cuda_graphs``
        otherwise (``medpfl check-params`` reports it). A method or model that cannot be stacked is
        refused when the run starts (:func:`medpfl.fl.engine.make_executor`)."""
        if self.cuda_graphs:
            if self.executor == "sequential":
                raise ValueError("train.cuda_graphs: true captures the stacked executor's local steps; "
                                 "train.executor is sequential (the plain reference): set executor auto or stacked, "
                                 "or cuda_graphs false")
            if self.device == "cpu":
                raise ValueError("train.cuda_graphs: true needs a CUDA device and train.device is cpu: set device "
                                 "auto or cuda, or cuda_graphs false")
        return self

    @field_validator("upload")
    @classmethod
    def _upload_chain(cls, v: list) -> list:
        """``low_rank`` at most once and last (the other transforms act on dense tensors)."""
        names = [t.name for t in v]
        if "low_rank" in names[:-1]:
            raise ValueError(f"low_rank must be the last transform and appear once (got {' -> '.join(names)})")
        return v

    @field_validator("dp")
    @classmethod
    def _dp_without_client_noise(cls, v: DPConfig | None, info) -> DPConfig | None:
        """With ``dp``, no ``gaussian`` in ``upload``: DP-FedAvg's noise is the server's, and ε is
        computed for that mechanism alone."""
        if v is not None and any(t.name == "gaussian" for t in info.data.get("upload") or []):
            raise ValueError("cannot be combined with a gaussian upload transform (DP-FedAvg adds its noise at the "
                             "server and its ε is computed for that noise alone); remove one of them")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", v):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {v!r}")
        return v


class EvalConfig(_Strict):
    every: int = Field(1, ge=1, description="evaluate the global/personalized models every N rounds (and the last)")
    batch_size: int = Field(1024, ge=1, description="samples per evaluation forward (on the stacked executor: in all, "
                                                    "over the models evaluated together); also the batch of the "
                                                    "methods' passes and per-sample contexts")
    memory_fraction: float | None = Field(
        None, gt=0, le=0.9,
        description="null (default): evaluation forwards take batch_size samples. A fraction f: the global and "
                    "personalized models are evaluated with as many samples (and, stacked, models) per forward as fit "
                    "in f of the device's free memory at that moment, from a probe of the run's model "
                    "(medpfl.fl.memory; train.stack_clients does not apply to evaluation then). Counts are unchanged, "
                    "losses equal within float tolerance; passes keep batch_size")

    @model_serializer(mode="wrap")
    def _drop_later_defaults(self, handler):
        """``memory_fraction: null`` is not dumped: the job descriptions (Snakemake params
        triggers, checkpoint fingerprints) of runs from before the key stay as they were."""
        out = handler(self)
        if isinstance(out, dict) and out.get("memory_fraction", False) is None:
            out.pop("memory_fraction")
        return out


class ReportConfig(_Strict):
    """paper_table: a paper's table as data (e.g. ``config/papers/fedkper-table1.yaml``, relative
    to the project root): the report adds our value, the paper's, the difference and both
    rankings per method and metric (:mod:`medpfl.report.paper`).

    reference: the method every other method is compared with, paired by seed (mean difference
    and its 95 % confidence interval, :mod:`medpfl.report.stats`); one of ``methods``. Unset:
    ``fedavg`` when the study has it, else the first method (:meth:`Params.report_reference`)."""

    paper_table: str | None = None
    reference: str | None = None


class MlflowConfig(_Strict):
    experiment: str = "medpfl"


class CustomDataset(_Strict):
    """A file in the official MedMNIST ``.npz`` layout that is not a MedMNIST release.

    ``layout: medmnist3d``: the MedMNIST 3D layout (images uint8 ``[N, D, H, W]``), stored as
    ``[N, C=D, H, W]``; ``n_channels`` is then the depth D."""

    path: str
    md5: str = Field(pattern=r"^[0-9a-f]{32}$")
    n_channels: int = Field(ge=1, description="image channels; the volumes' depth D with layout medmnist3d")
    num_classes: int = Field(ge=2)
    layout: Literal["medmnist", "medmnist3d"] = Field(
        "medmnist", description="medmnist: 2D images (N, H, W[, C]); medmnist3d: 3D volumes (N, D, H, W)")


class SyntheticDataset(_Strict):
    """The generator's arguments for one ``synthetic_<alpha>_<beta>`` data set (alpha and beta,
    standard deviations, come from the name); defaults are the pFedKD-WCL paper's setting."""

    num_clients: int = Field(100, ge=1)
    dimension: int = Field(60, ge=1)
    num_classes: int = Field(10, ge=2)
    seed: int = Field(0, ge=0, description="numpy RandomState seed (the official code is unseeded)")
    train_fraction: float = Field(0.75, gt=0.0, lt=1.0, description="per client: first share of its permutation")
    # Not a generator argument: which generator seed each run's data are drawn with. Excluded from
    # the dump (the data job, medpfl.data.sources.dataset_job), so that adding the key re-runs
    # nothing; Params.study_dict writes it where it is on.
    seed_per_run: bool = Field(
        False, exclude=True,
        description="true: the run of seed s trains on its own data set, drawn with generator seed `seed + s - 1` "
                    "(run seed 1 keeps `seed` and the data set's files; Params.data_name); false: every run "
                    "seed shares the one data set drawn with `seed`")

    def generator_seed(self, run_seed: int) -> int:
        """The generator seed of the data a run of ``run_seed`` trains on: ``seed + run_seed - 1``
        with ``seed_per_run``, else ``seed``."""
        return self.seed + run_seed - 1 if self.seed_per_run else self.seed


class MultimodalDatasetConfig(_Strict):
    """``data.multimodal.<name>``: options of one folder data set (:mod:`medpfl.data.multimodal`:
    ``ptbxl``, ...), used by its preprocess stage. Keys at their defaults are left out of the data
    job, so adding this section re-runs nothing."""

    tokenizer: str | None = Field(None, description="tokens data sets only: the tokenizer (hub id or folder) that "
                                                    "preprocess tokenises with (null: the registry's default)")
    max_length: int | None = Field(None, ge=2, description="tokens data sets only: tokens per sample, padded or "
                                                           "truncated (null: the registry's, 512)")
    limit: int | None = Field(None, ge=1, description="smoke runs: only the reader's first `limit` records "
                                                      "(its own unit: PTB-XL records, ...); null = all")


class DataConfig(_Strict):
    """Data sets by name: a MedMNIST file stem (``bloodmnist`` (28 px) or ``bloodmnist_64``),
    ``mnist`` (MNIST, the Keras ``mnist.npz``), ``cifar10`` / ``cifar100`` (the official CIFAR
    python archives), or ``synthetic_<alpha>_<beta>`` (the FedProx / pFedKD-WCL
    Synthetic(alpha, beta), generated locally; e.g. ``synthetic_0.5_0.5``).

    ``custom`` declares extra files in the official layout (own data, synthetic test data).
    ``synthetic`` overrides a synthetic set's generator arguments (:class:`SyntheticDataset`).
    ``multimodal`` holds options of folder data sets (``ptbxl``, ...; :class:`MultimodalDatasetConfig`).
    """

    datasets: list[str] = Field(default_factory=lambda: ["bloodmnist"], min_length=1)
    custom: dict[str, CustomDataset] = Field(default_factory=dict)
    synthetic: dict[str, SyntheticDataset] = Field(default_factory=dict)
    multimodal: dict[str, MultimodalDatasetConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _names(self, info: ValidationInfo) -> "DataConfig":
        cat = catalogue_of(info)
        for name in self.datasets:
            if not re.fullmatch(NAME_RE, name):
                raise ValueError(f"datasets: name {name!r} must match {NAME_RE}")
            if name not in self.custom and cat is not None:
                cat.check_dataset_name(name)  # raises ValueError naming the data set
        for name in self.synthetic if cat is not None else ():
            if not cat.is_synthetic_name(name):
                raise ValueError(f"synthetic.{name}: not a synthetic data set name (synthetic_<alpha>_<beta>, "
                                 "e.g. synthetic_0.5_0.5)")
        if len(set(self.datasets)) != len(self.datasets):
            raise ValueError(f"datasets: duplicate entries in {self.datasets}")
        kind_of = getattr(cat, "folder_dataset_kind", None) if cat is not None else None
        for name, opts in self.multimodal.items() if kind_of is not None else ():
            kind = kind_of(name)
            if kind is None:
                raise ValueError(f"multimodal.{name}: not a folder data set (the registry medpfl.data.multimodal "
                                 "has no such name)")
            for key in ("tokenizer", "max_length"):
                if getattr(opts, key) is not None and kind != "tokens":
                    raise ValueError(f"multimodal.{name}.{key}: applies to text (tokens) data sets only; {name} is "
                                     f"a {kind} data set")
        return self


class Params(_Strict):
    """The whole ``params.yaml``."""

    study: str = Field("default", pattern=NAME_RE)
    data: DataConfig = DataConfig()
    partitions: dict[str, PartitionConfig] = Field(default_factory=lambda: {"dir0.1": DirichletPartitionConfig()})
    methods: list[str] = Field(default_factory=lambda: ["fedavg", "local", "fedkper"], min_length=1)
    method_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    seeds: list[int] = Field(default_factory=lambda: [1], min_length=1)
    train: TrainConfig = TrainConfig()
    dataset_train: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per data set `train` overrides, {<data set of data.datasets>: {train keys}}: a model, batch "
                    "size or lr per data set in one study (FHBench: RoBERTa for text, MOMENT for time series, "
                    "wav2vec2 for audio, each with its own batch and lr); merged over `train`, under a method's "
                    "own method_params.<name>.train (Params.run_train)")
    eval: EvalConfig = EvalConfig()
    report: ReportConfig = ReportConfig()
    mlflow: MlflowConfig = MlflowConfig()

    @field_validator("partitions", mode="before")
    @classmethod
    def _partition_list(cls, v: Any) -> Any:
        """``partitions`` is a list of ``{name: ..., <partition keys>}`` (canonical: an overlay's
        list replaces the base list, as Snakemake ``--configfile`` merges mappings but replaces
        lists) or a mapping ``{name: {...}}``."""
        if isinstance(v, list):
            out: dict[str, Any] = {}
            for i, item in enumerate(v):
                if not isinstance(item, dict) or "name" not in item:
                    raise ValueError(f"entry {i} needs a 'name' key")
                item = dict(item)
                name = str(item.pop("name"))
                if name in out:
                    raise ValueError(f"duplicate partition name {name!r}")
                out[name] = item
            return out
        return v

    @field_validator("partitions")
    @classmethod
    def _partition_names(cls, v: dict[str, PartitionConfigBase]) -> dict[str, PartitionConfigBase]:
        if not v:
            raise ValueError("at least one partition is required")
        for name in v:
            if not re.fullmatch(NAME_RE, name):
                raise ValueError(f"partition name {name!r} must match {NAME_RE}")
        return v

    @model_validator(mode="after")
    def _bind_catalogue(self, info: ValidationInfo) -> "Params":
        """Keep the validation's catalogue (:attr:`catalogue`). The first model validator: pydantic
        runs them in order, and the ones below use it."""
        # in the instance's __dict__ but no field (as functools.cached_property keeps its value):
        # no key of params.yaml, not dumped, not compared (equal values are equal Params however
        # they were validated), kept by model_copy
        object.__setattr__(self, "_catalogue", catalogue_of(info))
        return self

    @property
    def catalogue(self) -> Catalogue | None:
        """The :class:`Catalogue` these params were validated with (None: the schema alone)."""
        return self.__dict__.get("_catalogue")

    @model_validator(mode="after")
    def _partition_datasets(self) -> "Params":
        cat = self.catalogue
        for name, part in self.partitions.items():
            for d in part.datasets or []:
                if d not in self.data.custom and cat is not None:
                    try:
                        cat.check_dataset_name(d)  # a known data set, not necessarily one this study runs
                    except ValueError as e:
                        raise ValueError(f"partitions.{name}.datasets: {e}") from None
        if not self.dataset_partitions():
            raise ValueError("partitions: no partition applies to any data set in data.datasets")
        return self

    def dataset_partitions(self) -> list[tuple[str, str]]:
        """Every (dataset, partition) pair the study runs: each partition on the data sets it
        names (``partitions.<name>.datasets``), or on all of them."""
        return [(d, name) for d in self.data.datasets for name, part in self.partitions.items()
                if part.datasets is None or d in part.datasets]

    def data_name(self, dataset: str, seed: int) -> str:
        """The name of the data files a run of ``seed`` on ``dataset`` reads
        (``data/processed/<name>.npz``, ``data/partitions/<name>/<partition>/``): ``dataset``
        itself, except for a generated data set with ``data.synthetic.<dataset>.seed_per_run``
        whose run draws with another generator seed than ``data.synthetic.<dataset>.seed``:
        ``<dataset>.gen<generator seed>`` (e.g. ``synthetic_0.5_0.5.gen1`` for run seed 2 of a
        data set with seed 0). Run seed 1 always reads ``dataset``'s own files."""
        syn = self.data.synthetic.get(dataset) if dataset not in self.data.custom else None
        if syn is None or not syn.seed_per_run or syn.generator_seed(seed) == syn.seed:
            return dataset
        return f"{dataset}{GENERATED_SUFFIX}{syn.generator_seed(seed)}"

    def data_names(self) -> list[tuple[str, str]]:
        """Every (data name, partition) pair the study's runs read (:meth:`data_name`): the
        :meth:`dataset_partitions` pairs, plus one per further generator seed of a data set with
        ``seed_per_run``; in the order of :meth:`dataset_partitions`, then of ``seeds``."""
        out = [(self.data_name(d, s), p) for d, p in self.dataset_partitions() for s in self.seeds]
        return list(dict.fromkeys([*self.dataset_partitions(), *out]))

    def resolve_data_name(self, name: str) -> tuple[str, int | None]:
        """``(dataset, generator seed)`` of a data name (:meth:`data_name`): ``(name, None)`` for a
        data set's own files, ``("synthetic_0.5_0.5", 1)`` for ``synthetic_0.5_0.5.gen1``. Raises
        :class:`ParamsError` for a ``.gen<k>`` name that no run of the study reads (a data set
        without ``seed_per_run``, or a generator seed no seed of ``seeds`` maps to)."""
        m = re.fullmatch(rf"(.+){re.escape(GENERATED_SUFFIX)}(\d+)", name)
        if m is None or m.group(1) not in self.data.datasets:
            return name, None
        dataset, gen = m.group(1), int(m.group(2))
        if not any(self.data_name(dataset, s) == name for s in self.seeds):
            syn = self.data.synthetic.get(dataset)
            why = (f"seeds {self.seeds} map to generator seeds {[syn.generator_seed(s) for s in self.seeds]}"
                   if syn is not None and syn.seed_per_run else "it has no seed_per_run")
            raise ParamsError(f"data.synthetic.{dataset}.seed_per_run: no run of the study reads {name!r} "
                              f"(generator seed {gen}): {why}")
        return dataset, gen

    def study_dict(self) -> dict[str, Any]:
        """The whole study as JSON-ready values, the report rule's ``params`` (logged to the
        study's MLflow parent run): ``model_dump(mode="json")`` with every partition as its
        :meth:`PartitionConfigBase.job_dict`, the flat mapping of the single partition model of
        earlier versions, so that the description (and the report's re-run trigger) of an
        existing study is unchanged."""
        out = self.model_dump(mode="json")
        for name, syn in self.data.synthetic.items():  # excluded from the dump (the data job): written where on
            if syn.seed_per_run:
                out["data"]["synthetic"][name]["seed_per_run"] = True
        if not out.get("dataset_train"):
            out.pop("dataset_train", None)  # not dumped at its default: existing studies keep their description
        out["partitions"] = {name: part.job_dict() for name, part in self.partitions.items()}
        return out

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate seeds in {v}")
        if any(s < 0 for s in v):
            raise ValueError(f"seeds must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _seed_per_run(self) -> "Params":
        for name, syn in self.data.synthetic.items():
            if syn.seed_per_run and syn.generator_seed(min(self.seeds)) < 0:
                raise ValueError(f"data.synthetic.{name}.seed_per_run: run seed {min(self.seeds)} would draw with "
                                 f"generator seed {syn.generator_seed(min(self.seeds))} (seed {syn.seed} + run seed "
                                 f"- 1); a generator seed must be >= 0: use run seeds >= {1 - syn.seed} or raise "
                                 f"data.synthetic.{name}.seed")
        return self

    @model_validator(mode="after")
    def _methods(self) -> "Params":
        cat = self.catalogue
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: duplicate entries in {self.methods}")
        for name in self.methods:
            if not re.fullmatch(NAME_RE, name):
                raise ValueError(f"methods: name {name!r} must match {NAME_RE}")
            if cat is not None:
                cat.resolve_method(name, self.method_params)  # raises ParamsError naming the key
        for name in self.method_params if cat is not None else ():
            cat.resolve_method(name, self.method_params)
        return self

    @model_validator(mode="after")
    def _report_reference(self) -> "Params":
        ref = self.report.reference
        if ref is not None and ref not in self.methods:
            raise ValueError(f"report.reference: {ref!r} is not one of the study's methods {self.methods}")
        return self

    def report_reference(self) -> str:
        """The report's reference method: ``report.reference``, else ``fedavg`` when the study
        has it, else the first method (:func:`medpfl.report.stats.resolve_reference`)."""
        return self.report.reference or ("fedavg" if "fedavg" in self.methods else self.methods[0])

    @model_validator(mode="after")
    def _method_train(self) -> "Params":
        for name in self.method_params:
            self.method_train(name)  # raises ParamsError naming method_params.<name>.train.<key>
        return self

    @model_validator(mode="after")
    def _dataset_train(self) -> "Params":
        for d in self.dataset_train:
            if d not in self.data.datasets:
                raise ValueError(f"dataset_train.{d}: not one of data.datasets {self.data.datasets}")
            for m in self.methods:
                self.run_train(m, d)  # raises ParamsError naming the key
        return self

    def run_train(self, method: str, dataset: str) -> TrainConfig:
        """The ``train`` section of one method's runs on one data set: the study's ``train``, then
        ``dataset_train.<dataset>`` merged in, then ``method_params.<method>.train`` (as
        :meth:`method_train`: a mapping merges key by key; a new ``model`` starts from that
        model's defaults with the overriding section's own ``model_args``). Without a
        ``dataset_train`` entry this is :meth:`method_train`. Raises :class:`ParamsError` naming
        ``dataset_train.<dataset>.<key>`` or ``method_params.<method>.train.<key>``."""
        over = self.dataset_train.get(dataset)
        if not over:
            return self.method_train(method)
        base = self._merge_train(self.train, over, f"dataset_train.{dataset}")
        m_over = (self.method_params.get(method) or {}).get("train")
        if m_over is None:
            return base
        return self._merge_train(base, m_over, f"method_params.{method}.train")

    def method_train(self, name: str) -> TrainConfig:
        """The ``train`` section for one method's runs: the study's, with the method's own
        ``method_params.<name>.train`` overrides merged in (a mapping merges key by key; a new
        ``model`` starts from that model's defaults, with the variant's own ``model_args`` if it
        gives any: another model's arguments are never merged in; likewise another
        ``server_optimizer`` name starts from that optimizer's defaults; a list such as
        ``upload`` replaces the study's).

        Raises :class:`ParamsError` naming ``method_params.<name>.train.<key>``."""
        over = (self.method_params.get(name) or {}).get("train")
        if over is None:
            return self.train
        return self._merge_train(self.train, over, f"method_params.{name}.train")

    def _merge_train(self, train: TrainConfig, over: Any, where: str) -> TrainConfig:
        """``train`` with the overrides ``over`` merged in (the rules of :meth:`method_train`);
        ``where`` names the overriding section in errors."""
        if not isinstance(over, dict):
            raise ParamsError(f"{where}: expected a mapping of train keys, got {over!r}")
        if "stack_seeds" in over:  # how seeds are grouped into jobs: one switch for the study's DAG
            raise ParamsError(f"{where}.stack_seeds: the switch is study-wide (one Snakemake rule for every method); "
                              "set train.stack_seeds instead")
        base = train.model_dump()
        if "model" in over and over["model"] != base.get("model"):
            base.pop("model_args", None)
        if "server_optimizer" in over and _server_optimizer_name(over["server_optimizer"]) not in (
                None, (base.get("server_optimizer") or {}).get("name")):
            base.pop("server_optimizer", None)  # another optimizer starts from its own defaults
        try:
            return TrainConfig.model_validate(deep_merge(base, over), context={"catalogue": self.catalogue})
        except ValidationError as e:
            msgs = []
            for err in e.errors():
                loc = _fmt_loc(tuple(err["loc"]))
                msg = ("unknown key (check the spelling; see params.yaml for the allowed keys)"
                       if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, "))
                msgs.append(f"{where}.{loc}: {msg}")
            raise ParamsError("; ".join(msgs)) from None

    @model_validator(mode="after")
    def _server_optimizers(self) -> "Params":
        """A server optimizer needs a method whose global model it can step (``has_global_model``)
        and that allows it (:func:`medpfl.fl.server_opt.check_applicable`); raises naming the
        method and the key that set it."""
        if self.catalogue is None:
            return self
        for name in self.methods:
            opt = self.method_train(name).server_optimizer
            if opt is None:
                continue
            own = "server_optimizer" in ((self.method_params.get(name) or {}).get("train") or {})
            key = f"method_params.{name}.train.server_optimizer" if own else "train.server_optimizer"
            cls, cfg = self.method_config(name)
            self.catalogue.check_server_optimizer(name, cls, cfg, key, opt.name)
        return self

    @model_validator(mode="after")
    def _upload_transforms(self) -> "Params":
        """``train.dp`` and ``train.upload`` need a method that declares a model upload
        (:attr:`medpfl.algorithms.base.Algorithm.model_upload`); raises naming the method and the
        key that set it (:func:`medpfl.fl.privacy.check_applicable`)."""
        if self.catalogue is None:
            return self
        for name in self.methods:
            t = self.method_train(name)
            own = (self.method_params.get(name) or {}).get("train") or {}
            for field, on in (("dp", t.dp is not None), ("upload", bool(t.upload))):
                if on:
                    key = f"method_params.{name}.train.{field}" if field in own else f"train.{field}"
                    self.catalogue.check_upload(name, self.method_config(name)[0], key)
        return self

    def method_config(self, name: str):
        """The resolved ``(algorithm class, validated config)`` for a method name, by the catalogue
        these params were validated with (:func:`medpfl.compose.validate_params`)."""
        if self.catalogue is None:
            raise RuntimeError("these params were validated without a catalogue (the schema alone), so they cannot "
                               "resolve a method; read them with medpfl.compose.load_params / validate_params")
        return self.catalogue.resolve_method(name, self.method_params)


def _server_optimizer_name(v: Any) -> str | None:
    """The optimizer name a ``server_optimizer`` override gives (None: none given, or ``null``)."""
    if isinstance(v, str):
        return v
    return v.get("name") if isinstance(v, dict) else None


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")


def _fmt_loc(loc: tuple) -> str:
    """A params location as the dotted key a user types (``partitions.dir0.1.alpha``); a key that
    is empty or holds other characters (spaces, ``:``, quotes) is shown quoted in brackets
    (``server_data[':']``), so the line still reads unambiguously as ``<key>: <message>``."""
    out = ""
    for p in loc:
        s = str(p)
        out += (("." if out else "") + s) if _PLAIN_KEY.fullmatch(s) else f"[{s!r}]"
    return out or "<root>"


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per error of a params file: ``  - <dotted key>: <message>``, under a first line
    naming ``source``. Inside a ``partitions`` entry the location drops pydantic's scheme tag
    (``partitions.<name>.<key>``), a key the entry's scheme does not take names the scheme, the
    keys it takes and the schemes the key belongs to (:func:`partition_key_message`), and an
    unknown scheme names ``partitions.<name>.scheme`` and the known ones."""
    lines = [f"{source}: invalid parameters"]
    for e in err.errors():
        loc, msg = tuple(e["loc"]), e["msg"].removeprefix("Value error, ")
        scheme = None
        if len(loc) >= 3 and loc[0] == "partitions" and loc[2] in PARTITION_CONFIGS:
            scheme, loc = loc[2], loc[:2] + loc[3:]  # the union's tag is no key of the file
        if e["type"] == "partition_scheme" and len(loc) == 2 and loc[0] == "partitions":
            given = e["input"].get("scheme") if isinstance(e["input"], dict) else e["input"]
            loc, msg = loc + ("scheme",), f"unknown scheme {given!r}; one of {', '.join(PARTITION_CONFIGS)}"
        elif e["type"] == "extra_forbidden":
            msg = (partition_key_message(scheme, str(loc[2])) if scheme is not None and len(loc) == 3
                   else "unknown key (check the spelling; see params.yaml for the allowed keys)")
        lines.append(f"  - {_fmt_loc(loc)}: {msg}" if loc else f"  - {msg}")
    return "\n".join(lines)


def partition_key_message(scheme: str, key: str) -> str:
    """The error for a ``partitions`` entry of ``scheme`` that sets ``key``, which that scheme
    does not take: the schemes that do take it, or a hint at the spelling, then the scheme's
    own keys (:meth:`PartitionConfigBase.scheme_keys`)."""
    owners = [name for name, cls in PARTITION_CONFIGS.items() if key in cls.scheme_keys()]
    head = (f"not a key of the {scheme} scheme (a key of {', '.join(owners)})" if owners
            else f"unknown key for the {scheme} scheme (check the spelling)")
    return f"{head}; the {scheme} scheme takes {', '.join(PARTITION_CONFIGS[scheme].scheme_keys())}"


def deep_merge(base: dict, overlay: dict) -> dict:
    """Recursively merge ``overlay`` into a copy of ``base`` (Snakemake ``--configfile`` semantics)."""
    out = dict(base)
    for k, v in overlay.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ParamsError(f"{path}: parameter file not found") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def validate_params(data: dict, source: str = "params.yaml", *, catalogue: Catalogue | None) -> Params:
    """Validate a params mapping; raise :class:`ParamsError` naming ``source`` and the key.

    ``catalogue``: the checks against the rest of the project (:class:`Catalogue`; the
    project's: :func:`medpfl.compose.validate_params`), or None for the schema alone. It has
    no default, so that no caller drops those checks by leaving it out."""
    try:
        return Params.model_validate(data, context={"catalogue": catalogue})
    except ValidationError as e:
        raise ParamsError(format_validation_error(e, source)) from None
    except ParamsError as e:
        raise ParamsError(f"{source}: {e}") from None


def load_params(path: str | Path = "params.yaml", overlays: list[str | Path] = (), *,
                catalogue: Catalogue | None) -> Params:
    """Read ``params.yaml`` plus study overlays (later files win) and validate them
    (:func:`validate_params`; the project's: :func:`medpfl.compose.load_params`)."""
    data = read_yaml(path)
    names = [str(path)]
    for ov in overlays:
        data = deep_merge(data, read_yaml(ov))
        names.append(str(ov))
    return validate_params(data, " + ".join(names), catalogue=catalogue)


def canonical_json(obj: Any) -> str:
    """A stable JSON string (sorted keys) used for hashing and command-line transport."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def train_job(params: Params, dataset: str, partition: str, method: str, seed: int) -> dict:
    """Everything one training job needs, resolved and JSON-ready (Snakemake passes it on the
    command line, so its params trigger sees exactly these values).

    ``pool`` is present only for ``partitions.<name>.pool: all`` (no global test set), and
    ``train.transform`` and ``train.server_optimizer`` only when not the default, so the
    descriptions of earlier jobs are unchanged. ``generator_seed`` is present only where the run
    reads a generated data set drawn with another generator seed than the data set's own
    (``data.synthetic.<dataset>.seed_per_run``, run seeds other than 1; :meth:`Params.data_name`):
    the seed its data files were drawn with. ``params`` must have been validated with a
    catalogue (:func:`medpfl.compose.validate_params`): it resolves the method."""
    if partition not in params.partitions:
        raise ParamsError(f"partitions: no partition named {partition!r}")
    if (dataset, partition) not in params.dataset_partitions():
        raise ParamsError(f"partitions.{partition}.datasets: does not include {dataset!r}")
    algo_cls, mcfg = params.method_config(method)
    pool = params.partitions[partition].pool
    generated = params.resolve_data_name(params.data_name(dataset, seed))[1]
    return {
        **({"pool": pool} if pool != "train" else {}),
        **({"generator_seed": generated} if generated is not None else {}),
        "study": params.study,
        "dataset": dataset,
        "partition": partition,
        "method": method,
        "algorithm": algo_cls.name,
        "method_params": mcfg.model_dump(),
        "seed": seed,
        "num_clients": params.partitions[partition].num_clients,
        "train": params.run_train(method, dataset).model_dump(),
        "eval": params.eval.model_dump(),
    }


def partition_job(params: Params, dataset: str, partition: str) -> dict:
    """What the partition stage needs for one (data set, partition): ``{"dataset", "name",
    "config"}``, the config being the partition's :meth:`PartitionConfigBase.job_dict` (the flat
    description of earlier versions, unchanged for every config that was valid then, so that
    Snakemake's params trigger re-runs no existing partition). Read back by the stage with
    :func:`partition_from_job`."""
    if partition not in params.partitions:
        raise ParamsError(f"partitions: no partition named {partition!r}")
    return {"dataset": dataset, "name": partition, "config": params.partitions[partition].job_dict()}
