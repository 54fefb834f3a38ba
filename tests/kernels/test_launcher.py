"""CachedLauncher: Triton's launch the first time per specialization, the driver's launcher directly after
(triton_compat.direct_launch, checked here against Triton's own launch path of the installed release)."""
import pytest
import torch
import triton
from triton import knobs

from fp8mla.kernels import launcher, triton_compat
from fp8mla.kernels.launcher import CachedLauncher


class FakeKernel:
    """A compiled kernel whose direct launches are recorded."""
    def __init__(self):
        self.runs = []


class FakeJit:
    """Stands for a @triton.jit function: ``fn[grid](*args, **kwargs)`` 'compiles' and launches."""
    arg_names = ["x", "n", "scale", "BLOCK"]

    def __init__(self):
        self.triton_launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kernel = FakeKernel()
            self.triton_launches.append((grid, args, kwargs, kernel))
            return kernel
        return launch


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launcher, "_interpreting", lambda: False)
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda device: 7)
    monkeypatch.setattr(launcher, "_current_arch", lambda: 90)
    monkeypatch.setattr(launcher, "direct_launch",
                        lambda kernel, params: lambda grid, stream, params: kernel.runs.append((grid, stream, params)))
    fn = FakeJit()
    return fn, CachedLauncher(fn)


def test_second_launch_skips_triton_and_passes_every_parameter(fake):
    fn, launch = fake
    x = torch.zeros(64)
    launch((4,), (x, 32, 0.5), dict(BLOCK=16), num_warps=4)
    assert len(fn.triton_launches) == 1
    grid, args, kwargs, kernel = fn.triton_launches[0]
    assert (grid, args, kwargs) == ((4,), (x, 32, 0.5), dict(BLOCK=16, enable_fp_fusion=True, num_warps=4)) and kernel.runs == []
    y = torch.ones(64)  # same dtype and alignment, another int with the same properties
    launch((5, 2), (y, 48, 0.25), dict(BLOCK=16), num_warps=4)
    assert len(fn.triton_launches) == 1
    assert kernel.runs == [((5, 2, 1), 7, (y, 48, 0.25, 16))]


def test_a_key_from_the_caller_stands_for_the_arguments(fake):
    fn, launch = fake
    launch((1,), (torch.zeros(64), 32, 0.5), dict(BLOCK=16), key="call A")
    launch((1,), (torch.zeros(64)[1:], 40, 0.5), dict(BLOCK=16), key="call A")   # trusted: not keyed again
    assert len(fn.triton_launches) == 1
    launch((1,), (torch.zeros(64), 32, 0.5), dict(BLOCK=16), key="call B")
    assert len(fn.triton_launches) == 2


def test_a_launch_hook_makes_every_launch_go_through_triton(fake):
    fn, launch = fake
    launch((1,), (torch.zeros(64), 32, 0.5), dict(BLOCK=16))
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch((1,), (torch.zeros(64), 32, 0.5), dict(BLOCK=16))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launch((1,), (torch.zeros(64), 32, 0.5), dict(BLOCK=16))
    assert len(fn.triton_launches) == 2 and len(fn.triton_launches[0][3].runs) == 1


@pytest.mark.parametrize("args,constexprs,options", [
    ((torch.zeros(64)[1:], 32, 0.5), dict(BLOCK=16), dict(num_warps=4)),      # a pointer not 16-byte aligned
    ((torch.zeros(64, dtype=torch.float16), 32, 0.5), dict(BLOCK=16), dict(num_warps=4)),  # another dtype
    ((torch.zeros(64), 1, 0.5), dict(BLOCK=16), dict(num_warps=4)),            # an int equal to 1
    ((torch.zeros(64), 40, 0.5), dict(BLOCK=16), dict(num_warps=4)),           # an int not divisible by 16
    ((torch.zeros(64), 2 ** 33, 0.5), dict(BLOCK=16), dict(num_warps=4)),      # a 64-bit int
    ((torch.zeros(64), 32, 0.5), dict(BLOCK=32), dict(num_warps=4)),           # another constexpr
    ((torch.zeros(64), 32, 0.5), dict(BLOCK=16), dict(num_warps=8)),           # another option
])
def test_another_specialization_goes_through_triton(fake, args, constexprs, options):
    fn, launch = fake
    launch((4,), (torch.zeros(64), 32, 0.5), dict(BLOCK=16), num_warps=4)
    launch((4,), args, constexprs, **options)
    assert len(fn.triton_launches) == 2 and fn.triton_launches[0][3].runs == []


