"""Counting what a piece of work asks of the device: kernel launches and host synchronisations.

On a GPU every aten op that computes something is a kernel launch costing a few microseconds of host time,
and every op whose result the host must read (``.item()``, ``.tolist()``, ``nonzero``, a Python ``if`` on a
tensor, ...) stalls the host until the device has caught up, so the next launches cannot be queued ahead.
Both can be counted on the CPU, where the same ops run: a ``TorchDispatchMode`` sees every aten op, a
``TorchFunctionMode`` sees the tensor methods that hand data to Python without an aten op (``tolist``,
``cpu``, ``numpy``, ``__bool__``), and the Triton kernels of this package go through ``launch``, which counts
them. Under ``TRITON_INTERPRET=1`` the interpreter's own tensor traffic inside a launch is not counted: on a
GPU a launch is one call.

The autograd engine's device threads inherit the modes, so a GPU's backward is counted too; other threads (the
torch backend's worker threads) are not seen: count with one torch thread on the CPU. With ``as_device``, CPU
tensors stand in for device ones: the checks that read a tensor only where reading is free (``host_readable``)
are skipped, as on a device.

``host_side_only`` runs the work as a GPU's host would, less Triton's own launches, so that its host time can be
timed on any machine: a GPU runs the kernels while the host goes on, so where they are short the host's time per
layer (Python, op dispatch, launches) is the layer's time.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate or relabel memory without running a kernel.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
              "resize_"}
# Ops whose output size or value the host must read from the device.
_ALWAYS_SYNC = {
    "_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "unique_dim_consecutive", "bincount", "equal", "is_nonzero",
}
# Tensor methods that hand a tensor's data to Python without an aten op.
_HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
}


@dataclass
class LaunchCount:
    """What counted work asked of the device: ``ops`` (aten ops that run a kernel, by name), ``triton`` (Triton
    kernels launched, by name) and ``syncs`` (host reads of device data, by what read)."""

    ops: Counter = field(default_factory=Counter)
    triton: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)

    @property
    def launches(self) -> int:
        return sum(self.ops.values()) + sum(self.triton.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    def summary(self) -> str:
        syncs = ", ".join(f"{name} x{n}" for name, n in self.syncs.most_common()) or "none"
        return f"{self.launches} launches ({sum(self.triton.values())} Triton), {self.host_syncs} host syncs ({syncs})"


class _State:
    """What the contexts below have switched on, for every thread: the autograd engine runs a GPU's backward on a
    thread of its own, which inherits the counting modes and so must see the same counts."""

    def __init__(self) -> None:
        self.counts: list[LaunchCount] = []
        self.paused = 0
        self.as_device = 0
        self.compiling: list | None = None
        self.skipping = 0


_state = _State()


def host_readable(x: torch.Tensor) -> bool:
    """Whether reading ``x`` on the host is free: a CPU tensor (unless ``count_launches(as_device=True)`` is
    counting), not one whose read would stall a device, and not while torch.compile traces (a read would break
    its graph)."""
    return x.device.type == "cpu" and not _state.as_device and not torch.compiler.is_compiling()


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, counted by every active ``count_launches``; compiled, not run, inside
    ``compiled_not_run``; neither inside ``host_side_only``. A ``num_stages`` in ``kwargs`` is the most the launch
    may take (``_fitting_stages``)."""
    import triton  # imported by the kernel already

    counts = _state.counts
    compile_only = _state.compiling is not None
    if compile_only and any(isinstance(x, torch.Tensor) and x.device.type != "meta" for x in args):
        raise RuntimeError(f"{_kernel_name(kernel)}: kernels are compiled here, not run: pass meta tensors")
    compiles = compile_only or not _state.skipping  # a launch skipped by host_side_only compiles nothing
    if "num_stages" in kwargs and compiles and not triton.knobs.runtime.interpret:  # the interpreter has no stages
        kwargs["num_stages"] = _fitting_stages(kernel, grid, args, kwargs)
    if compile_only:  # first: a launch that fails to compile is not counted
        _state.compiling.append(kernel.warmup(*args, grid=grid, **kwargs))
    for count in counts:
        count.triton[_kernel_name(kernel)] += 1
    if compile_only or _state.skipping:
        return
    _state.paused += 1
    try:
        kernel[grid](*args, **kwargs)
    finally:
        _state.paused -= 1


# (kernel, device, launch options, first argument's dtype) -> the stages that fit. The kernels take the inputs
# their tiles hold first, so that dtype and the options fix the tiles; Triton's further specialisation on the
# arguments (aligned pointers, integers divisible by 16) leaves the tiles, and so the shared memory, as they are.
_fitted_stages: dict = {}


