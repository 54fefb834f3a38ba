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


def test_hopper_check_loads_a_tree_whole(tmp_path):
    """hopper_check --trees: a source tree's Hopper kernels come with the tree's own helpers (a change to
    hopper_common.py is part of what is timed), not with the working tree's."""
    import shutil

    hopper_check = pytest.importorskip("hopper_check")
    src = Path(__file__).parent.parent / "src" / "fp8mla"
    shutil.copytree(src, tmp_path / "next" / "src" / "fp8mla", ignore=shutil.ignore_patterns("__pycache__"))
    common = tmp_path / "next" / "src" / "fp8mla" / "kernels" / "hopper_common.py"
    common.write_text(common.read_text() + "\nTREE_MARK = 1\n")
    variants = hopper_check.load_variants([], [tmp_path / "next"])
    assert list(variants) == ["working tree", "next"]
    tree_hopper = sys.modules[variants["next"].__module__]
    assert Path(tree_hopper.__file__).is_relative_to(tmp_path)
    assert sys.modules[tree_hopper.__package__ + ".hopper_common"].TREE_MARK == 1
    assert not hasattr(sys.modules["fp8mla.kernels.hopper_common"], "TREE_MARK")
    assert variants["next"].formats == hopper_check.hopper.SUPPORTED_FORMATS


def test_mma_ceiling_issues_the_kernels_wgmmas(env_without_interpreter):
    """mma_ceiling.py's kernel (the 64-row FP8 kernel's wgmmas alone) compiles for sm_90a to the same wgmma shapes
    as hopper.py's, under the same registers, without spills or serialized wgmmas: otherwise its ceiling would not
    be that design's."""
    import json
    import subprocess

    script = Path(__file__).parent.parent / "scripts" / "mma_ceiling.py"
    out = subprocess.run([sys.executable, str(script), "--sass"], env=env_without_interpreter, check=True,
                         capture_output=True, text=True, timeout=600).stdout
    sides = json.loads(out)
    assert sides["both"]["wgmma_shapes"] == ["QGMMA.64x256x32", "QGMMA.64x64x32"]
    assert sides["Q.K^T only"]["wgmma_shapes"] == ["QGMMA.64x64x32"]
    assert sides["P.V only"]["wgmma_shapes"] == ["QGMMA.64x256x32"]
    for r in sides.values():
        assert r["stack"] == 0 and r["LDL"] == 0 and r["STL"] == 0 and not r["wgmma_serialized"], r
        assert r["regs"] == 168 and r["UTMALDG"] == 0