def test_constexprs_must_be_the_last_parameters_in_order(fake):
    fn, launch = fake
    with pytest.raises(TypeError, match="constexprs"):
        launch((1,), (torch.zeros(4), 32), dict(BLOCK=16, scale=0.5))


def test_the_interpreter_launches_through_triton_every_time(fake, monkeypatch):
    fn, launch = fake
    monkeypatch.setattr(launcher, "_interpreting", lambda: True)
    for _ in range(2):
        launch((1,), (torch.zeros(4), 32, 0.5), dict(BLOCK=16))
    assert len(fn.triton_launches) == 2 and launch.kernels == {}


def test_another_current_device_goes_through_triton(fake, monkeypatch):
    fn, launch = fake
    launch((1,), (torch.zeros(4), 32, 0.5), dict(BLOCK=16))
    monkeypatch.setattr(launcher, "_current_device", lambda: 1)
    launch((1,), (torch.zeros(4), 32, 0.5), dict(BLOCK=16))
    assert len(fn.triton_launches) == 2


def test_tensor_descriptors_are_keyed_by_block_shape_and_strides(fake):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from fp8mla.kernels.hopper.layouts import LAT_SMEM

    fn, launch = fake

    def desc(rows=128, block=64, width=576, col=0):
        pages = torch.zeros(256, width, dtype=torch.uint8).view(torch.float8_e4m3fn)
        return TensorDescriptor.from_tensor(pages[:rows, col:col + 512], [block, 512], LAT_SMEM.value)

    launch((1,), (desc(), 32, 0.5), dict(BLOCK=16))
    launch((1,), (desc(col=16), 32, 0.5), dict(BLOCK=16))   # another descriptor of the same kind: reused
    assert len(fn.triton_launches) == 1
    for other in (desc(block=32), desc(rows=256), desc(width=640)):  # block, shape, strides
        launch((1,), (other, 32, 0.5), dict(BLOCK=16))
    assert len(fn.triton_launches) == 4


def test_tensor_descriptor_specs_are_remembered_per_object(fake):
    """A descriptor's spec is worked out once per object (kept alive while remembered, so its id is not reused)
    and stands in the key as a token shared by equal specs; the memory is bounded."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from fp8mla.kernels.hopper.layouts import LAT_SMEM

    fn, launch = fake
    pages = torch.zeros(128, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    descs = [TensorDescriptor.from_tensor(pages[:, :512], [64, 512], LAT_SMEM.value) for _ in range(300)]
    for d in descs:
        launch((1,), (d, 32, 0.5), dict(BLOCK=16))
    assert len(fn.triton_launches) == 1 and len(launch._descriptors) <= 257
    kept = launch._descriptors[id(descs[-1])]
    assert kept[0] is descs[-1]
    narrow = TensorDescriptor.from_tensor(pages[:, :512], [32, 512], LAT_SMEM.value)
    launch((1,), (narrow, 32, 0.5), dict(BLOCK=16))
    assert len(fn.triton_launches) == 2 and launch._descriptors[id(narrow)][1] != kept[1]


class FakeCudaUtils:
    """The driver's utils, where the launch path encodes a TMA descriptor (no CUDA here)."""
    def __init__(self):
        self.encoded = []

    def fill_tma_descriptor(self, *args):
        self.encoded.append(args)
        return ("tensor map", *args)

    fill_tma_descriptor_tiled = fill_tma_descriptor   # (3.7's name on)


@pytest.fixture
def triton_launch_path(monkeypatch):
    """Triton's own launch path of the installed release (its CudaLauncher.__call__ and descriptor wrapper) over a
    recording driver launcher: returns (make_kernel(signature, tensordesc_meta), the recorded raw launches, the
    recorded descriptor encodings)."""
    from triton.backends.nvidia import driver as nvidia_driver
    from triton.runtime import driver

    utils = FakeCudaUtils()
    fake_driver = type("FakeDriver", (), {"utils": utils})()
    previous = driver._active
    driver.set_active(fake_driver)
    raw_launches = []

    def make_kernel(signature, tensordesc_meta):
        run = object.__new__(nvidia_driver.CudaLauncher)
        run.launch = nvidia_driver.wrap_handle_tensordesc(lambda *args: raw_launches.append(args), signature,
                                                          tensordesc_meta)
        run.num_ctas, run.global_scratch_size, run.profile_scratch_size = 1, 0, 0
        run.global_scratch_align = run.profile_scratch_align = 1
        run.launch_cooperative_grid, run.launch_pdl = False, False
        if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7):   # the shared launcher's inputs
            run.arg_annotations, run.kernel_signature, run.gsan_enabled = "annotations", "signature", False
        metadata = type("Metadata", (), {"tensordesc_meta": tensordesc_meta})()
        return type("Kernel", (), {"run": run, "function": "function", "packed_metadata": (4, 1, 1024),
                                   "metadata": metadata})()

    yield make_kernel, raw_launches, utils.encoded
    driver._active = previous


