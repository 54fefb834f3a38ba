"""CachedLauncher: Triton's launch the first time per specialization, the compiled kernel's launcher after."""
import pytest
import torch
from triton import knobs

from fp8mla.kernels import launcher
from fp8mla.kernels.launcher import CachedLauncher


class FakeKernel:
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.runs = []

    def launch_metadata(self, grid, stream, *params):
        return ("meta", grid, stream, len(params))

    def run(self, *args):
        self.runs.append(args)


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
    (run,) = kernel.runs
    assert run[:9] == (5, 2, 1, 7, "function", "packed", ("meta", (5, 2, 1), 7, 4), knobs.runtime.launch_enter_hook,
                       knobs.runtime.launch_exit_hook)
    assert run[9:] == (y, 48, 0.25, 16)


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
