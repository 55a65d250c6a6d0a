"""An accelerator emulated on the CPU, to prove the GPU path without a GPU (issue 32).

The CPU build of torch cannot run a round "on cuda": ``FakeTensorMode`` creates ``cuda`` fake
tensors, but the first ``autograd.grad`` on one aborts the process (autograd asks the CPU
build for a CUDA device guard, which it does not have), and fake tensors carry no values, so
every value the engine legitimately reads on the host (the divergence guard, the records) fails
as well. This module emulates the accelerator instead, with real values:

* the *device* is ``emu`` (torch's PrivateUse1 device type, registered from Python with a
  device guard, so that autograd runs on it: :func:`register_device`; the code's
  ``data.device``); a tensor on it is an :class:`OnDevice` wrapper reporting ``device="emu:0"``
  that holds a CPU tensor with the values.
  Every op on wrappers runs on the held CPU tensors, so the numbers (and the records) are those
  of the CPU run;
* :class:`EmulatedDevice`, a ``TorchDispatchMode``, sees every aten op (also under
  ``torch.func.vmap``, ``functional_call`` and autograd, which dispatch to it) and

  - raises :class:`DevicePlacementError` on an op that mixes a tensor on the device with a plain
    CPU tensor (the defect a CUDA run reports as "Expected all tensors to be on the same
    device"; with ``strict_scalars`` also a 0-dim CPU tensor, which CUDA accepts as a scalar
    but which is still a tensor left on the host), and on a tensor of another device;
  - counts the host synchronisations a CUDA run would make: a value read on the host
    (``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``), an op
    whose output shape depends on values (``nonzero``, ``masked_select``, ``unique``, boolean
    indexing, ``repeat_interleave`` without ``output_size``), a device-to-host copy
    (``.cpu()``, ``.to("cpu")``) and a host-to-device copy (``.to(device)``,
    ``torch.tensor(x, device=...)``: a pageable ``cudaMemcpy`` followed by a stream
    synchronisation, which ``torch.cuda.set_sync_debug_mode("error")`` also reports);
  - inside :meth:`EmulatedDevice.no_sync` (the executors' ``local_steps`` hook,
    :func:`medpfl.fl.stacked.local_steps`), raises :class:`HostSyncError` on the first one;
  - counts the aten ops (``ops``: the kernels a GPU would launch, before fusion) per region.

``.tolist()`` of a tensor on the device raises RuntimeError (torch refuses it for every tensor
subclass): the code reads a list with ``.cpu().tolist()`` (the same one copy on CUDA), so a
``.tolist()`` fails the test either way. Tensor factories with ``device="emu"`` create wrappers; plain CPU tensors and CPU-only ops (the
host-side batch plans) run unchanged. Not emulated: streams, memory, speed, CUDA-only
kernels' numerics (TF32, cuDNN algorithm choice).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: the emulated accelerator: torch's PrivateUse1 device type, registered from Python
#: (:func:`register_device`), so that autograd finds a device guard for it
DEVICE_TYPE = "emu"
_registered = False


def register_device() -> torch.device:
    """Registers the PrivateUse1 device type from Python (``torch.utils.backend_registration.
    _setup_privateuseone_for_python_backend``: a device guard, hooks and a module, no kernels:
    every op on it runs through :class:`EmulatedDevice`), once per process; returns
    ``torch.device("emu", 0)``. Raises RuntimeError when another PrivateUse1 backend is registered."""
    global _registered
    if not _registered:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE)
        _register_kernels()
        _registered = True
    return torch.device(DEVICE_TYPE, 0)

aten = torch.ops.aten

#: ops whose output shape depends on the values of their input (a device sync on CUDA)
_DATA_DEPENDENT = {
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default, aten.argwhere.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten._unique.default,
    aten.nonzero_numpy.default, aten.equal.default, aten.is_nonzero.default,
}
_FACTORY_KWARG = "device"


class DevicePlacementError(RuntimeError):
    """An op mixed a tensor on the emulated device with a tensor left on the CPU (or a real
    device tensor that is not an emulated one)."""


class HostSyncError(RuntimeError):
    """A host synchronisation inside a region that must have none (:meth:`EmulatedDevice.no_sync`)."""


class OnDevice(torch.Tensor):
    """A tensor on the emulated device: reports ``device="emu:0"``, holds its values in
    :attr:`elem` (a CPU tensor of the same shape, dtype and strides)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, device=register_device(), requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def __repr__(self):  # noqa: D105
        return f"OnDevice({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mode = EmulatedDevice.current
        if mode is None:
            raise DevicePlacementError(f"{func}: a tensor on the emulated device outside EmulatedDevice")
        return mode._run(func, args, kwargs or {})