def _fitting_stages(kernel, grid, args, kwargs) -> int:
    """The most pipeline stages, up to the launch's ``num_stages``, whose binary fits in the shared memory one
    program may use on the GPU Triton compiles for: every stage holds one more set of tiles there, and three stages
    of wide heads need more than GPUs such as sm_86 and sm_89 have. Found once per kernel, device and launch
    options by compiling the kernel (Triton's ``warmup``), not by running it; Triton checks the same limit."""
    from triton.runtime import driver

    device = driver.active.get_current_device()
    key = (kernel, device, tuple(kwargs.items()), args[0].dtype)  # on every launch: kept cheap
    if key not in _fitted_stages:
        limit = driver.active.utils.get_device_properties(device)["max_shared_mem"]
        for stages in range(kwargs["num_stages"], 0, -1):
            need = kernel.warmup(*args, grid=grid, **{**kwargs, "num_stages": stages}).metadata.shared
            if need <= limit:
                break
        else:
            raise RuntimeError(f"{_kernel_name(kernel)} needs {need / 1024:.1f} KiB of shared memory per program, "
                               f"more than the {limit / 1024:.0f} KiB this GPU gives one: use the flex or torch "
                               "kernel backend")
        _fitted_stages[key] = stages
    return _fitted_stages[key]


def _kernel_name(kernel) -> str:
    return kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)


def compiling() -> bool:
    """Whether ``launch`` compiles instead of running here (inside ``compiled_not_run``)."""
    return _state.compiling is not None


@contextmanager
def compiled_not_run():
    """Inside, ``launch`` compiles each kernel through Triton's ``warmup`` instead of running it, and appends the
    compiled kernel to the yielded list: ``cross_compile.compiling_for`` points Triton at a GPU that is not here."""
    compiled: list = []
    previous, _state.compiling = _state.compiling, compiled
    try:
        yield compiled
    finally:
        _state.compiling = previous


def _is_sync(func, name: str, args, kwargs) -> str | None:
    if name in _ALWAYS_SYNC:
        return name
    tensor_repeats = func.name().endswith("Tensor")  # repeats given per element: the output size is their sum
    if name == "repeat_interleave" and tensor_repeats and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return f"{name} with a boolean mask"
    return None


class _OpCounter(TorchDispatchMode):
    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _state.paused:
            name = func.overloadpacket.__name__
            sync = _is_sync(func, name, args, kwargs)
            if sync is not None:
                self.count.syncs[sync] += 1
            if not (func.is_view or name in _NO_KERNEL):
                self.count.ops[name] += 1
        return func(*args, **kwargs)


class _HostReadCounter(TorchFunctionMode):
    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _state.paused:
            return func(*args, **kwargs)
        read = func in _HOST_READS or (func is torch.Tensor.to and _to_host(args[1:], kwargs))
        if read:
            self.count.syncs[f"Tensor.{func.__name__}"] += 1
            _state.paused += 1  # the aten ops under a host read are that one read
        try:
            return func(*args, **kwargs)
        finally:
            if read:
                _state.paused -= 1


def _to_host(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves the tensor to the CPU."""
    for target in (*args, kwargs.get("device")):
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            return True
    return False


@contextmanager
def host_side_only():
    """Inside, the work runs only as far as a GPU's host runs it: ``launch`` skips the Triton kernels (their outputs
    stay unwritten) and CPU tensors stand in for device ones (``count_launches(as_device=True)``). For timing the
    host's share of a layer on the CPU, with the Triton backend under TRITON_INTERPRET=1, at a small size so that
    the aten ops left compute next to nothing; on the device path nothing the host does depends on a kernel's
    output (no host reads), so it takes a GPU's steps, but for the CPU's own thread settings."""
    _state.skipping += 1
    _state.as_device += 1
    try:
        yield
    finally:
        _state.skipping -= 1
        _state.as_device -= 1


@contextmanager
def count_launches(as_device: bool = False):
    """Counts the launches and host synchronisations of the work inside (this thread, and the autograd engine's):
    yields a ``LaunchCount``.
    ``as_device``: CPU tensors stand in for device ones (module docstring)."""
    count = LaunchCount()
    _state.counts.append(count)
    _state.as_device += as_device
    try:
        with _HostReadCounter(count), _OpCounter(count):
            yield count
    finally:
        _state.as_device -= as_device
        _state.counts.remove(count)