def _descriptor(col=0):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from fp8mla.kernels.hopper.layouts import LAT_SMEM

    pages = torch.zeros(256, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return TensorDescriptor.from_tensor(pages[:, col:col + 512], [64, 512], LAT_SMEM.value)


@pytest.mark.parametrize("with_descriptors", [False, True])
def test_direct_launch_passes_the_driver_what_triton_passes(triton_launch_path, with_descriptors):
    """The driver's launcher gets the same arguments from direct_launch as from the compiled kernel's run (Triton's
    launch path, release by release); a descriptor is encoded once per object, not once per launch."""
    make_kernel, raw_launches, encoded = triton_launch_path
    x = torch.zeros(64)
    if with_descriptors:
        desc, other = _descriptor(), _descriptor(col=16)
        signature = {"x": "*fp32", "lat": "tensordesc<fp8e4nv[64, 512]>", "n": "i32",
                     "rope": "tensordesc<fp8e4nv[64, 512]>", "BLOCK": "constexpr"}
        meta = [dict(swizzle=3, elem_size=1, elem_type=0, block_size=[64, 512], fp4_padded=False)] * 2
        params = (x, desc, 32, other, 16)
    else:
        signature = {"x": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}
        meta = None
        params = (x, 32, 0.5, 16)
    kernel = make_kernel(signature, meta)
    kernel.run(5, 2, 1, 7, kernel.function, kernel.packed_metadata, None, None, None, *params)
    go = triton_compat.direct_launch(kernel, params)
    for _ in range(3):
        go((5, 2, 1), 7, params)
    assert len(raw_launches) == 4
    through_triton, direct = raw_launches[0], raw_launches[1]

    def flat(args):   # a tensor as its address, which is what direct_launch passes (the launcher takes both)
        return [flat(a) if isinstance(a, (list, tuple)) else a.data_ptr() if isinstance(a, torch.Tensor) else a
                for a in args]
    assert flat(direct) == flat(through_triton)
    kernel_args = direct[-1] if isinstance(direct[-1], list) else direct   # (3.7 on: one sequence)
    assert x.data_ptr() in kernel_args and not any(isinstance(a, torch.Tensor) for a in kernel_args)
    assert all(flat(launch) == flat(direct) for launch in raw_launches[2:])
    assert len(encoded) == (2 + 2 if with_descriptors else 0)   # Triton's launch: 2; direct: 2, then reused


def test_direct_launch_leaves_kernels_with_scratch_memory_to_triton(triton_launch_path):
    make_kernel, _, _ = triton_launch_path
    kernel = make_kernel({"x": "*fp32", "BLOCK": "constexpr"}, None)
    kernel.run.global_scratch_size = 128
    assert triton_compat.direct_launch(kernel, (torch.zeros(4), 16)) is None


def test_a_plan_is_made_once_per_signature_and_extra_key(monkeypatch):
    """launcher.planned: one plan per (maker, call signature, extra key); a call of no known signature gets a new
    one each time."""
    from types import SimpleNamespace

    monkeypatch.setattr(launcher, "_plans", {})
    made = []

    def make(call, parts):
        made.append((call.signature, parts))
        return object()

    a, b, unknown = (SimpleNamespace(signature=s) for s in (1, 2, None))
    assert launcher.planned(make, a, 7) is launcher.planned(make, a, 7)
    assert launcher.planned(make, a, 8) is not launcher.planned(make, a, 7)   # another schedule's parts
    assert launcher.planned(make, b, 7) is not launcher.planned(make, a, 7)
    assert launcher.planned(make, unknown, 7) is not launcher.planned(make, unknown, 7)
    assert made == [(1, 7), (1, 8), (2, 7), (None, 7), (None, 7)]
