"""Where the 64-row FP8 kernel's time goes: copies of kernels/hopper.py with one stage removed each (their results
are wrong; they are only timed), against the working tree's, on the headline config (b=64 s_q=2 h_q=64, 8192
tokens, causal; fp8_rope_bf16 and fp8 with an e4m3 q):

    PYTHONPATH=src python3 scripts/hopper_ablate.py [--out DIR]

Each ablation is a text substitution that must match the kernel exactly once (an error says which one no longer
does). The copies go to DIR (a temporary folder by default) and are timed like ``hopper_check.py --variants``.
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import hopper_check  # noqa: E402

KERNEL = Path(__file__).parent.parent / "src" / "fp8mla" / "kernels" / "hopper.py"
SOFTMAX = ("p, alpha, m_new, l_i = online_softmax(sc, blk, key_limit, min_key_limit, m_i, l_i, sm_scale_log2)",
           "p, alpha, m_new, l_i = sc, gl.full_like(m_i, 1.0), m_i, l_i")
TRANSPOSE = ("""        if valid < PAGE_SIZE:
            _transpose_chunk(src, dst, valid, True)
        else:
            _transpose_chunk(src, dst, valid, False)
""", "        pass\n")
RESCALE = ("o * alpha[:, None],", "o,")
ABLATIONS = {"no_softmax_math": [SOFTMAX], "no_transposes": [TRANSPOSE], "no_rescale": [RESCALE],
             "none_of_the_three": [SOFTMAX, TRANSPOSE, RESCALE]}


def write_ablations(folder: Path) -> list:
    source = KERNEL.read_text()
    paths = []
    for name, substitutions in ABLATIONS.items():
        text = source
        for old, new in substitutions:
            if text.count(old) != 1:
                raise SystemExit(f"{name}: the kernel no longer has exactly one {old.strip()[:60]!r}")
            text = text.replace(old, new)
        path = folder / f"{name}.py"
        path.write_text(text)
        paths.append(str(path))
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the ablated copies go")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    variants = hopper_check.load_variants(write_ablations(folder))
    hopper_check.TIMED = [hopper_check.TIMED[0]]
    hopper_check.PATHS = [("fp8_rope_bf16", False), ("fp8", True)]
    hopper_check.time_variants(variants, args.rounds)


if __name__ == "__main__":
    main()