_LIB: list = []


def _register_kernels() -> None:
    """The three kernels torch calls on the device below the dispatch mode (``torch.tensor(data,
    device=...)`` and ``torch.as_tensor`` build a CPU tensor and copy it over with the Python
    dispatch key excluded): an empty tensor (a wrapper of an empty CPU tensor) and the copy into
    it (counted as a host-to-device copy)."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (a Python backend for the PrivateUse1 key)

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return OnDevice(torch.empty_strided(size, stride, dtype=dtype, device="cpu"))

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return OnDevice(torch.empty(size, dtype=dtype, device="cpu"))

    def copy_from(src, dst, non_blocking=False):
        mode = EmulatedDevice.current
        if mode is not None and isinstance(dst, OnDevice) and not isinstance(src, OnDevice):
            mode._sync("host-to-device copy", "aten._copy_from")
        if mode is not None and isinstance(src, OnDevice) and not isinstance(dst, OnDevice):
            mode._sync("device-to-host copy", "aten._copy_from")
        host_value(dst).copy_(host_value(src))
        return dst

    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    _LIB.append(lib)  # the registrations live as long as the library object


def _is_device(kw: Any) -> bool:
    return kw is not None and torch.device(kw).type == DEVICE_TYPE


def host_value(t: Any) -> Any:
    """The CPU tensor behind a tensor on the emulated device (for tests); other values unchanged."""
    return t.elem if isinstance(t, OnDevice) else t


class EmulatedDevice(TorchDispatchMode):
    """The dispatch mode that emulates the accelerator (see the module docstring).

    strict_scalars: a 0-dim CPU tensor mixed with device tensors is a placement error too.
    record_sites: count each sync's place in the project's code (:attr:`sites`).
    Attributes after use: ``syncs`` (Counter of ``(region, kind)``), ``ops`` (Counter of aten op
    counts per region), ``sites`` (with ``record_sites``).
    Regions: ``"outside"`` and the name given to :meth:`region` / :meth:`no_sync`.
    """

    current: "EmulatedDevice | None" = None

    def __init__(self, strict_scalars: bool = False, record_sites: bool = False):
        super().__init__()
        register_device()
        self.strict_scalars = strict_scalars
        self.record_sites = record_sites
        self.syncs: Counter = Counter()
        self.ops: Counter = Counter()
        #: with ``record_sites``: Counter of ``(region, kind, "medpfl/<file>.py:<line>")``, the
        #: innermost frame of the project's code that caused the sync
        self.sites: Counter = Counter()
        self._region = "outside"
        self._forbid = False

    # ----- regions --------------------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, name: str, forbid_sync: bool = False) -> Iterator[None]:
        """Count ops and syncs under ``name``; with ``forbid_sync`` the first host sync raises
        :class:`HostSyncError`."""
        prev = (self._region, self._forbid)
        self._region, self._forbid = name, forbid_sync or self._forbid
        try:
            yield
        finally:
            self._region, self._forbid = prev

    def no_sync(self, name: str = "local steps"):
        """A region in which a host synchronisation raises :class:`HostSyncError`."""
        return self.region(name, forbid_sync=True)

    def __enter__(self):
        self._outer = EmulatedDevice.current
        EmulatedDevice.current = self
        return super().__enter__()

    def __exit__(self, *exc):
        EmulatedDevice.current = self._outer
        return super().__exit__(*exc)

    # ----- the emulation --------------------------------------------------------------------
    def _sync(self, kind: str, func) -> None:
        self.syncs[(self._region, kind)] += 1
        if self.record_sites:
            self.sites[(self._region, kind, _caller())] += 1
        if self._forbid:
            stack = "".join(traceback.format_stack(limit=14)[:-3])
            raise HostSyncError(f"host synchronisation ({kind}, {func}) in region {self._region!r}:\n{stack}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._run(func, args, kwargs or {})

    def _run(self, func, args, kwargs):
        flat = pytree.arg_tree_leaves(*args, **kwargs)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on_dev = [t for t in tensors if isinstance(t, OnDevice)]
        to_dev = _is_device(kwargs.get(_FACTORY_KWARG))
        if on_dev or to_dev:
            for t in tensors:
                if not isinstance(t, OnDevice) and t.device.type != "cpu":
                    raise DevicePlacementError(f"{func}: mixes tensors on the device with a {t.device} tensor "
                                               f"{tuple(t.shape)}")
        self.ops[self._region] += 1
        if func in (aten._to_copy.default, aten.to.dtype_layout, aten.to.device):
            src = args[0]
            dst_dev = kwargs.get("device", args[1] if func is aten.to.device else None)
            if isinstance(src, OnDevice) and dst_dev is not None and not _is_device(dst_dev):
                self._sync("device-to-host copy", func)
                return func(src.elem, *args[1:], **kwargs)
            if not isinstance(src, OnDevice) and to_dev:
                self._sync("host-to-device copy", func)
                kw = {**kwargs, "device": torch.device("cpu")}
                return OnDevice(func(src, *args[1:], **kw))
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, OnDevice) and not isinstance(src, OnDevice):
                self._sync("host-to-device copy", func)
                dst.elem.copy_(src)
                return dst
            if not isinstance(dst, OnDevice) and isinstance(src, OnDevice):
                self._sync("device-to-host copy", func)
                dst.copy_(src.elem)
                return dst
        if on_dev or to_dev:
            if func is aten._local_scalar_dense.default:
                self._sync("value read on the host", func)
                return func(args[0].elem)
            if func in _DATA_DEPENDENT or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
                self._sync("data-dependent shape", func)
            if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
                idx = args[1]
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx if i is not None):
                    self._sync("data-dependent shape (boolean index)", func)
            host = [t for t in tensors if not isinstance(t, OnDevice)
                    and (t.dim() > 0 or self.strict_scalars)]
            if host and on_dev:
                shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in host)
                raise DevicePlacementError(f"{func}: mixes tensors on the device with CPU tensor(s) {shapes}")
            if to_dev:
                kwargs = {**kwargs, _FACTORY_KWARG: torch.device("cpu")}

            def unwrap(x):
                return x.elem if isinstance(x, OnDevice) else x

            out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
            if func is aten.set_.source_Tensor:
                raise DevicePlacementError(f"{func}: set_ on an emulated device tensor is not supported")
            # in-place and out= ops return their (wrapped) first argument
            if func._schema.is_mutable and on_dev and isinstance(args[0], OnDevice) and out is args[0].elem:
                return args[0]
            return pytree.tree_map(lambda x: OnDevice(x) if isinstance(x, torch.Tensor) else x, out)
        return func(*args, **kwargs)


def _caller() -> str:
    """``medpfl/<path>:<line>`` of the innermost frame in the project's code outside this module."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/medpfl/" in name and not name.endswith("emulated_device.py"):
            return "src/medpfl/" + name.rsplit("/medpfl/", 1)[1] + f":{f.f_lineno}"
        f = f.f_back
    return "?"


def on_device(tree: Any) -> Any:
    """Every tensor of ``tree`` (any pytree) moved to the emulated device (call under the mode)."""
    return pytree.tree_map(lambda t: t.to(register_device()) if isinstance(t, torch.Tensor) else t, tree)


def host_tensors(tree: Any, where: str = "") -> list[str]:
    """Paths of the tensors of ``tree`` (any pytree, also LowRank) that are not on the emulated
    device (plain CPU tensors), for assertions."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [f"{where}{pytree.keystr(p)} {tuple(v.shape)} {v.device}" for p, v in leaves
            if isinstance(v, torch.Tensor) and not isinstance(v, OnDevice)]
