"""The measurement scripts that BENCHMARKS.md's commands run, where they can be checked without a GPU."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))


@pytest.mark.parametrize("kernel", ["fp8", "bf16"])
def test_ablations_match_the_kernel(tmp_path, kernel):
    """Each ablated copy of hopper_ablate.py is a text substitution that must still match its kernel exactly once
    (it exits naming the one that no longer does), and each copy differs from the kernel."""
    hopper_ablate = pytest.importorskip("hopper_ablate")
    source = (hopper_ablate.KERNELS / hopper_ablate.SETUPS[kernel][0]).read_text()
    paths = hopper_ablate.write_ablations(tmp_path, kernel)
    assert len(paths) == len(hopper_ablate.SETUPS[kernel][2])
    for path in paths:
        text = Path(path).read_text()
        assert text != source + hopper_ablate.SETUPS[kernel][3], path
        compile(text, path, "exec")   # still Python
